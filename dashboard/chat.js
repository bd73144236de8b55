// The chat view: conversations with a served model, streamed over
// `/v1/chat/completions` and kept in this browser (localStorage) across reloads.
//
// - Answers render as Markdown (./markdown.js, everything escaped) while they
//   stream; each code block has a Copy button.
// - A failed turn (its question and its error) is never sent again with later
//   turns; it shows its error with Retry and Edit.
// - An answer cut at max tokens (finish_reason "length") can be continued: the
//   partial answer goes back as the last assistant message with
//   `continue_final_message`, and the model goes on writing it.
// - The log follows the stream only while it is scrolled to the bottom; Esc
//   stops an answer; finished answers are announced to screen readers through
//   a separate live region (the streaming log itself is not live).
// - Images (pasted, dropped or picked; 20 MiB at most each, the server's
//   limit) go with the next message for a model that reads them (`images` in
//   /v1/models: true, or null when another node serves it): the message's
//   content is then parts, its text and an `image_url` part per image (data
//   URLs); text-only messages stay plain strings. Conversations keep their
//   images; one too large for this browser's storage keeps them in memory only
//   ("not saved: images too large"), its text saved without them.
// Each answer shows its time to first token, its decode speed and how many
// prompt tokens the prefix cache served.

import { api, request, sseData } from "./api.js";
import { html, seconds } from "./format.js";
import { renderMarkdown } from "./markdown.js";

const SERVING = new Set(["ready", "running"]);
const STORE = "exo.chats";
const CURRENT = "exo.chats.current";
const FOLLOW_SLACK_PX = 32; // this close to the bottom still follows the stream
const RENDER_EVERY_MS = 40; // a streaming answer is rendered again at most this often
const MAX_IMAGE_BYTES = 20 * 1024 * 1024; // the server's limit for an image file

