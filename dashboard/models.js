// The models view: place a model (previews first: which nodes, which layers,
// how much memory, or why it cannot fit; Enter previews, a button places the
// best or any previewed option), follow each rank until it is ready, delete
// instances, and see (and delete) the copies of models on nodes.

import { api } from "./api.js";
import { ago, badge, bar, bytes, html, rankLayers, seconds, shortModel } from "./format.js";

const NODE_COLORS = ["#6366f1", "#0891b2", "#d97706", "#db2777", "#16a34a", "#7c3aed"];

export class ModelsView {
  #errors = new Map(); // instance or "node model" key -> the last action's error
  #armed = new Set(); // models whose "Delete copy" was clicked once (kept across re-renders)
  #previewed = null; // the last preview: its request and placements

  constructor(cluster, elements) {
    this.cluster = cluster;
    this.el = elements;
    // Enter in a field (or the Preview button) previews: placing may start a
    // download of gigabytes, so only a click on a Place button places.
    elements.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.preview();
    });
    elements.placeButton.addEventListener("click", () => {
      if (this.el.form.reportValidity()) this.place();
    });
    elements.previews.addEventListener("click", (event) => {
      const option = event.target.closest("[data-place-option]")?.dataset.placeOption;
      if (option !== undefined) this.placeOption(Number(option));
    });
    elements.instances.addEventListener("click", (event) => this.#onInstanceClick(event));
    elements.models.addEventListener("click", (event) => this.#onModelClick(event));
  }

  request() {
    const max = this.el.maxNodes.value;
    return {
      model_id: this.el.modelId.value.trim(),
      min_nodes: Number(this.el.minNodes.value || 1),
      ...(max ? { max_nodes: Number(max) } : {}),
      sharding: this.el.sharding.value,
    };
  }

  say(text, kind) {
    this.el.message.className = `message ${kind}`;
    this.el.message.textContent = text;
  }

  async preview() {
    if (!this.el.form.reportValidity()) return;
    const body = this.request();
    const params = new URLSearchParams(Object.entries(body).map(([k, v]) => [k, String(v)]));
    this.say("asking for placements…", "muted");
    try {
      const result = await api(`/instance/previews?${params}`);
      const n = result.placements.length;
      this.#previewed = { body, placements: result.placements };
      this.say(`${n} placement${n === 1 ? "" : "s"} fit, best first: Place places the best; "Place this one" any of them.`, "ok");
      this.el.previews.innerHTML = result.placements.map((p, i) => this.#previewCard(p, i).text).join("");
    } catch (error) {
      this.#previewed = null;
      this.say(`cannot place ${body.model_id}: ${error.message}`, "error");
      this.el.previews.innerHTML = "";
    }
  }

  /** Place the previewed option `index` exactly as it was shown. */
  async placeOption(index) {
    const placement = this.#previewed?.placements[index];
    if (!placement) return;
    const { body } = this.#previewed;
    this.say(`placing ${body.model_id} (option ${index + 1})…`, "muted");
    const ranks = placement.ranks.map(({ node_id, start_layer, end_layer }) => ({ node_id, start_layer, end_layer }));
    try {
      const placed = await api("/place_instance", {
        method: "POST",
        body: { model_id: body.model_id, sharding: placement.sharding, ranks },
      });
      this.say(`placed ${body.model_id} (option ${index + 1}): instance ${placed.instance_id}. Its ranks are listed below.`, "ok");
      this.el.previews.innerHTML = "";
      this.#previewed = null;
      await this.cluster.update();
    } catch (error) {
      this.say(`cannot place ${body.model_id}: ${error.message}`, "error");
    }
  }

  async place() {
    const body = this.request();
    this.say(`placing ${body.model_id}…`, "muted");
    try {
      const placed = await api("/place_instance", { method: "POST", body });
      this.say(`placed ${body.model_id}: instance ${placed.instance_id}. Its ranks are listed below.`, "ok");
      this.el.previews.innerHTML = "";
      await this.cluster.update();
    } catch (error) {
      this.say(`cannot place ${body.model_id}: ${error.message}`, "error");
    }
  }

  #color(nodeId) {
    const ids = Object.keys(this.cluster.state?.nodes ?? {}).sort();
    return NODE_COLORS[Math.max(0, ids.indexOf(nodeId)) % NODE_COLORS.length];
  }

  #previewCard(placement, index) {
    const layers = placement.ranks[placement.ranks.length - 1].end_layer;
    const downloaded = placement.download_progress / placement.ranks.length;
    const n = placement.ranks.length;
    // A tensor rank's share is the same slice of every layer: equal parts of the bar.
    const width = (r) => (placement.sharding === "tensor" ? 1 : r.end_layer - r.start_layer);
    return html`<div class="preview" data-preview="${index}" data-sharding="${placement.sharding}">
      <div class="preview-head"><b>${index === 0 ? "Best placement" : `Option ${index + 1}`}</b>
        <span class="muted">${placement.sharding} · ${n} node${n > 1 ? "s" : ""} ·
        ${layers} layers · files already on the nodes: ${(downloaded * 100).toFixed(0)}%</span>
        <span class="grow"></span><button type="button" class="small-button" data-place-option="${index}">Place this one</button></div>
      <div class="layer-bar">${placement.ranks.map(
        (r) => html`<span style="flex:${width(r)};background:${this.#color(r.node_id)}"
          title="${r.node_id}">${this.cluster.label(r.node_id)}</span>`,
      )}</div>
      <table class="ranks"><tr><th>rank</th><th>node</th><th>layers</th><th>memory needed</th><th>free RAM now</th></tr>
      ${placement.ranks.map((r, i) => {
        const t = this.cluster.state?.nodes[r.node_id]?.telemetry;
        return html`<tr><td>${i}</td><td class="mono"><i class="dot" style="background:${this.#color(r.node_id)}"></i>${this.cluster.label(r.node_id)}</td>
          <td>${rankLayers(r, placement.sharding, placement.ranks)}</td>
          <td>${bytes(placement.memory_bytes[r.node_id])}</td><td>${t ? bytes(t.ram_available) : "—"}</td></tr>`;
      })}</table>
    </div>`;
  }

  #download(d) {
    if (!d) return html`<span class="muted">waiting</span>`;
    const source = d.source ? ` · from ${d.source}` : "";
    if (d.status === "downloading") {
      return html`${bar(d.bytes_done, d.bytes_total)} ${bytes(d.bytes_done)} / ${bytes(d.bytes_total)}
        <span class="muted">· ${bytes(d.speed_bytes_per_s)}/s · ETA ${seconds(d.eta_seconds)}${source}</span>`;
    }
    const size = d.bytes_total > 0 ? `${bytes(d.bytes_total)} · ` : "";
    return html`${badge(d.status)} <span class="muted">${size}${d.files_done}/${d.files_total} files${source}</span>
      ${d.error ? html`<div class="error">${d.error}</div>` : ""}`;
  }

  #instanceCard(instance) {
    const error = this.#errors.get(instance.instance_id);
    return html`<div class="instance" data-instance-id="${instance.instance_id}" data-status="${instance.status}">
      <div class="instance-head"><b>${instance.model_id}</b>
        <span class="muted mono small">${instance.instance_id}</span> ${badge(instance.status)}
        <span class="muted small" data-sharding="${instance.sharding}">${instance.ranks.length > 1 ? instance.sharding : "whole"}</span>
        ${this.#replica(instance.instance_id)}
        <span class="grow"></span>
        <button type="button" class="danger" data-delete-instance="${instance.instance_id}">Delete</button></div>
      ${error ? html`<div class="error">${error}</div>` : ""}
      ${instance.moved ? html`<div class="moved small">${this.#moved(instance.moved)}</div>` : ""}
      <table class="ranks"><tr><th>rank</th><th>node</th><th>layers</th><th>files</th><th>runner</th></tr>
      ${instance.ranks.map(
        (r, i) => html`<tr data-rank="${i}" data-node-id="${r.node_id}" data-runner="${r.runner?.status ?? "none"}"
            data-download="${r.download?.status ?? "none"}">
          <td>${i}</td><td class="mono">${this.cluster.label(r.node_id)}</td><td>${rankLayers(r, instance.sharding, instance.ranks)}</td>
          <td>${this.#download(r.download)}</td>
          <td>${r.runner ? badge(r.runner.status) : html`<span class="muted">not started</span>`}
            ${r.runner?.error ? html`<div class="error">${r.runner.error}</div>` : ""}</td></tr>`,
      )}</table>
    </div>`;
  }

  /** A model whose instance was lost and is not placed again (yet), and why. */
  #unplacedCard(modelId, unplaced) {
    const status = unplaced.given_up ? "not placed" : "waiting for a node";
    const what = unplaced.given_up
      ? "Lost its instance; the cluster stopped placing it again"
      : "Lost its instance; placed again as soon as a node can take it";
    return html`<div class="instance" data-unplaced="${modelId}" data-status="${status}">
      <div class="instance-head"><b>${modelId}</b> ${badge(status)}
        <span class="muted small">lost ${ago(this.cluster.nodeNow() - unplaced.since_ms)}</span></div>
      <div class="${unplaced.given_up ? "error" : "moved"} small">${what}: ${unplaced.reason}</div>
    </div>`;
  }

  /** The instances' cards, a model's replicas grouped under it. */
  #byModel(instances) {
    const groups = new Map();
    for (const instance of instances) {
      groups.set(instance.model_id, [...(groups.get(instance.model_id) ?? []), instance]);
    }
    return [...groups.entries()].map(([modelId, group]) =>
      group.length === 1
        ? this.#instanceCard(group[0]).text
        : html`<div class="replica-group" data-replicas-of="${modelId}">
            <div class="replica-head"><b>${modelId}</b> <span class="muted">${group.length} replicas: each request goes to the one with the longest cached prefix of its prompt, unless it is much busier</span></div>
            ${group.map((i) => this.#instanceCard(i))}</div>`.text,
    );
  }

  /** What routing knows of a replica: its load and how much its prefix cache holds. */
  #replica(instanceId) {
    const report = this.cluster.state.replicas?.[instanceId];
    if (!report) return "";
    const blocks = report.cached.length;
    return html`<span class="muted small" data-replica-load="${report.load}">load ${report.load} · cache summary: ${blocks} blocks of 128 tokens</span>`;
  }

  /** "Moved from node 3f2a9c · studio after it was lost." */
  #moved(moved) {
    const from = moved.from_nodes.map((n) => this.cluster.label(n)).join(", ") || "another node";
    return moved.reason === "node_lost"
      ? `Moved from node ${from} after it was lost.`
      : `Placed again after its runner failed on node ${from}.`;
  }

  #copies(modelId) {
    const copies = [];
    for (const [nodeId, models] of Object.entries(this.cluster.state.downloads)) {
      const d = models[modelId];
      if (!d) continue;
      const node = this.cluster.state.nodes[nodeId];
      const key = `${nodeId} ${modelId}`;
      const here = nodeId === this.cluster.nodeId;
      // DELETE /models/{id} acts on the node whose API answers: this node's copies
      // are deleted from here; another node's from its own dashboard.
      const action = here
        ? this.#armed.has(modelId)
          ? html`<button type="button" class="small-button danger" data-delete-copy="${modelId}" data-armed>Really delete?</button>`
          : html`<button type="button" class="small-button" data-delete-copy="${modelId}">Delete copy</button>`
        : node?.api_address
          ? html`<a class="small" href="http://${node.api_address}/#models" target="_blank" rel="noopener">on its dashboard</a>`
          : "";
      copies.push(html`<div class="copy" data-node-id="${nodeId}" data-copy-status="${d.status}">
        <span class="mono">${this.cluster.label(nodeId)}</span> ${badge(d.status)}
        <span class="muted small">${d.status === "downloading" ? `${bytes(d.bytes_done)} / ${bytes(d.bytes_total)}` : `${d.files_done}/${d.files_total} files`}</span>
        ${action}${this.#errors.has(key) ? html`<span class="error small">${this.#errors.get(key)}</span>` : ""}
        ${d.error ? html`<span class="error small">${d.error}</span>` : ""}</div>`);
    }
    return copies.length ? copies : html`<span class="muted">no node has its files yet</span>`;
  }

  render() {
    const { state, instances } = this.cluster;
    if (!state) return;
    // A question asked about a copy that has gone since is not asked again of a new one.
    const mine = state.downloads[this.cluster.nodeId] ?? {};
    for (const modelId of this.#armed) if (!mine[modelId]) this.#armed.delete(modelId);
    const unplaced = Object.entries(state.unplaced ?? {}).sort(([a], [b]) => a.localeCompare(b));
    this.el.instances.innerHTML =
      unplaced.map(([modelId, u]) => this.#unplacedCard(modelId, u).text).join("") +
      (instances.length || unplaced.length
        ? this.#byModel(instances).join("")
        : html`<p class="muted">No instance yet: place a model above.</p>`.text);
    const cards = Object.values(state.cards).sort((a, b) => a.model_id.localeCompare(b.model_id));
    this.el.datalist.innerHTML = cards.map((c) => html`<option value="${c.model_id}">`.text).join("");
    this.el.models.innerHTML = cards.length
      ? html`<table class="models"><tr><th>model</th><th>layers</th><th>weights</th><th>context</th><th>copies on nodes</th><th></th></tr>
        ${cards.map(
          (c) => html`<tr data-model-id="${c.model_id}"><td><b>${shortModel(c.model_id)}</b><div class="muted small">${c.model_id} · ${c.architecture}</div></td>
            <td>${c.n_layers}</td><td>${bytes(c.total_bytes)}</td><td>${c.context_length.toLocaleString()}</td>
            <td>${this.#copies(c.model_id)}</td>
            <td><button type="button" data-choose="${c.model_id}">Choose</button></td></tr>`,
        )}</table>`.text
      : html`<p class="muted">No model yet: type a hub id above, or put a model in a node's models directory.</p>`.text;
  }

  async #onInstanceClick(event) {
    const id = event.target.closest("[data-delete-instance]")?.dataset.deleteInstance;
    if (!id) return;
    event.target.disabled = true;
    try {
      await api(`/instance/${encodeURIComponent(id)}`, { method: "DELETE" });
      this.#errors.delete(id);
    } catch (error) {
      this.#errors.set(id, `cannot delete: ${error.message}`);
    }
    await this.cluster.update();
    this.render();
  }

  async #onModelClick(event) {
    const chosen = event.target.closest("[data-choose]")?.dataset.choose;
    if (chosen) {
      this.el.modelId.value = chosen;
      this.preview();
      return;
    }
    const button = event.target.closest("[data-delete-copy]");
    if (!button) return;
    const modelId = button.dataset.deleteCopy;
    if (!this.#armed.has(modelId)) {
      // Deleting files is not undone by a click: the first click asks. The
      // question lives here, not on the button, which the next state update redraws.
      this.#armed.add(modelId);
      this.render();
      return;
    }
    this.#armed.delete(modelId);
    const key = `${this.cluster.nodeId} ${modelId}`;
    try {
      await api(`/models/${modelId.split("/").map(encodeURIComponent).join("/")}`, { method: "DELETE" });
      this.#errors.delete(key);
    } catch (error) {
      this.#errors.set(key, `cannot delete: ${error.message}`);
    }
    await this.cluster.update();
    this.render();
  }
}
