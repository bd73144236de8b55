// The cluster as this node sees it: `/state` and `/instances`, fetched again
// whenever the `/events` stream reports something (no polling, no reloads).

import { api, request, sseData } from "./api.js";

const REFRESH_DELAY_MS = 150; // events come in bursts: one fetch per burst
const RECONNECT_MS = [500, 1000, 2000, 5000];

export class Cluster extends EventTarget {
  state = null;
  instances = [];
  nodeId = null;
  live = false;
  linkError = null;
  // Nodes the master timed out, as last seen, until they join again.
  timedOut = new Map();
  #lastSeen = new Map(); // every node ever in the state, as last fetched
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
  }

  async refresh() {
    const [state, instances] = await Promise.all([api("/state"), api("/instances")]);
    this.state = state;
    this.instances = instances.data;
    for (const node of Object.values(state.nodes)) this.#lastSeen.set(node.node_id, node);
    this.linkError = null;
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
    this.#changed();
  }

  #note(indexed) {
    const event = indexed.event;
    if (event.kind === "node_timed_out") {
      const last = this.#lastSeen.get(event.node_id);
      if (last) this.timedOut.set(event.node_id, { ...last, timed_out_ms: indexed.at_ms });
    } else if (event.kind === "node_joined") {
      this.timedOut.delete(event.node_id);
    }
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
        attempt = 0;
        this.#changed();
        for await (const data of sseData(response)) {
          this.#note(JSON.parse(data));
          this.#scheduleRefresh();
        }
        throw new Error("the event stream ended");
      } catch (error) {
        this.live = false;
        this.#fail(error);
      }
      await sleep(RECONNECT_MS[Math.min(attempt, RECONNECT_MS.length - 1)]);
      await this.update();
    }
  }

  /** "joining" until a node reports telemetry, "timed out" once the master dropped it. */
  nodes() {
    const nodes = Object.values(this.state?.nodes ?? {}).map((node) => ({
      ...node,
      status: node.telemetry ? "ready" : "joining",
    }));
    const gone = [...this.timedOut.values()].filter((n) => !this.state?.nodes[n.node_id]);
    return [...nodes, ...gone.map((node) => ({ ...node, status: "timed out" }))].sort((a, b) =>
      a.node_id.localeCompare(b.node_id),
    );
  }
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
