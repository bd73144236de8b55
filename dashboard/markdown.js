// A small Markdown renderer for model answers (no dependency, no build step).
//
// Model output is untrusted: every piece of its text is escaped, raw HTML is
// shown as text, and links keep only http(s) and mailto addresses. It renders
// any prefix of an answer (an unclosed code fence is a code block to the end),
// so a streaming answer is rendered again as it grows.
//
// Blocks: ATX headings, paragraphs, fenced code blocks (with a Copy button and
// simple highlighting), bullet and numbered lists (nested by indentation),
// block quotes, rules and pipe tables. Inline: code spans, links, autolinks,
// **bold**, *italic*, ~~strikethrough~~ and backslash escapes.

import { esc } from "./format.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])(?:[ \t]+|$)/;
const TABLE_RULE = /^ *\|? *:?-+:? *(\| *:?-+:? *)*\|? *$/;

/** `text` (Markdown) as HTML in which everything the text holds is escaped. */
export function renderMarkdown(text) {
  return blocks(String(text ?? "").replace(/\r\n?/g, "\n").split("\n"));
}

function blocks(lines) {
  const out = [];
  let i = 0;
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) out.push(`<p>${inline(paragraph.join("\n").trim())}</p>`);
    paragraph = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      flush();
      i += 1;
    } else if ((match = FENCE.exec(line))) {
      flush();
      const [, fence, lang] = match;
      const indent = line.length - line.trimStart().length;
      const code = [];
      i += 1;
      while (i < lines.length && !isClosingFence(lines[i], fence)) {
        code.push(lines[i].slice(Math.min(indent, lines[i].length - lines[i].trimStart().length)));
        i += 1;
      }
      const closed = i < lines.length;
      i += 1; // the closing fence
      out.push(codeBlock(code.join("\n"), lang, closed));
    } else if ((match = HEADING.exec(line))) {
      flush();
      const level = match[1].length;
      out.push(`<h${level}>${inline(match[2] ?? "")}</h${level}>`);
      i += 1;
    } else if (RULE.test(line) && !paragraph.length) {
      flush();
      out.push("<hr>");
      i += 1;
    } else if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].replace(QUOTE, ""));
      out.push(`<blockquote>${blocks(quoted)}</blockquote>`);
    } else if ((match = ITEM.exec(line)) && (!paragraph.length || match[1].length === 0)) {
      flush();
      i = list(lines, i, out);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      flush();
      i = table(lines, i, out);
    } else {
      paragraph.push(line);
      i += 1;
    }
  }
  flush();
  return out.join("");
}

function isClosingFence(line, fence) {
  const trimmed = line.trim();
  return trimmed.length >= fence.length && trimmed[0] === fence[0] && new RegExp(`^\\${fence[0]}+$`).test(trimmed);
}

/** A list starting at `lines[start]`; returns the index after it. */
function list(lines, start, out) {
  const first = ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const indent = first[1].length;
  const items = [];
  let i = start;
  while (i < lines.length) {
    const match = ITEM.exec(lines[i]);
    if (!match || match[1].length !== indent || /\d/.test(match[2]) !== ordered) break;
    const body = [lines[i].slice(match[0].length)];
    const contentIndent = match[0].length;
    i += 1;
    // The item goes on while lines are indented under it (or are a lazy
    // continuation of its text), across single blank lines.
    while (i < lines.length) {
      const next = lines[i];
      if (!next.trim()) {
        const after = lines[i + 1];
        if (after !== undefined && after.trim() && leading(after) >= contentIndent) {
          body.push(""); // a blank line inside the item
          i += 1;
          continue;
        }
        const sibling = after === undefined ? null : ITEM.exec(after);
        if (sibling && sibling[1].length === indent && /\d/.test(sibling[2]) === ordered) i += 1;
        break;
      }
      const nested = ITEM.exec(next);
      if (nested && nested[1].length <= indent) break;
      if (leading(next) <= indent && (FENCE.test(next) || HEADING.test(next) || QUOTE.test(next))) break;
      body.push(next.slice(Math.min(leading(next), contentIndent)));
      i += 1;
    }
    items.push(body);
  }
  const number = ordered ? parseInt(first[2], 10) : 1;
  const startAttr = ordered && number !== 1 ? ` start="${number}"` : "";
  const tag = ordered ? "ol" : "ul";
  out.push(
    `<${tag}${startAttr}>${items
      .map((body) => {
        const html = blocks(body);
        // A tight item's single paragraph shows as plain text.
        return `<li>${html.startsWith("<p>") && html.indexOf("<p>", 1) < 0 ? html.replace(/^<p>([\s\S]*?)<\/p>/, "$1") : html}</li>`;
      })
      .join("")}</${tag}>`,
  );
  return i;
}

