// Requests to this node's API: the API key when the node asks for one, and
// errors that carry the server's own message. A 401 is announced to the page
// ("exo:unauthorized", with the server's code and message and whether a key
// was sent): the key prompt says which node asked, and whether it refused a key.

const KEY_STORAGE = "exo.apiKey";

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export const apiKey = () => localStorage.getItem(KEY_STORAGE) ?? "";
export const setApiKey = (key) => localStorage.setItem(KEY_STORAGE, key);
export const forgetApiKey = () => localStorage.removeItem(KEY_STORAGE);

/** The raw response of a successful request; an ApiError otherwise. */
export async function request(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, {
    method,
    headers,
    signal,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.ok) return response;
  const error = await response.json().catch(() => ({}));
  const message = error.error?.message ?? `HTTP ${response.status} from ${path}`;
  const code = error.error?.code ?? null;
  if (response.status === 401) {
    const detail = { code, message, keySent: Boolean(apiKey()), path };
    window.dispatchEvent(new CustomEvent("exo:unauthorized", { detail }));
  }
  throw new ApiError(response.status, message, code);
}

export const api = async (path, options) => (await request(path, options)).json();

/** The `data:` payloads of a server-sent event stream, as they arrive. */
export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n"); // comments (keep-alives) carry none
    }
  }
}
