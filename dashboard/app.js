// The dashboard: four views over one live copy of the cluster state.

import { api, apiKey, forgetApiKey, setApiKey } from "./api.js";
import { CacheView } from "./cache.js";
import { ChatView } from "./chat.js";
import { Cluster } from "./cluster.js";
import { ModelsView } from "./models.js";
import { html } from "./format.js";
import { renderNodeCards, renderPicture, tickLastHeard } from "./topology.js";

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
  placeButton: $("place-button"),
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
  const lost = Object.values(state.nodes).filter((n) => n.unreachable_since_ms).length;
  const ready = cluster.instances.filter((i) => i.status === "ready" || i.status === "running").length;
  $("summary").innerHTML = "";
  $("summary").append(
    Object.assign(document.createElement("span"), { className: `live ${live ? "on" : "off"}`, title: live ? "live" : "reconnecting" }),
    `${nodes} node${nodes === 1 ? "" : "s"}${lost ? ` (${lost} unreachable)` : ""} · ${cluster.instances.length} instance${cluster.instances.length === 1 ? "" : "s"} (${ready} ready)`,
  );
}

/** This node cannot be reached: say so, grey out what the page last knew, and
 * link to the other nodes' dashboards (their addresses are in that state). */
function showLinkError() {
  const banner = $("link-error");
  document.body.classList.toggle("stale", cluster.down && Boolean(cluster.state));
  banner.hidden = !cluster.linkError || cluster.refused;
  if (banner.hidden) return;
  if (!cluster.down) {
    banner.textContent = `this node answered with an error: ${cluster.linkError}`;
    return;
  }
  const me = cluster.nodeId ? `This node (${cluster.label(cluster.nodeId)}) at ${location.host}` : `The node at ${location.host}`;
  const others = cluster.otherDashboards();
  banner.innerHTML = html`<span>${me} cannot be reached (${cluster.linkError}): it may have stopped.
    ${cluster.state ? "What the page shows is what it last knew, greyed out." : ""}
    ${others.length ? "Open another node's dashboard:" : "No other node's dashboard is known."}</span>
    ${others.map(({ node, url }) => html`<a class="other-dashboard" data-node-id="${node.node_id}" href="${url}">${cluster.label(node.node_id)} (${node.api_address})</a>`)}`.text;
}

const capital = (text) => text[0].toUpperCase() + text.slice(1);

/** The key prompt, naming the node that asked and saying whether it refused a key. */
function askForKey(detail) {
  let why;
  if (detail?.code === "relayed_invalid_api_key") {
    const address = detail.message.match(/the node at (\S+) that serves/)?.[1];
    const other = address ? cluster.nodeAt(address) : null;
    const name = other ? `node ${cluster.label(other.node_id)} at ${address}` : `the node at ${address ?? "another address"}`;
    why = detail.keySent
      ? `The key was refused by ${name}, the node serving this model; this node accepted it: the nodes' API keys differ. Give every node the same --api-key, or enter ${name}'s key.`
      : `${capital(name)}, the node serving this model, needs an API key (this node does not).`;
  } else {
    // The refusal names the node ("node 3f2a… (studio) at host:port"): before a
    // key, the page knows no more of it than that.
    const asked = detail?.message?.match(/^(node \S+(?: \([^)]*\))?) at (\S+) /);
    const name = asked
      ? `${asked[1]} at ${asked[2]}`
      : cluster.nodeId
        ? `this node (${cluster.label(cluster.nodeId)}) at ${location.host}`
        : `the node at ${location.host}`;
    why = detail?.keySent
      ? `The key was refused: ${name} does not accept the saved key.`
      : `${capital(name)} needs an API key.`;
  }
  $("key-why").textContent = why;
  $("key-form").dataset.reason = detail?.code === "relayed_invalid_api_key" ? "relayed" : detail?.keySent ? "refused" : "missing";
  $("key-forget").hidden = !apiKey();
  $("key-form").hidden = false;
}

cluster.addEventListener("change", () => {
  showLinkError();
  $("key-button").hidden = !apiKey();
  if (!cluster.state) return;
  summarize();
  renderPicture($("topology-svg"), cluster);
  renderNodeCards($("node-cards"), cluster);
  models.render();
  chat.loadModels();
});

window.addEventListener("exo:unauthorized", (event) => askForKey(event.detail));
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey($("key-input").value);
  location.reload(); // every request, the event stream included, starts again with the key
});
$("key-forget").addEventListener("click", () => {
  forgetApiKey();
  location.reload();
});
$("key-cancel").addEventListener("click", () => ($("key-form").hidden = true));
$("key-button").addEventListener("click", () => {
  $("key-why").textContent = "A key is saved in this browser: enter another to change it, or forget it.";
  $("key-forget").hidden = false;
  $("key-form").hidden = false;
});

$("node-cards").addEventListener("click", async (event) => {
  const button = event.target.closest("[data-forget-node]");
  if (!button) return;
  button.disabled = true;
  try {
    await api(`/nodes/${encodeURIComponent(button.dataset.forgetNode)}`, { method: "DELETE" });
  } catch (error) {
    button.replaceWith(Object.assign(document.createElement("span"), { className: "error small", textContent: `cannot forget it: ${error.message}` }));
  }
  await cluster.update();
});
setInterval(() => tickLastHeard($("node-cards"), cluster), 1000);

window.addEventListener("hashchange", showView);
showView();
cluster.start();
cache.run();