const leading = (line) => line.length - line.trimStart().length;

function table(lines, start, out) {
  const cells = (line) => line.trim().replace(/^\|/, "").replace(/\|$/, "").split(/(?<!\\)\|/).map((c) => c.trim());
  const head = cells(lines[start]);
  const aligns = cells(lines[start + 1]).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : c.startsWith(":") ? "left" : ""));
  const style = (col) => (aligns[col] ? ` style="text-align:${aligns[col]}"` : "");
  let i = start + 2;
  const rows = [];
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(cells(lines[i++]));
  out.push(
    `<div class="table-wrap"><table><thead><tr>${head.map((c, col) => `<th${style(col)}>${inline(c)}</th>`).join("")}</tr></thead>` +
      `<tbody>${rows.map((row) => `<tr>${head.map((_, col) => `<td${style(col)}>${inline(row[col] ?? "")}</td>`).join("")}</tr>`).join("")}</tbody></table></div>`,
  );
  return i;
}

function codeBlock(code, lang, closed) {
  const name = lang.replace(/[^\w+#.-]/g, "").slice(0, 20).toLowerCase();
  return (
    `<div class="code-block${closed ? "" : " open"}"><div class="code-head"><span class="code-lang">${esc(name || "code")}</span>` +
    `<button type="button" class="copy-code small-button" aria-label="Copy code">Copy</button></div>` +
    `<pre><code${name ? ` class="language-${esc(name)}"` : ""}>${highlight(code, name)}</code></pre></div>`
  );
}

// ---- inline ----

const INLINE = new RegExp(
  [
    /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1, 2: code span
    /\[([^\]\n]+)\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+"[^"\n]*")?\s*\)/.source, // 3, 4: link
    /(\bhttps?:\/\/[^\s<>"'`]*[^\s<>"'`.,;:!?)\]*_])/.source, // 5: autolink
    /\*\*(?=\S)([\s\S]*?\S)\*\*/.source, // 6: strong
    /(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/.source, // 7: strong
    /~~(?=\S)([\s\S]*?\S)~~/.source, // 8: strikethrough
    /\*(?=[^\s*])([\s\S]*?[^\s*])\*(?!\*)/.source, // 9: emphasis
    /(?<![\w\\])_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/.source, // 10: emphasis
    /\\([\\`*_{}[\]()#+\-.!~|>])/.source, // 11: escaped character
    /(\n)/.source, // 12: a line break inside a paragraph (kept, as chat answers mean it)
  ].join("|"),
  "g",
);

/** The link's address when it is safe to follow (http, https, mailto), else null. */
export function safeUrl(url) {
  const trimmed = String(url).trim();
  return /^(https?:\/\/|mailto:)/i.test(trimmed) ? trimmed : null;
}

function link(text, url) {
  const safe = safeUrl(url);
  if (!safe) return text;
  return `<a href="${esc(safe)}" target="_blank" rel="noopener noreferrer nofollow">${text}</a>`;
}

export function inline(text) {
  let out = "";
  let last = 0;
  INLINE.lastIndex = 0;
  for (const match of text.matchAll(INLINE)) {
    out += esc(text.slice(last, match.index));
    last = match.index + match[0].length;
    const [whole, , code, label, url, auto, strong1, strong2, strike, em1, em2, escaped, brk] = match;
    if (code !== undefined) {
      const inner = code.length > 2 && code.startsWith(" ") && code.endsWith(" ") ? code.slice(1, -1) : code;
      out += `<code>${esc(inner)}</code>`;
    } else if (label !== undefined) out += link(inline(label), url);
    else if (auto !== undefined) out += link(esc(auto), auto);
    else if (strong1 !== undefined || strong2 !== undefined) out += `<strong>${inline(strong1 ?? strong2)}</strong>`;
    else if (strike !== undefined) out += `<del>${inline(strike)}</del>`;
    else if (em1 !== undefined || em2 !== undefined) out += `<em>${inline(em1 ?? em2)}</em>`;
    else if (escaped !== undefined) out += esc(escaped);
    else if (brk !== undefined) out += "<br>";
    else out += esc(whole);
  }
  return out + esc(text.slice(last));
}

// ---- code highlighting: comments, strings, numbers, keywords ----

const KEYWORDS = new Set(
  `abstract and as assert async await auto bool boolean break case catch char class const constexpr continue
  def default defer del delete do double elif else enum except export extends extern false final finally float
  fn for foreach from func function go goto if impl implements import in instanceof int interface is lambda let
  long loop match mod module mut namespace new nil none not null nonlocal of or package pass private protected pub
  public raise ref return self select short signed sizeof static struct super switch synchronized template then
  this throw throws trait true try type typedef typeof union unsigned use using var void volatile where while
  with yield True False None elsif end begin local`.split(/\s+/),
);
const HASH_COMMENTS = new Set(["python", "py", "sh", "bash", "shell", "zsh", "console", "ruby", "rb", "yaml", "yml", "toml", "r", "perl", "pl", "make", "makefile", "dockerfile", "ini", "conf", "nix", "elixir", "ex", "julia", "jl", "ps1", "powershell"]);
const DASH_COMMENTS = new Set(["sql", "lua", "haskell", "hs", "elm", "ada"]);
const NO_HIGHLIGHT = new Set(["text", "txt", "plain", "plaintext", "markdown", "md", "output", "log"]);

function tokenRegex(lang) {
  const comments = [];
  if (HASH_COMMENTS.has(lang)) comments.push(/#.*/.source);
  else if (DASH_COMMENTS.has(lang)) comments.push(/--.*/.source);
  else {
    comments.push(/\/\/.*/.source, /\/\*[\s\S]*?(?:\*\/|$)/.source);
    if (!lang) comments.push(/(?<=^[ \t]*)#(?![\w!]).*/.source); // unknown: a # comment line
  }
  if (lang === "html" || lang === "xml" || lang === "svg") comments.push(/<!--[\s\S]*?(?:-->|$)/.source);
  const strings = [/"""[\s\S]*?(?:"""|$)/.source, /'''[\s\S]*?(?:'''|$)/.source, /"(?:[^"\\\n]|\\.)*"?/.source, /`(?:[^`\\]|\\[\s\S])*`?/.source];
  // A single quote is a string unless it is a word's apostrophe (Rust lifetimes aside).
  strings.push(/(?<!\w)'(?:[^'\\\n]|\\.)*'/.source);
  return new RegExp(
    `(${comments.join("|")})|(${strings.join("|")})|(\\b(?:0[xX][\\da-fA-F_]+|0[bB][01_]+|\\d[\\d_]*(?:\\.\\d[\\d_]*)?(?:[eE][+-]?\\d+)?)[a-zA-Z]*\\b)|([A-Za-z_$][\\w$]*)`,
    "gm",
  );
}

const REGEXES = new Map();

/** `code` as escaped HTML with its comments, strings, numbers and keywords in spans. */
export function highlight(code, lang = "") {
  if (NO_HIGHLIGHT.has(lang) || code.length > 200_000) return esc(code);
  if (!REGEXES.has(lang)) REGEXES.set(lang, tokenRegex(lang));
  const regex = REGEXES.get(lang);
  let out = "";
  let last = 0;
  for (const match of code.matchAll(regex)) {
    const [whole, comment, string, number, word] = match;
    if (word !== undefined && !KEYWORDS.has(word)) continue; // stays in the plain text run
    out += esc(code.slice(last, match.index));
    last = match.index + whole.length;
    const kind = comment !== undefined ? "comment" : string !== undefined ? "string" : number !== undefined ? "number" : "keyword";
    out += `<span class="tok-${kind}">${esc(whole)}</span>`;
  }
  return out + esc(code.slice(last));
}
