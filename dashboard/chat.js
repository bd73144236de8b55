// The chat view: one conversation with a served model, streamed over
// `/v1/chat/completions`; each answer shows its time to first token, its
// decode speed and how many prompt tokens the prefix cache served.

import { api, request, sseData } from "./api.js";
import { html, seconds } from "./format.js";

const SERVING = new Set(["ready", "running"]);

export class ChatView {
  messages = []; // the conversation sent with every turn
  #abort = null;

  constructor(cluster, elements) {
    this.cluster = cluster;
    this.el = elements;
    elements.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    elements.text.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        elements.form.requestSubmit();
      }
    });
    elements.stop.addEventListener("click", () => this.#abort?.abort());
    elements.clear.addEventListener("click", () => {
      this.#abort?.abort();
      this.messages = [];
      elements.log.innerHTML = "";
    });
  }

  /** The served models, kept in the picker (the choice survives updates). */
  async loadModels() {
    let models;
    try {
      models = (await api("/v1/models")).data;
    } catch (error) {
      this.#setOptions([], `cannot list models: ${error.message}`);
      return;
    }
    const serving = models.filter((m) => SERVING.has(m.status)).map((m) => m.id);
    this.#setOptions(serving, "no model is ready: place one in Models");
  }

  #setOptions(ids, emptyText) {
    const select = this.el.model;
    const chosen = select.value;
    const key = ids.join("\n");
    if (select.dataset.options === key) return;
    select.dataset.options = key;
    select.innerHTML = ids.length
      ? ids.map((id) => html`<option value="${id}">${id}</option>`.text).join("")
      : html`<option value="">${emptyText}</option>`.text;
    if (ids.includes(chosen)) select.value = chosen;
    this.el.send.disabled = !ids.length;
  }

  #turn(role, text) {
    const turn = document.createElement("div");
    turn.className = `turn ${role}`;
    turn.innerHTML = html`<div class="who">${role === "user" ? "you" : this.el.model.value}</div>
      <div class="text"></div><div class="meta"></div>`.text;
    turn.querySelector(".text").textContent = text;
    this.el.log.append(turn);
    this.el.log.scrollTop = this.el.log.scrollHeight;
    return turn;
  }

  async send() {
    const text = this.el.text.value.trim();
    const model = this.el.model.value;
    if (!text || !model || this.#abort) return;
    this.el.text.value = "";
    this.messages.push({ role: "user", content: text });
    this.#turn("user", text);
    const turn = this.#turn("assistant", "");
    const out = turn.querySelector(".text");
    const meta = turn.querySelector(".meta");
    meta.textContent = "waiting for the first token…";
    this.#abort = new AbortController();
    this.el.send.hidden = true;
    this.el.stop.hidden = false;
    const started = performance.now();
    let first = null;
    let usage = null;
    let outcome = "done";
    try {
      const response = await request("/v1/chat/completions", {
        method: "POST",
        signal: this.#abort.signal,
        body: {
          model,
          messages: this.messages,
          stream: true,
          stream_options: { include_usage: true },
          max_tokens: Number(this.el.maxTokens.value || 256),
        },
      });
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        usage = chunk.usage ?? usage;
        const delta = chunk.choices?.[0]?.delta?.content;
        if (delta) {
          first ??= performance.now();
          out.textContent += delta;
          this.el.log.scrollTop = this.el.log.scrollHeight;
        }
      }
    } catch (error) {
      outcome = error.name === "AbortError" ? "stopped" : "failed";
      if (outcome === "failed") turn.insertAdjacentHTML("beforeend", html`<div class="error">${error.message}</div>`.text);
    } finally {
      this.#abort = null;
      this.el.send.hidden = false;
      this.el.stop.hidden = true;
    }
    if (out.textContent) this.messages.push({ role: "assistant", content: out.textContent });
    this.#stats(turn, meta, { started, first, usage, outcome });
  }

  #stats(turn, meta, { started, first, usage, outcome }) {
    const ended = performance.now();
    const parts = [];
    if (outcome !== "done") parts.push(outcome);
    if (first !== null) parts.push(`first token ${seconds((first - started) / 1000)}`);
    if (usage) {
      const decode = (ended - first) / 1000;
      if (first !== null && usage.completion_tokens > 1 && decode > 0) {
        parts.push(`${((usage.completion_tokens - 1) / decode).toFixed(1)} tokens/s`);
      }
      // Speculative decoding: how much of what was drafted the model accepted.
      const details = usage.completion_tokens_details;
      if (details?.drafted_tokens) {
        const rate = Math.round((100 * details.accepted_draft_tokens) / details.drafted_tokens);
        parts.push(`${rate}% of ${details.drafted_tokens} drafted tokens accepted`);
      }
      const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
      parts.push(`${usage.completion_tokens} tokens out`);
      parts.push(`cached ${cached} of ${usage.prompt_tokens} prompt tokens`);
      turn.dataset.cached = String(cached);
      turn.classList.toggle("cache-hit", cached > 0);
    }
    meta.textContent = parts.join(" · ");
    turn.dataset.outcome = outcome;
  }
}
