// The dashboard: four views over one live copy of the cluster state.

import { setApiKey } from "./api.js";
import { CacheView } from "./cache.js";
import { ChatView } from "./chat.js";
import { Cluster } from "./cluster.js";
import { ModelsView } from "./models.js";
import { renderNodeCards, renderPicture } from "./topology.js";

const $ = (id) => document.getElementById(id);
const VIEWS = ["topology", "models", "chat", "cache"];

const cluster = new Cluster();
const models = new ModelsView(cluster, {
  form: $("place-form"),
  modelId: $("model-id"),
  minNodes: $("min-nodes"),
  maxNodes: $("max-nodes"),
  sharding: $("sharding"),
  previewButton: $("preview-button"),
  message: $("place-message"),
  previews: $("previews"),
  instances: $("instances"),
  models: $("models"),
  datalist: $("known-models"),
});
const chat = new ChatView(cluster, {
  form: $("chat-form"),
  text: $("chat-text"),
  model: $("chat-model"),
  maxTokens: $("chat-max-tokens"),
  send: $("chat-send"),
  stop: $("chat-stop"),
  clear: $("chat-clear"),
  log: $("chat-log"),
});
const cache = new CacheView(cluster, { cache: $("cache"), where: $("cache-where") });

function showView() {
  const wanted = location.hash.slice(1);
  const view = VIEWS.includes(wanted) ? wanted : "topology";
  for (const name of VIEWS) $(`view-${name}`).hidden = name !== view;
  for (const link of document.querySelectorAll("#tabs a")) {
    link.classList.toggle("active", link.dataset.view === view);
  }
}

function summarize() {
  const { state, live } = cluster;
  if (!state) return;
  const nodes = Object.keys(state.nodes).length;
  const ready = cluster.instances.filter((i) => i.status === "ready" || i.status === "running").length;
  $("summary").innerHTML = "";
  $("summary").append(
    Object.assign(document.createElement("span"), { className: `live ${live ? "on" : "off"}`, title: live ? "live" : "reconnecting" }),
    `${nodes} node${nodes === 1 ? "" : "s"} · ${cluster.instances.length} instance${cluster.instances.length === 1 ? "" : "s"} (${ready} ready) · event ${state.last_idx}`,
  );
}

cluster.addEventListener("change", () => {
  $("link-error").hidden = !cluster.linkError;
  $("link-error").textContent = cluster.linkError ? `cannot reach this node: ${cluster.linkError}` : "";
  if (!cluster.state) return;
  summarize();
  renderPicture($("topology-svg"), cluster);
  renderNodeCards($("node-cards"), cluster);
  models.render();
  chat.loadModels();
});

window.addEventListener("exo:unauthorized", () => ($("key-form").hidden = false));
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey($("key-input").value);
  location.reload(); // every request, the event stream included, starts again with the key
});

window.addEventListener("hashchange", showView);
showView();
cluster.start();
cache.run();
