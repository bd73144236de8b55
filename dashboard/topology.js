// The topology view: the nodes as a picture (on a circle, the master marked,
// a line between nodes that serve an instance together) and a card per node:
// its status from the master's link (ready, unreachable, timed out), when it
// was last heard (counted up on screen: `tickLastHeard`), its host name, and
// a link to its own dashboard, and what it set aside of its history after a
// partition.

import { ago, badge, bar, bytes, html, rankLayers, raw, shortId, shortModel } from "./format.js";

const CENTER = { x: 260, y: 200 };
const RADIUS = 135;
const RING = 2 * Math.PI * 44;
const LINK_COLORS = ["#6366f1", "#0891b2", "#d97706", "#db2777", "#16a34a"];

function positions(nodes) {
  if (nodes.length === 1) return [CENTER];
  const start = nodes.length === 2 ? Math.PI : -Math.PI / 2;
  return nodes.map((_, i) => {
    const angle = start + (2 * Math.PI * i) / nodes.length;
    return { x: CENTER.x + RADIUS * Math.cos(angle), y: CENTER.y + RADIUS * Math.sin(angle) };
  });
}

const ramUsed = (t) => (t ? t.ram_total - t.ram_available : 0);

function links(instances, at) {
  const lines = [];
  instances.forEach((instance, i) => {
    const color = LINK_COLORS[i % LINK_COLORS.length];
    const ranks = instance.ranks.filter((r) => at.has(r.node_id));
    for (let r = 1; r < ranks.length; r += 1) {
      const a = at.get(ranks[r - 1].node_id);
      const b = at.get(ranks[r].node_id);
      const label = { x: (a.x + b.x) / 2, y: (a.y + b.y) / 2 - 10 - 16 * i };
      lines.push(html`<g class="link" data-instance-id="${instance.instance_id}">
        <line x1="${a.x}" y1="${a.y}" x2="${b.x}" y2="${b.y}" stroke="${color}"/>
        <text x="${label.x}" y="${label.y}" fill="${color}">${shortModel(instance.model_id)}</text></g>`);
    }
  });
  return lines;
}

function nodeShape(node, p, cluster) {
  const t = node.telemetry;
  const used = t ? ramUsed(t) / t.ram_total : 0;
  const master = node.node_id === cluster.state.master_id;
  return html`<g class="node ${node.status.replace(/ /g, "-")}" data-node-id="${node.node_id}"
      transform="translate(${p.x.toFixed(1)} ${p.y.toFixed(1)})">
    <circle class="ram-track" r="44"/>
    <circle class="ram-used" r="44" stroke-dasharray="${(used * RING).toFixed(1)} ${RING.toFixed(1)}"
      transform="rotate(-90)"/>
    <circle class="body" r="36"/>
    <text class="name" y="-2">${shortId(node.node_id)}</text>
    <text class="sub" y="14">${node.status === "ready" && t ? t.mlx_backend : node.status}</text>
    ${node.hostname ? html`<text class="sub" y="28">${node.hostname.slice(0, 14)}</text>` : ""}
    ${master ? html`<g class="master-mark" transform="translate(0 -66)"><rect x="-32" y="-11" width="64" height="20" rx="10"/><text y="4">★ master</text></g>` : ""}
    <text class="under" y="66">${t ? `${bytes(ramUsed(t))} / ${bytes(t.ram_total)}` : ""}</text>
    ${node.node_id === cluster.nodeId ? html`<text class="under muted" y="82">this node</text>` : ""}
  </g>`;
}

export function renderPicture(svg, cluster) {
  const nodes = cluster.nodes();
  const at = new Map(nodes.map((n, i) => [n.node_id, positions(nodes)[i]]));
  const serving = cluster.instances.filter((i) => i.ranks.length > 1);
  svg.innerHTML = nodes.length
    ? html`${links(serving, at)}${nodes.map((n) => nodeShape(n, at.get(n.node_id), cluster))}`.text
    : html`<text x="260" y="200" class="empty">no nodes yet</text>`.text;
}

function ranksOn(node, instances) {
  return instances.flatMap((instance) =>
    instance.ranks
      .map((rank, i) => ({ rank, i, instance }))
      .filter(({ rank }) => rank.node_id === node.node_id),
  );
}