const newId = () => `${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
const titleOf = (text) => (text.length > 60 ? `${text.slice(0, 57).trimEnd()}…` : text);
const imagesWord = (n) => (n === 1 ? "an image" : `${n} images`);
/** A conversation's title: its first message's text (or what it sent). */
const titleFor = (exchange) => (exchange ? titleOf(exchange.user || imagesWord(exchange.images?.length ?? 0)) : "");
const mib = (bytes) => (bytes / (1024 * 1024)).toFixed(1);
const isImageUrl = (url) => typeof url === "string" && url.startsWith("data:image/");

/** A user message's content: plain text, or its text and its images as parts. */
export function userContent(exchange) {
  const urls = (exchange.images ?? []).map((image) => image.url).filter(isImageUrl);
  if (!urls.length) return exchange.user;
  return [
    ...(exchange.user ? [{ type: "text", text: exchange.user }] : []),
    ...urls.map((url) => ({ type: "image_url", image_url: { url } })),
  ];
}

/** `conversation` as stored when its images do not fit: each image's name only. */
const withoutImages = (conversation) => ({
  ...conversation,
  exchanges: conversation.exchanges.map((exchange) =>
    exchange.images?.length
      ? { ...exchange, images: exchange.images.map(({ name }) => ({ name, omitted: true })) }
      : exchange,
  ),
});

const readDataUrl = (file) =>
  new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error ?? new Error("unreadable"));
    reader.readAsDataURL(file);
  });

/** Copies `text`: the Clipboard API where the page may use it, else a hidden textarea. */
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const area = Object.assign(document.createElement("textarea"), { value: text, readOnly: true });
    area.style.cssText = "position:fixed;top:0;left:0;opacity:0";
    document.body.append(area);
    area.select();
    let done = false;
    try {
      done = document.execCommand("copy");
    } finally {
      area.remove();
    }
    return done;
  }
}

/** The conversations saved in this browser, newest first. */
function loadConversations() {
  let saved;
  try {
    saved = JSON.parse(localStorage.getItem(STORE) ?? "null");
  } catch {
    saved = null;
  }
  const conversations = Array.isArray(saved?.conversations) ? saved.conversations : [];
  for (const conversation of conversations) {
    conversation.exchanges ??= [];
    for (const exchange of conversation.exchanges) {
      // A page closed mid-answer left it streaming: it stopped there.
      if (exchange.outcome === "streaming") exchange.outcome = "stopped";
    }
  }
  return conversations;
}

export class ChatView {
  conversations = loadConversations();
  current = null; // the conversation shown
  #abort = null;
  #streaming = null; // the exchange being answered
  #follow = true; // the log is at its bottom: it follows the stream
  #renderTimer = null;
  #views = new Map(); // exchange id -> its turns' elements
  #pending = []; // images attached to the next message: {url, name, size}
  #reads = new Map(); // model id -> its `images` in /v1/models (true, false, null)
  #tooLarge = new Set(); // conversations whose images stay in memory only
  #saveError = "";

  constructor(cluster, elements) {
    this.cluster = cluster;
    const $ = (id) => document.getElementById(id);
    this.el = {
      ...elements,
      list: elements.list ?? $("chat-list"),
      announce: elements.announce ?? $("chat-announce"),
      attach: elements.attach ?? $("chat-attach"),
      file: elements.file ?? $("chat-file"),
      attachments: elements.attachments ?? $("chat-attachments"),
      attachNote: elements.attachNote ?? $("chat-attach-note"),
      saveNote: elements.saveNote ?? $("chat-save-note"),
    };
    this.el.drop = elements.form.closest(".chat-main") ?? elements.form;
    elements.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    elements.text.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        elements.form.requestSubmit();
      }
    });
    elements.stop.addEventListener("click", () => this.stop());
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && this.#abort) {
        event.preventDefault();
        this.stop();
      }
    });
    elements.clear.addEventListener("click", () => this.newConversation());
    elements.model.addEventListener("change", () => this.#updateAttach());
    this.#listenForImages();
    elements.log.addEventListener("scroll", () => (this.#follow = this.#atBottom()));
    // Scrolling up stops following at once (before the scroll itself lands).
    elements.log.addEventListener("wheel", (event) => event.deltaY < 0 && (this.#follow = false), { passive: true });
    elements.log.addEventListener("click", (event) => this.#onLogClick(event));
    this.el.list?.addEventListener("click", (event) => this.#onListClick(event));
    window.addEventListener("storage", (event) => {
      if (event.key !== STORE || this.#abort) return;
      this.conversations = loadConversations();
      this.#open(this.conversations.find((c) => c.id === this.current?.id) ?? null);
    });
    const wanted = localStorage.getItem(CURRENT);
    this.#open(this.conversations.find((c) => c.id === wanted) ?? null);
    this.#updateAttach();
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
    this.#reads = new Map(models.map((m) => [m.id, m.images ?? null]));
    this.#setOptions(serving, "no model is ready: place one in Models");
    this.#updateAttach();
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

  // ---- conversations ----

  /** Writes `conversations` (as given) to the store; false when it is full. */
  #write(conversations) {
    try {
      localStorage.setItem(STORE, JSON.stringify({ version: 1, conversations }));
      if (this.current) localStorage.setItem(CURRENT, this.current.id);
      return true;
    } catch (error) {
      this.#saveError = error.message;
      return false;
    }
  }

  #save() {
    const current = this.current;
    let kept = this.conversations.filter((c) => c.exchanges.length);
    let triedAlone = false;
    for (;;) {
      if (this.#write(kept.map((c) => (this.#tooLarge.has(c.id) ? withoutImages(c) : c)))) break;
      // Full. A conversation that does not fit even alone would push every
      // other one out for nothing: its images stay in memory, its text is saved.
      if (!triedAlone && kept.includes(current) && !this.#tooLarge.has(current.id)) {
        triedAlone = true;
        if (!this.#write([current])) {
          this.#tooLarge.add(current.id);
          continue;
        }
      }
      // Else the oldest conversations go first (the list is newest first).
      const oldest = kept.findLast((c) => c !== current);
      if (!oldest) {
        console.warn(`the conversation is not saved: ${this.#saveError}`);
        break;
      }
      kept = kept.filter((c) => c !== oldest);
      this.conversations = this.conversations.filter((c) => c !== oldest);
    }
    this.#showSaveNote();
  }

  #showSaveNote() {
    const note = this.el.saveNote;
    if (note) note.hidden = !this.#tooLarge.has(this.current?.id);
  }

  /** Shows `conversation` (a new empty one when null). */
  #open(conversation) {
    if (!conversation) {
      conversation = { id: newId(), title: "", updated: Date.now(), exchanges: [] };
      this.conversations.unshift(conversation);
    }
    this.current = conversation;
    try {
      localStorage.setItem(CURRENT, conversation.id);
    } catch {
      // (shown anyway)
    }
    this.#views.clear();
    this.el.log.innerHTML = "";
    for (const exchange of conversation.exchanges) this.#renderExchange(exchange);
    this.#follow = true;
    this.el.log.scrollTop = this.el.log.scrollHeight;
    this.#renderList();
    this.#showSaveNote();
  }

  newConversation() {
    this.stop();
    // An empty conversation is reused rather than piled up.
    this.#open(this.current && !this.current.exchanges.length ? this.current : null);
    this.el.text.focus();
  }

  #renderList() {
    const list = this.el.list;
    if (!list) return;
    const shown = this.conversations.filter((c) => c.exchanges.length || c === this.current);
    list.innerHTML = shown
      .map((c) => {
        const title = c.title || "New conversation";
        const active = c === this.current;
        return html`<li data-conversation-id="${c.id}" class="${active ? "active" : ""}">
          <button type="button" class="chat-open" aria-current="${active ? "true" : "false"}" title="${title}">${title}</button>
          ${c.exchanges.length ? html`<button type="button" class="chat-delete small-button" aria-label="Delete conversation: ${title}" title="Delete">×</button>` : ""}
        </li>`.text;
      })
      .join("");
  }

  #onListClick(event) {
    const item = event.target.closest("[data-conversation-id]");
    if (!item) return;
    const conversation = this.conversations.find((c) => c.id === item.dataset.conversationId);
    if (!conversation) return;
    const remove = event.target.closest(".chat-delete");
    if (!remove) {
      if (conversation !== this.current) {
        this.stop();
        this.#open(conversation);
      }
      return;
    }
    if (!remove.dataset.armed) {
      // The first click asks; the second deletes.
      remove.dataset.armed = "true";
      remove.textContent = "Delete?";
      setTimeout(() => {
        if (remove.isConnected) {
          delete remove.dataset.armed;
          remove.textContent = "×";
        }
      }, 4000);
      return;
    }
    if (conversation === this.current) this.stop();
    this.conversations = this.conversations.filter((c) => c !== conversation);
    this.#save();
    if (conversation === this.current) this.#open(this.conversations.find((c) => c.exchanges.length) ?? null);
    else this.#renderList();
  }

  // ---- images for the next message ----

  /** Why the chosen model cannot take images, or null when it can. */
  #refusal() {
    const model = this.el.model.value;
    if (!model) return "no model is ready";
    return this.#reads.get(model) === false ? `${model} reads text only` : null;
  }

  #updateAttach() {
    const refusal = this.#refusal();
    const { attach } = this.el;
    if (attach) {
      attach.disabled = Boolean(refusal);
      attach.title = refusal ?? "Attach images (or paste or drop them here)";
      attach.parentElement.title = attach.title; // (a disabled button may show no tooltip)
    }
    // Images already attached stay; the model they cannot go to says so.
    if (this.#pending.length && refusal) this.#say(`${refusal}: remove the images or choose another model`, "model");
    else if (this.el.attachNote?.dataset.kind === "model") this.#say("");
  }

  /** A note under the input: why images were not attached ("" clears it);
   * kind "model": the chosen model's (it goes when another model is chosen). */
  #say(text, kind = "muted") {
    const note = this.el.attachNote;
    if (!note) return;
    note.textContent = text;
    note.dataset.kind = kind;
    note.hidden = !text;
  }

  #listenForImages() {
    const { attach, file, attachments, text } = this.el;
    attach?.addEventListener("click", () => file?.click());
    file?.addEventListener("change", () => {
      this.#attach([...file.files]);
      file.value = "";
    });
    text.addEventListener("paste", (event) => {
      const files = [...(event.clipboardData?.files ?? [])];
      if (!files.length) return; // text pastes as usual
      event.preventDefault();
      this.#attach(files);
    });
    const drop = this.el.drop;
    const hasFiles = (event) => [...(event.dataTransfer?.types ?? [])].includes("Files");
    drop.addEventListener("dragover", (event) => {
      if (!hasFiles(event)) return;
      event.preventDefault();
      event.dataTransfer.dropEffect = "copy"; // (a text-only model's refusal shows on the drop)
      drop.classList.add("dropping");
    });
    // Files dropped elsewhere on the page are not opened in its place (losing the chat).
    window.addEventListener("dragover", (event) => {
      if (!hasFiles(event) || event.defaultPrevented) return;
      event.preventDefault();
      event.dataTransfer.dropEffect = "none";
    });
    window.addEventListener("drop", (event) => hasFiles(event) && event.preventDefault());
    drop.addEventListener("dragleave", (event) => {
      if (!drop.contains(event.relatedTarget)) drop.classList.remove("dropping");
    });
    drop.addEventListener("drop", (event) => {
      drop.classList.remove("dropping");
      const files = [...(event.dataTransfer?.files ?? [])];
      if (!files.length) return;
      event.preventDefault();
      this.#attach(files);
    });
    attachments?.addEventListener("click", (event) => {
      const remove = event.target.closest("[data-remove-image]");
      if (!remove) return;
      this.#pending.splice(Number(remove.dataset.removeImage), 1);
      this.#renderAttachments();
      this.#say("");
      this.el.text.focus();
    });
  }

  /** Attaches the images among `files` to the next message, saying why any is not. */
  async #attach(files) {
    const refusal = this.#refusal();
    if (refusal) {
      this.#say(refusal, "model");
      return;
    }
    const refused = [];
    for (const file of files) {
      const name = file.name || "pasted image";
      if (!file.type.startsWith("image/")) {
        refused.push(`${name} is not an image`);
      } else if (file.size > MAX_IMAGE_BYTES) {
        refused.push(`${name} is ${mib(file.size)} MiB: images over ${mib(MAX_IMAGE_BYTES)} MiB are refused`);
      } else {
        try {
          this.#pending.push({ url: await readDataUrl(file), name, size: file.size });
        } catch (error) {
          refused.push(`cannot read ${name}: ${error.message}`);
        }
      }
    }
    this.#renderAttachments();
    this.#say(refused.join("; "), "error");
  }

  #renderAttachments() {
    const box = this.el.attachments;
    this.el.text.required = !this.#pending.length; // images alone may be sent
    if (!box) return;
    box.innerHTML = "";
    box.hidden = !this.#pending.length;
    this.#pending.forEach((image, index) => {
      const item = document.createElement("figure");
      item.className = "attachment";
      item.title = image.size === undefined ? image.name : `${image.name} (${mib(image.size)} MiB)`;
      const img = Object.assign(document.createElement("img"), { src: image.url, alt: image.name });
      const remove = Object.assign(document.createElement("button"), { type: "button", textContent: "×" });
      remove.className = "attachment-remove";
      remove.dataset.removeImage = String(index);
      remove.setAttribute("aria-label", `Remove ${image.name}`);
      item.append(img, remove);
      box.append(item);
    });
  }

  // ---- turns ----

  #renderExchange(exchange) {
    const user = document.createElement("div");
    user.className = "turn user";
    user.innerHTML = html`<div class="who">you</div><div class="text"></div>`.text;
    user.querySelector(".text").textContent = exchange.user;
    if (exchange.images?.length) user.querySelector(".who").after(this.#sentImages(exchange.images));
    const answer = document.createElement("div");
    answer.className = "turn assistant";
    answer.innerHTML = html`<div class="who">${exchange.model}</div>
      <div class="text md"></div><div class="meta"></div><div class="notes"></div>`.text;
    this.el.log.append(user, answer);
    const view = {
      user,
      answer,
      text: answer.querySelector(".text"),
      meta: answer.querySelector(".meta"),
      notes: answer.querySelector(".notes"),
    };
    this.#views.set(exchange.id, view);
    this.#paint(exchange);
    return view;
  }

  /** Draws `exchange`'s answer, its status and its notes as they are now. */
  #paint(exchange) {
    const view = this.#views.get(exchange.id);
    if (!view) return;
    const { user, answer, text, meta, notes } = view;
    text.innerHTML = renderMarkdown(exchange.answer);
    const failed = exchange.outcome === "failed";
    user.classList.toggle("failed", failed);
    answer.classList.toggle("failed", failed);
    answer.dataset.outcome = exchange.outcome;
    if (exchange.finish) answer.dataset.finish = exchange.finish;
    else delete answer.dataset.finish;
    if (exchange.cached !== undefined) {
      answer.dataset.cached = String(exchange.cached);
      answer.classList.toggle("cache-hit", exchange.cached > 0);
    }
    meta.textContent = exchange.outcome === "streaming" ? exchange.waiting ?? "" : exchange.meta ?? "";
    const last = this.current?.exchanges.at(-1) === exchange;
    const idle = !this.#abort;
    let notes_ = "";
    if (failed) {
      notes_ = html`<div class="turn-error" data-error>
        <span class="error">${exchange.error || "the request failed"}</span>
        <span class="muted small">Not sent with later messages.</span>
        <span class="actions"><button type="button" class="small-button" data-action="retry">Retry</button>
        <button type="button" class="small-button" data-action="edit">Edit</button></span></div>`.text;
    } else {
      if (exchange.continueError) {
        notes_ += html`<div class="turn-error" data-error><span class="error">${exchange.continueError}</span></div>`.text;
      }
      if (exchange.finish === "length" && exchange.outcome === "done") {
        notes_ += html`<div class="note" data-note="length">stopped at max tokens
          ${last && idle ? html`<button type="button" class="small-button" data-action="continue">Continue</button>` : ""}</div>`.text;
      }
    }
    notes.innerHTML = notes_;
  }

  /** A sent message's images, as thumbnails (a click shows one larger). */
  #sentImages(images) {
    const box = document.createElement("div");
    box.className = "turn-images";
    for (const image of images) {
      if (isImageUrl(image.url)) {
        const img = Object.assign(document.createElement("img"), { src: image.url, alt: image.name || "image" });
        img.title = `${image.name || "image"} (click to enlarge)`;
        img.className = "turn-image";
        img.addEventListener("click", () => img.classList.toggle("zoomed"));
        box.append(img);
      } else {
        const missing = document.createElement("span");
        missing.className = "turn-image omitted small";
        missing.textContent = `${image.name || "image"}: not kept (too large for this browser's storage)`;
        box.append(missing);
      }
    }
    return box;
  }

  #atBottom() {
    const log = this.el.log;
    return log.scrollHeight - log.scrollTop - log.clientHeight <= FOLLOW_SLACK_PX;
  }

  #followStream() {
    if (this.#follow) this.el.log.scrollTop = this.el.log.scrollHeight;
  }

  #scheduleRender(exchange) {
    if (this.#renderTimer !== null) return;
    this.#renderTimer = setTimeout(() => {
      this.#renderTimer = null;
      this.#paint(exchange);
      this.#followStream();
    }, RENDER_EVERY_MS);
  }

  #onLogClick(event) {
    const copy = event.target.closest(".copy-code");
    if (copy) {
      const code = copy.closest(".code-block")?.querySelector("code")?.textContent ?? "";
      copyText(code).then((done) => {
        copy.textContent = done ? "Copied" : "Copy failed";
        copy.dataset.copied = String(done);
        setTimeout(() => {
          copy.textContent = "Copy";
          delete copy.dataset.copied;
        }, 1500);
      });
      return;
    }
    const action = event.target.closest("[data-action]");
    if (!action || this.#abort) return;
    const views = [...this.#views.entries()];
    const found = views.find(([, view]) => view.answer.contains(action));
    const exchange = found && this.current.exchanges.find((e) => e.id === found[0]);
    if (!exchange) return;
    switch (action.dataset.action) {
      case "retry":
        this.#remove(exchange);
        this.send(exchange.user, exchange.images);
        break;
      case "edit":
        this.#remove(exchange);
        this.el.text.value = exchange.user;
        this.#pending = (exchange.images ?? []).filter((image) => isImageUrl(image.url));
        this.#renderAttachments();
        this.#updateAttach();
        this.el.text.focus();
        break;
      case "continue":
        this.#continue(exchange);
        break;
    }
  }

  #remove(exchange) {
    this.current.exchanges = this.current.exchanges.filter((e) => e !== exchange);
    this.current.title = titleFor(this.current.exchanges[0]);
    const view = this.#views.get(exchange.id);
    view?.user.remove();
    view?.answer.remove();
    this.#views.delete(exchange.id);
    this.#save();
    this.#renderList();
  }

  /** The messages of the exchanges before `upto` that went through: failed
   * turns, and turns stopped before any answer, are never sent again. */
  #history(upto) {
    const messages = [];
    for (const exchange of this.current.exchanges) {
      if (exchange === upto) break;
      if (exchange.outcome === "failed" || !exchange.answer.trim()) continue;
      messages.push({ role: "user", content: userContent(exchange) }, { role: "assistant", content: exchange.answer });
    }
    return messages;
  }

  stop() {
    this.#abort?.abort();
  }

  /** Sends the input (its text and the attached images), or, given, a message again. */
  async send(given, givenImages) {
    const text = (given ?? this.el.text.value).trim();
    const images = given === undefined ? this.#pending : (givenImages ?? []);
    const model = this.el.model.value;
    if ((!text && !images.length) || !model || this.#abort) return;
    if (given === undefined && images.length && this.#reads.get(model) === false) {
      this.#say(`${model} reads text only: remove the images or choose another model`, "model");
      return;
    }
    if (given === undefined) {
      this.el.text.value = "";
      this.#pending = [];
      this.#renderAttachments();
      this.#say("");
    }
    const conversation = this.current;
    const exchange = { id: newId(), user: text, answer: "", model, outcome: "streaming" };
    if (images.length) {
      exchange.images = images.map(({ url, name }) => (isImageUrl(url) ? { url, name } : { name, omitted: true }));
    }
    conversation.exchanges.push(exchange);
    conversation.title ||= titleFor(exchange);
    conversation.updated = Date.now();
    // The conversation in use goes to the top of the list.
    this.conversations = [conversation, ...this.conversations.filter((c) => c !== conversation)];
    this.#save();
    this.#renderList();
    // Any earlier answer's Continue goes away: only the last answer can go on.
    const previous = conversation.exchanges.at(-2);
    this.#renderExchange(exchange);
    this.#follow = true;
    this.#followStream();
    await this.#run(exchange, [...this.#history(exchange), { role: "user", content: userContent(exchange) }], false, previous);
  }

  async #continue(exchange) {
    const messages = [
      ...this.#history(exchange),
      { role: "user", content: userContent(exchange) },
      { role: "assistant", content: exchange.answer },
    ];
    exchange.continueError = undefined;
    exchange.finish = undefined;
    exchange.outcome = "streaming";
    this.#follow = this.#atBottom();
    await this.#run(exchange, messages, true);
  }

  async #run(exchange, messages, continuing, previous) {
    const model = exchange.model;
    this.#abort = new AbortController();
    this.#streaming = exchange;
    if (previous) this.#paint(previous);
    this.el.send.hidden = true;
    this.el.stop.hidden = false;
    exchange.waiting = continuing ? "continuing…" : "waiting for the first token…";
    this.#paint(exchange);
    const before = exchange.answer;
    const started = performance.now();
    let first = null;
    let usage = null;
    let finish = null;
    let pieces = 0; // text chunks: a token each (what a stopped answer can count)
    let outcome = "done";
    let error = null;
    try {
      const body = {
        model,
        messages,
        stream: true,
        stream_options: { include_usage: true },
        max_tokens: Number(this.el.maxTokens.value || 256),
      };
      if (continuing) body.continue_final_message = true;
      const response = await request("/v1/chat/completions", { method: "POST", signal: this.#abort.signal, body });
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        usage = chunk.usage ?? usage;
        const choice = chunk.choices?.[0];
        finish = choice?.finish_reason ?? finish;
        const delta = choice?.delta?.content;
        if (delta) {
          first ??= performance.now();
          pieces += 1;
          exchange.answer += delta;
          exchange.waiting = "";
          this.#scheduleRender(exchange);
        }
      }
    } catch (caught) {
      outcome = caught.name === "AbortError" ? "stopped" : "failed";
      error = caught.message;
    } finally {
      this.#abort = null;
      this.#streaming = null;
      clearTimeout(this.#renderTimer);
      this.#renderTimer = null;
      this.el.send.hidden = false;
      this.el.stop.hidden = true;
    }
    const added = exchange.answer.length - before.length;
    if (continuing && outcome === "failed") {
      // The answer so far stands; only its continuation failed.
      exchange.outcome = "done";
      exchange.finish = "length";
      exchange.continueError = `could not continue: ${error}`;
    } else {
      exchange.outcome = outcome;
      exchange.finish = outcome === "done" ? finish : null;
      exchange.error = error;
      exchange.tokens = (continuing ? exchange.tokens ?? 0 : 0) + (usage?.completion_tokens ?? pieces);
      exchange.meta = this.#stats({ started, first, usage, outcome, pieces, total: exchange.tokens, continuing });
      if (usage) exchange.cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    }
    exchange.waiting = "";
    this.current.updated = Date.now();
    this.#save();
    this.#paint(exchange);
    this.#followStream();
    this.el.text.focus({ preventScroll: true });
    const view = this.#views.get(exchange.id);
    const shown = view?.notes.querySelector("[data-error]");
    if (shown) shown.scrollIntoView({ block: "nearest" });
    this.#announce(exchange, outcome, added);
  }

  #announce(exchange, outcome, added) {
    const region = this.el.announce;
    if (!region) return;
    const words = {
      done: exchange.finish === "length" ? "Answer stopped at max tokens" : "Answer",
      stopped: "Answer stopped",
      failed: "The message failed",
    };
    const said = outcome === "failed" ? exchange.error || exchange.continueError : exchange.answer.slice(-Math.max(added, 0) || undefined);
    region.textContent = `${words[outcome]}: ${said ?? ""}`.slice(0, 2000);
  }

  #stats({ started, first, usage, outcome, pieces, total, continuing }) {
    const ended = performance.now();
    const parts = [];
    if (outcome === "stopped") parts.push(`stopped · ${total} token${total === 1 ? "" : "s"}`);
    else if (outcome !== "done") parts.push(outcome);
    if (continuing && outcome !== "failed") parts.push("continued");
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
      parts.push(`${usage.completion_tokens} tokens out${continuing ? ` (${total} in all)` : ""}`);
      parts.push(`cached ${cached} of ${usage.prompt_tokens} prompt tokens`);
    } else if (outcome === "done" && pieces) {
      parts.push(`${pieces} tokens out`);
    }
    return parts.join(" · ");
  }
}
