// Formatting and safe HTML: every interpolated value is escaped unless wrapped in raw().

class Raw {
  constructor(text) {
    this.text = text;
  }
  toString() {
    return this.text;
  }
}

export const raw = (text) => new Raw(text);

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const esc = (value) => String(value).replace(/[&<>"']/g, (c) => ESCAPES[c]);

function show(value) {
  if (value instanceof Raw) return value.text;
  if (Array.isArray(value)) return value.map(show).join("");
  if (value === null || value === undefined || value === false) return "";
  return esc(value);
}

/** A template tag: html`<b>${name}</b>` escapes `name`; the result nests as is. */
export function html(strings, ...values) {
  return raw(strings.reduce((out, part, i) => out + part + (i < values.length ? show(values[i]) : ""), ""));
}

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let value = n;
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return `${value.toFixed(value < 10 && unit > 0 ? 1 : 0)} ${units[unit]}`;
}

/** "4 s ago", "3 min ago": how long ago, counted on screen. */
export function ago(ms) {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 90) return `${s} s ago`;
  if (s < 5400) return `${Math.floor(s / 60)} min ago`;
  return `${Math.floor(s / 3600)} h ago`;
}

export function seconds(s) {
  if (s === null || s === undefined) return "—";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 90) return `${s.toFixed(1)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

/** "node-3f2a9c1b7d11" -> "3f2a9c"; ids stay unique enough on a home cluster. */
export const shortId = (id) => String(id).replace(/^node-/, "").slice(0, 6);

/** The last path part of a model id: "mlx-community/Qwen3-0.6B" -> "Qwen3-0.6B". */
export const shortModel = (id) => String(id).split("/").pop();

const percent = (done, total) => (total > 0 ? Math.min(100, (100 * done) / total) : 100);

export const bar = (done, total, kind = "") =>
  html`<span class="bar ${kind}"><span style="width:${percent(done, total).toFixed(1)}%"></span></span>`;

// What a rank of an instance (or a placement) holds: its layers, or its slice of
// every layer (its KV heads where known: a tensor split may be uneven).
export const rankLayers = (rank, sharding, ranks) => {
  if (sharding !== "tensor") {
    return `${rank.start_layer}–${rank.end_layer - 1} (${rank.end_layer - rank.start_layer})`;
  }
  const heads = ranks.reduce((sum, r) => sum + (r.kv_heads ?? NaN), 0);
  return Number.isNaN(heads)
    ? `all ${rank.end_layer}, 1/${ranks.length} of each`
    : `all ${rank.end_layer}, ${rank.kv_heads} of ${heads} KV heads`;
};

export const badge = (status) => html`<span class="badge ${status.replace(/ /g, "-")}">${status}</span>`;
