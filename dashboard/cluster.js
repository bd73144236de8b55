// The cluster as this node sees it: `/state` and `/instances`, fetched again
// whenever the `/events` stream reports something (no reloads), and `/cluster`
// every few seconds for the heartbeats (when this node's link last heard each
// peer: not events, so the stream does not carry them). When this node's own
// API stops answering, the page keeps what it last knew, marked `down`.

import { ApiError, api, request, sseData } from "./api.js";
import { shortId } from "./format.js";

const REFRESH_DELAY_MS = 150; // events come in bursts: one fetch per burst
const RECONNECT_MS = [500, 1000, 2000, 5000];
const HEARTBEAT_POLL_MS = 1000;

export class Cluster extends EventTarget {
  state = null;
  instances = [];
  nodeId = null;
  live = false;
  linkError = null;
  // True while this node's own API cannot be reached (not a refusal: no answer).
  down = false;
  refused = false; // the last failure was a 401
  // This node's link: when it last heard each peer (the node's clock), and
  // how far the node's clock is ahead of this browser's.
  heardMs = {};
  clockOffsetMs = 0;
  #answeredAt = 0; // when this node last answered (the node's clock)
  #refreshing = null;

  async start() {
    for (let attempt = 0; ; attempt += 1) {
      try {
        this.nodeId = await api("/node_id");
        await this.refresh();
        break;
      } catch (error) {
        this.#fail(error);
        await sleep(RECONNECT_MS[Math.min(attempt, RECONNECT_MS.length - 1)]);
      }
    }
    this.#follow();
    this.#pollHeartbeats();
  }

  async refresh() {
    const [state, instances] = await Promise.all([api("/state"), api("/instances")]);
    this.state = state;
    this.instances = instances.data;
    this.linkError = null;
    this.down = false;
    this.#answeredAt = this.nodeNow();
    this.#changed();
  }

  /** refresh(), a failure shown as the link's error. */
  async update() {
    await this.refresh().catch((error) => this.#fail(error));
  }

  #changed() {
    this.dispatchEvent(new Event("change"));
  }

  #fail(error) {
    this.linkError = error.message;
    // An answer (even a refusal) means the node is up; a failed fetch that it is not.
    this.down = !(error instanceof ApiError);
    this.refused = error instanceof ApiError && error.status === 401; // the key prompt says it
    this.#changed();
  }

  #scheduleRefresh() {
    this.#refreshing ??= sleep(REFRESH_DELAY_MS)
      .then(() => this.update())
      .finally(() => (this.#refreshing = null));
  }

  async #follow() {
    for (let attempt = 0; ; attempt += 1) {
      try {
        const from = this.state ? this.state.last_idx + 1 : 0;
        const response = await request(`/events?from_idx=${from}`);
        this.live = true;
        this.linkError = null;
        this.down = false;
        attempt = 0;
        this.#changed();
        for await (const _ of sseData(response)) this.#scheduleRefresh();
        throw new Error("the event stream ended");
      } catch (error) {
        this.live = false;
        this.#fail(error);
      }
      await sleep(RECONNECT_MS[Math.min(attempt, RECONNECT_MS.length - 1)]);
      await this.update();
    }
  }

  async #pollHeartbeats() {
    for (;;) {
      try {
        const link = await api("/cluster");
        this.heardMs = link.heard_ms ?? {};
        this.clockOffsetMs = (link.now_ms ?? Date.now()) - Date.now();
        this.#answeredAt = this.nodeNow();
        if (this.down) await this.update();
      } catch (error) {
        if (!(error instanceof ApiError) && !this.down) this.#fail(error);
      }
      await sleep(HEARTBEAT_POLL_MS);
    }
  }

  /** The node's clock now (the master's and the link's times are the nodes'). */
  nodeNow() {
    return Date.now() + this.clockOffsetMs;
  }

  /** When the node was last heard: a heartbeat of this node's link, the
   * master's last heartbeat from it, or its last event (this node: now). */
  lastHeardMs(node) {
    if (node.node_id === this.nodeId) return this.down ? this.#answeredAt : this.nodeNow();
    return Math.max(this.heardMs[node.node_id] ?? 0, node.last_heartbeat_ms ?? 0, node.last_seen_ms ?? 0);
  }

  /** The node's info, live or gone, as last known; undefined for an unknown id. */
  node(nodeId) {
    return this.state?.nodes[nodeId] ?? this.state?.gone_nodes?.[nodeId];
  }

  /** "3f2a9c · studio": a node as people tell nodes apart. */
  label(nodeId) {
    const host = this.node(nodeId)?.hostname;
    return host ? `${shortId(nodeId)} · ${host}` : shortId(nodeId);
  }

  /** The node whose API is at `address` ("host:port"), if the state knows it. */
  nodeAt(address) {
    return Object.values(this.state?.nodes ?? {}).find((n) => n.api_address === address);
  }

  /** The other nodes' dashboards, from the last state this page had. */
  otherDashboards() {
    return Object.values(this.state?.nodes ?? {})
      .filter((n) => n.node_id !== this.nodeId && n.api_address)
      .map((n) => ({ node: n, url: `http://${n.api_address}/` }));
  }

  /** "joining" until a node reports telemetry; "unreachable" once the master's
   * link lost it (before its timeout); "timed out" once the master dropped it
   * (kept in the state as gone until a user forgets it). */
  nodes() {
    const status = (node) =>
      node.unreachable_since_ms || (this.down && node.node_id === this.nodeId)
        ? "unreachable"
        : node.telemetry
          ? "ready"
          : "joining";
    const nodes = Object.values(this.state?.nodes ?? {}).map((node) => ({ ...node, status: status(node) }));
    const gone = Object.values(this.state?.gone_nodes ?? {}).map((node) => ({ ...node, status: "timed out" }));
    return [...nodes, ...gone].sort((a, b) => a.node_id.localeCompare(b.node_id));
  }
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