/** Why the node is not ready, in words, or "" when it is. */
function statusNote(node, cluster) {
  if (node.node_id === cluster.nodeId && cluster.down) {
    return "This page cannot reach this node's API: it shows what it last knew.";
  }
  if (node.status === "unreachable") {
    const since = Math.max(0, cluster.nodeNow() - node.unreachable_since_ms);
    return `The master cannot reach this node (lost ${ago(since)}): nothing is placed on it, and its instances move to other nodes. It times out unless it answers again.`;
  }
  if (node.status === "timed out") {
    return "This node stopped answering and timed out: its instances were removed. It comes back when it starts again; forget it if it will not.";
  }
  if (node.status === "joining") return "Joining: waiting for its memory and disk figures.";
  return "";
}

/** What the node set aside of its own history when it took the master's (a
 * healed partition: the other side's master won), or "" when nothing. */
function setAsideNote(node, cluster) {
  const aside = cluster.state.set_aside?.[node.node_id];
  if (!aside) return "";
  const when = ago(Math.max(0, cluster.nodeNow() - aside.at_ms));
  return `Its history diverged from the master's (a partition?): ${aside.events} event(s) from index ${aside.from_idx} were set aside ${when}, kept in its data dir as ${aside.kept_as}.`;
}

function nodeCard(node, cluster) {
  const t = node.telemetry;
  const master = node.node_id === cluster.state.master_id;
  const serves = ranksOn(node, cluster.instances);
  const here = node.node_id === cluster.nodeId;
  const note = statusNote(node, cluster);
  const aside = setAsideNote(node, cluster);
  return html`<div class="card node-card" data-node-id="${node.node_id}" data-status="${node.status}"
      ${master ? raw("data-master") : ""}>
    <div class="node-head">
      <b class="mono">${shortId(node.node_id)}</b>${node.hostname ? html`<span class="host">${node.hostname}</span>` : ""}
      ${master ? badge("master") : ""}
      ${here ? badge("this node") : ""}
      <span class="grow"></span>${badge(node.status)}
    </div>
    <div class="muted small mono">${node.node_id}${node.api_address ? ` · ${node.api_address}` : ""}
      ${node.api_address && !here ? html` · <a class="dashboard-link" href="http://${node.api_address}/" target="_blank" rel="noopener">its dashboard</a>` : ""}</div>
    ${note ? html`<div class="status-note ${node.status.replace(/ /g, "-")}">${note}</div>` : ""}
    ${aside ? html`<div class="status-note set-aside">${aside}</div>` : ""}
    <dl>
      <dt>RAM</dt>
      <dd>${t ? html`${bar(ramUsed(t), t.ram_total, "ram")} ${bytes(ramUsed(t))} used of ${bytes(t.ram_total)}` : "—"}</dd>
      <dt>backend</dt>
      <dd>${t ? `${t.mlx_backend} · ${t.cpu_count} CPUs · ${t.platform}` : "—"}</dd>
      <dt>disk free</dt><dd>${t ? bytes(t.disk_free) : "—"}</dd>
      <dt>serves</dt>
      <dd>${serves.length ? serves.map(({ rank, i, instance }) => html`<div>${shortModel(instance.model_id)}
          <span class="muted">rank ${i} · layers ${rankLayers(rank, instance.sharding, instance.ranks)}</span></div>`) : html`<span class="muted">${t && !t.accepts_instances ? "no worker (API only)" : "nothing"}</span>`}</dd>
      <dt>${node.status === "timed out" ? "timed out" : "last heard"}</dt>
      <dd><span class="last-heard" data-last-heard="${node.node_id}">${lastHeard(node, cluster)}</span>
        ${node.status === "timed out" ? html` <button type="button" class="small-button" data-forget-node="${node.node_id}">Forget this node</button>` : ""}</dd>
    </dl>
  </div>`;
}

/** The "last heard" of a node card: "now" for this node while it answers. */
function lastHeard(node, cluster) {
  if (node.status === "timed out") return node.timed_out_at_ms ? ago(cluster.nodeNow() - node.timed_out_at_ms) : "—";
  if (node.node_id === cluster.nodeId && !cluster.down) return "now (this node)";
  const at = cluster.lastHeardMs(node);
  return at ? ago(cluster.nodeNow() - at) : "—";
}

/** Count the "last heard" times up, every second, without redrawing the cards
 * (from the latest heartbeats: `/cluster` is polled between state changes). */
export function tickLastHeard(container, cluster) {
  const nodes = new Map(cluster.nodes().map((n) => [n.node_id, n]));
  for (const span of container.querySelectorAll("[data-last-heard]")) {
    const node = nodes.get(span.dataset.lastHeard);
    if (node) span.textContent = lastHeard(node, cluster);
  }
}

export function renderNodeCards(container, cluster) {
  container.innerHTML = cluster
    .nodes()
    .map((n) => nodeCard(n, cluster).text)
    .join("");
}
