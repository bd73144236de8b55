"""The dashboard's chat in a real browser (headless Chromium) against one real
node serving the built-in model: Markdown answers (escaped, code blocks with a
working Copy button), a failed turn that is never sent again, an answer cut at
max tokens that Continue extends, Esc stopping a stream the log no longer
follows once scrolled up, conversations kept across a reload, and the dark
theme. The tests share one page, in order, as one user would. Screenshots go
to docs/screenshots/."""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    Locator,
    Request,
    Route,
    ViewportSize,
    expect,
)

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.browser import PageErrors, headless_chromium
from tests.e2e.node_process import NodeProcess

pytestmark = pytest.mark.slow

SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
VIEWPORT: ViewportSize = {"width": 1280, "height": 820}
ANSWER_MS = 60_000
END_OF_TEXT_TOKENS = (0, 2)  # the built-in model's <|endoftext|> and <|im_end|>
HOSTILE = "<img src=x onerror=alert(1)>"
CODE = 'def greet(name):\n    # say hello\n    return "hi " + name * 2\n'
# The last answer of the conversation in use, as the browser keeps it.
LAST_ANSWER = """() => JSON.parse(localStorage.getItem("exo.chats"))
    .conversations[0].exchanges.at(-1).answer"""
MARKDOWN_ANSWER = (
    "## Greeting\n\nHere is **the** code, with `inline` and a [link](javascript:alert(1)):\n\n"
    f"```python\n{CODE}```\n\n- one\n- two\n\n{HOSTILE}"
)


class Chat:
    """One page on the chat view, and the chat completion requests it sends."""

    def __init__(self, context: BrowserContext, base_url: str) -> None:
        self.page = context.new_page()
        self.errors = PageErrors(self.page)
        self.bodies: list[dict[str, Any]] = []
        self.page.on("request", self._record)
        self.page.goto(f"{base_url}/#chat")
        try:
            expect(self.page.locator("#chat-model")).to_have_value(DEFAULT_MODEL_ID)
        except AssertionError as error:
            raise AssertionError(
                f"no served model in the picker; page errors: {self.errors.seen}"
            ) from error

    def _record(self, request: Request) -> None:
        if request.method == "POST" and request.url.endswith("/v1/chat/completions"):
            self.bodies.append(json.loads(request.post_data or "{}"))

    def ask(self, text: str, max_tokens: int) -> None:
        self.page.fill("#chat-max-tokens", str(max_tokens))
        self.page.fill("#chat-text", text)
        self.page.press("#chat-text", "Enter")

    def answer(self, index: int = -1) -> Locator:
        answers = self.page.locator(".turn.assistant")
        return answers.last if index == -1 else answers.nth(index)

    def shoot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=SCREENSHOTS / f"{name}.png")


@pytest.fixture(scope="module")
def chat(node: NodeProcess) -> Iterator[Chat]:
    expect.set_options(timeout=30_000)
    with headless_chromium() as browser:
        context = new_context(browser, node)
        try:
            yield Chat(context, node.base_url)
        finally:
            context.close()


def new_context(browser: Browser, node: NodeProcess) -> BrowserContext:
    context = browser.new_context(viewport=VIEWPORT)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=node.base_url)
    return context


