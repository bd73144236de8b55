// The cache view: each runner's prefix-cache counters from `/v1/cache/stats`,
// polled, and drawn over time. The counters are those of the runners whose
// first rank is on this node (the rank that takes requests).

import { api } from "./api.js";
import { badge, bar, bytes, html } from "./format.js";

const POLL_MS = 2000;
const KEEP_SAMPLES = 90; // three minutes at one sample every two seconds
const CHART = { width: 300, height: 90, pad: 4 };

const hits = (s) => (s.hits_exact ?? 0) + (s.hits_partial ?? 0);

function polyline(samples, value, max, color) {
  if (samples.length < 2) return "";
  const t0 = samples[0].at;
  const span = Math.max(1, samples[samples.length - 1].at - t0);
  const { width, height, pad } = CHART;
  const points = samples
    .map((s) => {
      const x = pad + ((s.at - t0) / span) * (width - 2 * pad);
      const y = height - pad - (value(s) / Math.max(1, max)) * (height - 2 * pad);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    })
    .join(" ");
  return html`<polyline points="${points}" stroke="${color}"/>`;
}

/** A small chart: one line per series, scaled to the largest value shown. */
function chart(title, samples, series, format = (n) => n.toLocaleString()) {
  const max = Math.max(1, ...samples.flatMap((s) => series.map(({ value }) => value(s))));
  return html`<figure class="chart"><figcaption>${title}
      ${series.map(({ name, color }) => html`<span class="key"><i style="background:${color}"></i>${name}</span>`)}
      <span class="muted">max ${format(max)}</span></figcaption>
    <svg viewBox="0 0 ${CHART.width} ${CHART.height}" preserveAspectRatio="none">
      <line class="axis" x1="0" y1="${CHART.height - CHART.pad}" x2="${CHART.width}" y2="${CHART.height - CHART.pad}"/>
      ${series.map(({ value, color }) => polyline(samples, value, max, color))}
    </svg></figure>`;
}

export class CacheView {
  history = new Map(); // model -> samples, oldest first
  error = null;

  constructor(cluster, elements) {
    this.cluster = cluster;
    this.el = elements;
  }

  async poll() {
    try {
      const stats = (await api("/v1/cache/stats")).data;
      const at = Date.now();
      for (const runner of stats) {
        const samples = this.history.get(runner.model) ?? [];
        samples.push({ at, ...runner });
        this.history.set(runner.model, samples.slice(-KEEP_SAMPLES));
      }
      for (const model of this.history.keys()) {
        if (!stats.some((r) => r.model === model)) this.history.delete(model);
      }
      this.error = null;
    } catch (error) {
      this.error = `cannot read the cache stats: ${error.message}`;
    }
    this.render();
  }

  run() {
    this.poll();
    setInterval(() => this.poll(), POLL_MS);
  }

  #runner(model, samples) {
    const s = samples[samples.length - 1];
    const rate = s.lookups ? (100 * hits(s)) / s.lookups : 0;
    return html`<div class="runner" data-model="${model}">
      <div class="instance-head"><b>${model}</b> ${badge(s.runner_status)}</div>
      <div class="stats">
        <div><span>lookups</span><b>${s.lookups ?? 0}</b></div>
        <div><span>hits</span><b data-stat="hits">${hits(s)}</b><small>${s.hits_exact ?? 0} exact · ${s.hits_partial ?? 0} partial</small></div>
        <div><span>misses</span><b data-stat="misses">${s.misses ?? 0}</b><small>hit rate ${rate.toFixed(0)}%</small></div>
        <div><span>tokens reused</span><b data-stat="tokens-reused">${(s.tokens_reused ?? 0).toLocaleString()}</b></div>
        <div><span>entries</span><b>${s.entries ?? 0}</b></div>
        <div><span>bytes</span><b>${bytes(s.bytes ?? 0)}</b><small>of ${bytes(s.byte_budget ?? 0)} budget</small>${bar(s.bytes ?? 0, s.byte_budget ?? 0)}</div>
        <div><span>evictions</span><b>${s.evictions ?? 0}</b></div>
      </div>
      <div class="charts">
        ${chart("tokens reused", samples, [{ name: "tokens", color: "#6366f1", value: (x) => x.tokens_reused ?? 0 }])}
        ${chart("hits / misses", samples, [
          { name: "hits", color: "#16a34a", value: hits },
          { name: "misses", color: "#dc2626", value: (x) => x.misses ?? 0 },
        ])}
        ${chart("cache size", samples, [{ name: "bytes", color: "#d97706", value: (x) => x.bytes ?? 0 }], bytes)}
      </div>
    </div>`;
  }

  render() {
    const node = this.cluster.nodeId;
    this.el.where.textContent = node ? `runners whose first rank is on this node (${this.cluster.label(node)})` : "";
    const runners = [...this.history.entries()].map(([model, samples]) => this.#runner(model, samples).text);
    this.el.cache.innerHTML =
      (this.error ? html`<div class="error">${this.error}</div>`.text : "") +
      (runners.join("") ||
        html`<p class="muted">No runner takes requests on this node. A model's cache lives on the node of its first rank${this.#elsewhere().length ? ": open that node's dashboard" : "."}</p>
          ${this.#elsewhere().map(({ model, node, url }) => html`<div class="cache-elsewhere"><b>${model}</b> on node ${this.cluster.label(node)}:
            <a class="dashboard-link" href="${url}#cache" target="_blank" rel="noopener">its dashboard's cache view</a></div>`)}`.text);
  }

  /** The models whose first rank is on another node, with a link to its dashboard. */
  #elsewhere() {
    const here = this.cluster.nodeId;
    return this.cluster.instances
      .map((instance) => ({ model: instance.model_id, node: instance.ranks[0].node_id }))
      .filter(({ node }) => node !== here)
      .map((entry) => ({ ...entry, address: this.cluster.state?.nodes[entry.node]?.api_address }))
      .filter(({ address }) => address)
      .map((entry) => ({ ...entry, url: `http://${entry.address}/` }));
  }
}