def sse_reply(text: str, pieces: int = 6) -> str:
    """A chat completion stream saying `text` in a few chunks."""
    size = -(-len(text) // pieces)
    base = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0}
    base["model"] = DEFAULT_MODEL_ID
    chunks: list[dict[str, Any]] = [
        base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    ]
    for start in range(0, len(text), size):
        delta = {"content": text[start : start + size]}
        chunks.append(base | {"choices": [{"index": 0, "delta": delta}]})
    chunks.append(base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": 20, "completion_tokens": 40, "total_tokens": 60}
    chunks.append(base | {"choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_markdown_escapes_what_the_model_writes(chat: Chat) -> None:
    """The renderer, run in the page: HTML in an answer is text, and only
    http(s)/mailto links become links."""
    rendered = chat.page.evaluate(
        """async (hostile) => {
          const { renderMarkdown } = await import("/dashboard/markdown.js");
          const samples = [hostile, `**${hostile}**`, "`" + hostile + "`", `- ${hostile}`,
            "```html\\n" + hostile + "\\n```", `| a |\\n|---|\\n| ${hostile} |`,
            "[x](javascript:alert(1)) [y](https://example.com/?a=\\"b\\")", "<script>alert(1)</script>"];
          const box = document.createElement("div");
          box.innerHTML = samples.map(renderMarkdown).join("");
          return {
            html: box.innerHTML,
            elements: box.querySelectorAll("img, script, [onerror]").length,
            hrefs: [...box.querySelectorAll("a")].map((a) => a.getAttribute("href")),
            text: box.textContent,
          };
        }""",
        HOSTILE,
    )
    assert rendered["elements"] == 0, rendered["html"]
    assert "&lt;img src=x onerror=alert(1)&gt;" in rendered["html"]
    assert rendered["text"].count(HOSTILE) == 6
    assert rendered["hrefs"] == ['https://example.com/?a="b"'], rendered["hrefs"]


def test_an_answer_renders_as_markdown_with_a_copy_button(chat: Chat) -> None:
    """A reply (fixed here: the node's model writes what it likes) streamed as
    Markdown: a heading, a list and a highlighted code block whose Copy button
    puts the code on the clipboard."""
    page = chat.page

    def fixed_reply(route: Route) -> None:
        body = sse_reply(MARKDOWN_ANSWER)
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", fixed_reply)
    try:
        chat.ask("Show me a greeting function", 64)
        answer = chat.answer()
        expect(answer).to_have_attribute("data-outcome", "done")
    finally:
        page.unroute("**/v1/chat/completions", fixed_reply)
    code = answer.locator("pre > code.language-python")
    expect(code).to_have_count(1)
    assert code.text_content() == CODE.rstrip("\n")
    expect(code.locator(".tok-keyword", has_text="def")).to_have_count(1)
    expect(code.locator(".tok-comment")).to_have_text("# say hello")
    expect(code.locator(".tok-string")).to_have_text('"hi "')
    expect(answer.locator("h2")).to_have_text("Greeting")
    expect(answer.locator("li")).to_have_count(2)
    expect(answer.locator("strong")).to_have_text("the")
    expect(answer.locator("a")).to_have_count(0)  # a javascript: link is text
    expect(answer.locator("img")).to_have_count(0)
    expect(answer.locator(".text")).to_contain_text(HOSTILE)
    button = answer.locator(".copy-code")
    button.click()
    expect(button).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == CODE.rstrip("\n")
    chat.shoot("chat-markdown")


def test_a_failed_turn_is_shown_and_never_sent_again(chat: Chat) -> None:
    """A prompt over the context fails with the API's reason in view; the next
    turn succeeds and does not carry it; Edit gives its text back."""
    page = chat.page
    page.click("#chat-clear")
    expect(page.locator(".turn")).to_have_count(0)
    too_long = "word " * 9000
    chat.ask(too_long, 16)
    failed = page.locator(".turn.assistant").first  # (the first of this conversation)
    expect(failed).to_have_attribute("data-outcome", "failed")
    error = failed.locator("[data-error]")
    expect(error).to_contain_text("maximum context length")
    expect(error).to_be_in_viewport()
    expect(error.get_by_role("button", name="Retry")).to_be_visible()
    chat.shoot("chat-failed")
    expect(page.locator("#chat-text")).to_be_focused()

    sent = len(chat.bodies)
    chat.ask("hi", 8)
    expect(chat.answer()).to_have_attribute("data-outcome", "done", timeout=ANSWER_MS)
    [body] = chat.bodies[sent:]
    assert body["messages"] == [{"role": "user", "content": "hi"}], body["messages"]
    assert "word word" not in json.dumps(body)

    # Edit: the failed message goes back into the input, and its turn away.
    failed.get_by_role("button", name="Edit").click()
    expect(page.locator(".turn.assistant[data-outcome=failed]")).to_have_count(0)
    assert page.input_value("#chat-text") == too_long.strip()
    expect(page.locator("#chat-list li.active .chat-open")).to_have_text("hi")  # its new title
    page.fill("#chat-text", "")


def test_an_answer_cut_at_max_tokens_continues(chat: Chat) -> None:
    page = chat.page
    chat.ask("Count from 1 to 100, separated by commas.", 6)
    cut = chat.answer()
    expect(cut).to_have_attribute("data-outcome", "done", timeout=ANSWER_MS)
    expect(cut).to_have_attribute("data-finish", "length")
    note = cut.locator("[data-note=length]")
    expect(note).to_contain_text("stopped at max tokens")
    partial = page.evaluate(LAST_ANSWER)
    sent = len(chat.bodies)
    note.get_by_role("button", name="Continue").click()
    expect(cut).to_have_attribute("data-outcome", "done", timeout=ANSWER_MS)
    [body] = chat.bodies[sent:]
    assert body["continue_final_message"] is True
    assert body["messages"][-1] == {"role": "assistant", "content": partial}
    assert body["messages"][-2]["content"] == "Count from 1 to 100, separated by commas."
    after = page.evaluate(LAST_ANSWER)  # (as written: the view shows it as Markdown)
    assert after.startswith(partial) and len(after) > len(partial), (partial, after)
    expect(page.locator(".turn.assistant")).to_have_count(2)  # the same answer, longer


def test_esc_stops_an_answer_the_log_does_not_drag_back(chat: Chat) -> None:
    page = chat.page
    log = page.locator("#chat-log")
    # Enough in the log that it scrolls.
    page.evaluate("""() => { const t = document.querySelector('.turn.user .text');
        t.textContent += '\\nline'.repeat(60); }""")
    # The model (temperature 0.2) may end a story within seconds on some CPUs:
    # the browser's request is sent on with its end-of-text tokens barred, so the
    # answer still streams when the user scrolls up and presses Esc.
    page.route("**/v1/chat/completions", _never_ending)
    try:
        chat.ask("Tell me a long story about a lighthouse keeper and a storm.", 2000)
        answer = chat.answer()
        expect(answer.locator(".text")).not_to_be_empty(timeout=ANSWER_MS)
        log.hover()
        page.mouse.wheel(0, -5000)  # the user scrolls up mid-stream
        page.wait_for_function("document.getElementById('chat-log').scrollTop === 0")
        grown = answer.locator(".text").text_content() or ""
        page.wait_for_function(
            "n => document.querySelector('.turn.assistant:last-child .text').textContent.length > n",
            arg=len(grown),
            timeout=ANSWER_MS,
        )
    finally:
        page.unroute("**/v1/chat/completions", _never_ending)
    assert page.evaluate("document.getElementById('chat-log').scrollTop") == 0
    page.keyboard.press("Escape")
    expect(answer).to_have_attribute("data-outcome", "stopped")
    expect(answer.locator(".meta")).to_have_text(re.compile(r"^stopped · \d+ tokens?"))
    expect(page.locator("#chat-text")).to_be_focused()
    expect(page.locator("#chat-send")).to_be_visible()


def _never_ending(route: Route) -> None:
    body = json.loads(route.request.post_data or "{}")
    body["logit_bias"] = {str(token): -100 for token in END_OF_TEXT_TOKENS}
    route.continue_(post_data=json.dumps(body))


def test_conversations_are_kept_across_a_reload(chat: Chat) -> None:
    page = chat.page
    turns = page.locator(".turn").count()
    texts = page.locator(".turn.assistant .text").all_text_contents()
    page.reload()
    expect(page.locator(".turn")).to_have_count(turns)
    assert page.locator(".turn.assistant .text").all_text_contents() == texts
    items = page.locator("#chat-list li")
    expect(items).to_have_count(2)  # this one and the Markdown one
    expect(items.first).to_have_class(re.compile("active"))

    # Switch to the other conversation, then delete it (a second click confirms).
    other = items.nth(1)
    other.locator(".chat-open").click()
    expect(page.locator("pre > code")).to_have_count(1)
    other.locator(".chat-delete").click()
    expect(other.locator(".chat-delete")).to_have_text("Delete?")
    other.locator(".chat-delete").click()
    expect(items).to_have_count(1)
    expect(page.locator(".turn.assistant")).to_have_count(3)  # back to the one left
    page.reload()
    expect(items).to_have_count(1)
    expect(page.locator(".turn.assistant")).to_have_count(3)


def test_the_dark_theme_follows_the_system(chat: Chat) -> None:
    page = chat.page
    background = "getComputedStyle(document.documentElement).backgroundColor"
    page.emulate_media(color_scheme="light")
    light = page.evaluate(background)
    page.emulate_media(color_scheme="dark")
    dark = page.evaluate(background)
    assert light != dark, light
    channels = [int(c) for c in re.findall(r"\d+", dark)[:3]]
    assert max(channels) < 60, dark  # a dark background
    card = page.evaluate("getComputedStyle(document.querySelector('.card.chat')).backgroundColor")
    assert card != "rgb(255, 255, 255)"
    chat.shoot("chat-dark")
    page.emulate_media(color_scheme="light")
    # The page made no errors but the refused prompt's 400, which it shows.
    unexpected = [e for e in chat.errors.seen if "status of 400" not in e]
    assert unexpected == [], chat.errors.seen
