"""The dashboard's chat with images, in a real browser (headless Chromium)
against one real node: the node's built-in model reads text only, so the chat
refuses images for it (the attach button disabled, paste and drop say why);
for a model that reads images (its `/v1/models` entry routed here, as is its
answer: the server's side is tested elsewhere), pasted, dropped and picked
images show as thumbnails, go in the request as `image_url` parts beside the
text part, stay in the log and in the stored conversation across a reload, and
go again with Continue, Retry and Edit. Screenshots go to docs/screenshots/."""

import base64
import json
import os
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    JSHandle,
    Locator,
    Page,
    Route,
    expect,
)

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.browser import headless_chromium
from tests.e2e.node_process import NodeProcess
from tests.e2e.test_dashboard_chat import Chat, new_context, sse_reply

pytestmark = pytest.mark.slow

VISION_MODEL = "test/vision-model"
MIB = 1024 * 1024
# The files a test hands the page: name, type and bytes (None: `size` zeros).
FILES_JS = """(files) => {
  const transfer = new DataTransfer();
  for (const f of files) {
    const bytes = f.b64 === null ? new Uint8Array(f.size) : Uint8Array.from(atob(f.b64), (c) => c.charCodeAt(0));
    transfer.items.add(new File([bytes], f.name, { type: f.type }));
  }
  return transfer;
}"""
STORED = """() => JSON.parse(localStorage.getItem("exo.chats")).conversations"""


def png(width: int, height: int, rgb: tuple[int, int, int] | None) -> bytes:
    """A PNG of one colour, or of random noise (which does not compress) when `rgb` is None."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = (lambda: os.urandom(3 * width)) if rgb is None else (lambda: bytes(rgb) * width)
    pixels = b"".join(b"\x00" + row() for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    level = 0 if rgb is None else 9
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(pixels, level))
        + chunk(b"IEND", b"")
    )


RED = png(96, 64, (220, 38, 38))
BLUE = png(64, 96, (37, 99, 235))
GREEN = png(64, 64, (22, 163, 74))


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def file_spec(name: str, image: bytes | None, kind: str = "image/png", size: int = 0) -> dict:
    b64 = None if image is None else base64.b64encode(image).decode()
    return {"name": name, "type": kind, "b64": b64, "size": size}


def files(page: Page, *specs: dict) -> JSHandle:
    return page.evaluate_handle(FILES_JS, list(specs))


def paste(page: Page, image: bytes) -> None:
    """An image put on the clipboard, pasted (Ctrl+V) into the message box. (The
    browser encodes the image again: what it pastes is not these bytes.)"""
    page.evaluate(
        """async (b64) => {
          const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
          const blob = new Blob([bytes], { type: "image/png" });
          await navigator.clipboard.write([new ClipboardItem({ "image/png": blob })]);
        }""",
        base64.b64encode(image).decode(),
    )
    page.focus("#chat-text")
    page.keyboard.press("Control+V")


def drop(page: Page, *specs: dict) -> None:
    """Files dragged onto the conversation and dropped there."""
    transfer = files(page, *specs)
    target = page.locator("#chat-log")
    target.dispatch_event("dragenter", {"dataTransfer": transfer})
    target.dispatch_event("dragover", {"dataTransfer": transfer})
    target.dispatch_event("drop", {"dataTransfer": transfer})


def model_entry(model_id: str, images: bool | None) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "exo",
        "status": "ready",
        "context_length": 4096,
        "images": images,
    }


class Completions:
    """Answers `/v1/chat/completions` here, keeping each request's body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.finish = "stop"
        self.fail_next = False

    def __call__(self, route: Route) -> None:
        self.bodies.append(json.loads(route.request.post_data or "{}"))
        if self.fail_next:
            self.fail_next = False
            error = {"error": {"message": "the model is busy", "type": "server_error"}}
            route.fulfill(status=503, json=error)
            return
        body = sse_reply("I see a red rectangle and a blue one.")
        body = body.replace('"finish_reason": "stop"', f'"finish_reason": "{self.finish}"')
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    expect.set_options(timeout=30_000)
    with headless_chromium() as started:
        yield started


@pytest.fixture
def context(browser: Browser, node: NodeProcess) -> Iterator[BrowserContext]:
    context = new_context(browser, node)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture
def vision(context: BrowserContext, node: NodeProcess) -> tuple[Chat, Completions]:
    """A page where the node also serves a model that reads images (as its
    `/v1/models` says here), whose answers come from `Completions`."""

    def models(route: Route) -> None:
        data = [model_entry(DEFAULT_MODEL_ID, False), model_entry(VISION_MODEL, True)]
        route.fulfill(json={"object": "list", "data": data})

    completions = Completions()
    context.route("**/v1/models", models)
    context.route("**/v1/chat/completions", completions)
    chat = Chat(context, node.base_url)
    chat.page.select_option("#chat-model", VISION_MODEL)
    expect(chat.page.locator("#chat-attach")).to_be_enabled()
    return chat, completions


def thumbnails(page: Page) -> Locator:
    return page.locator("#chat-attachments .attachment img")


def test_a_text_only_model_takes_no_images(context: BrowserContext, node: NodeProcess) -> None:
    chat = Chat(context, node.base_url)
    page = chat.page
    refusal = f"{DEFAULT_MODEL_ID} reads text only"
    attach = page.locator("#chat-attach")
    expect(attach).to_be_disabled()
    expect(attach).to_have_attribute("title", refusal)
    note = page.locator("#chat-attach-note")
    expect(note).to_be_hidden()

    paste(page, RED)
    expect(note).to_have_text(refusal)
    expect(note).to_be_visible()
    assert page.input_value("#chat-text") == ""
    drop(page, file_spec("blue.png", BLUE))
    expect(note).to_have_text(refusal)
    page.set_input_files(
        "#chat-file", files=[{"name": "g.png", "mimeType": "image/png", "buffer": GREEN}]
    )
    expect(note).to_have_text(refusal)
    expect(thumbnails(page)).to_have_count(0)
    expect(page.locator("#chat-attachments")).to_be_hidden()
    chat.shoot("chat-images-text-only")
    # Text still pastes as text.
    page.evaluate("navigator.clipboard.writeText('plain words')")
    page.keyboard.press("Control+V")
    assert page.input_value("#chat-text") == "plain words"
    assert chat.bodies == []
    assert chat.errors.seen == []


def test_images_go_with_a_message_as_parts(vision: tuple[Chat, Completions]) -> None:
    chat, completions = vision
    page = chat.page

    # A text-only message stays a plain string.
    chat.ask("hello", 32)
    expect(chat.answer()).to_have_attribute("data-outcome", "done")
    assert completions.bodies[-1]["messages"] == [{"role": "user", "content": "hello"}]

    # Pasted, dropped and picked; one removed again.
    paste(page, RED)
    expect(thumbnails(page)).to_have_count(1)
    pasted = thumbnails(page).first
    assert pasted.evaluate("img => [img.naturalWidth, img.naturalHeight]") == [96, 64]
    red = pasted.get_attribute("src") or ""  # (the clipboard's own PNG of RED)
    assert red.startswith("data:image/png;base64,")
    drop(page, file_spec("blue.png", BLUE))
    expect(thumbnails(page)).to_have_count(2)
    page.set_input_files(
        "#chat-file", files=[{"name": "green.png", "mimeType": "image/png", "buffer": GREEN}]
    )
    expect(thumbnails(page)).to_have_count(3)
    # Too large, or not an image: refused, with a message.
    note = page.locator("#chat-attach-note")
    drop(page, file_spec("huge.png", None, size=21 * MIB))
    expect(note).to_have_text("huge.png is 21.0 MiB: images over 20.0 MiB are refused")
    drop(page, file_spec("notes.txt", b"hello", kind="text/plain"))
    expect(note).to_have_text("notes.txt is not an image")
    expect(thumbnails(page)).to_have_count(3)
    page.get_by_role("button", name="Remove green.png").click()
    expect(thumbnails(page)).to_have_count(2)
    expect(note).to_be_hidden()
    assert [img.get_attribute("src") for img in thumbnails(page).all()] == [red, data_url(BLUE)]
    page.fill("#chat-text", "What colours are these?")
    chat.shoot("chat-images-attached")

    # Sent: the text part and an image_url part per image; the earlier turn stays a string.
    completions.finish = "length"
    page.press("#chat-text", "Enter")
    answer = chat.answer()
    expect(answer).to_have_attribute("data-outcome", "done")
    expect(page.locator("#chat-attachments")).to_be_hidden()
    expect(note).to_be_hidden()
    parts = [
        {"type": "text", "text": "What colours are these?"},
        {"type": "image_url", "image_url": {"url": red}},
        {"type": "image_url", "image_url": {"url": data_url(BLUE)}},
    ]
    body = completions.bodies[-1]
    assert body["model"] == VISION_MODEL
    assert body["messages"][0] == {"role": "user", "content": "hello"}
    assert body["messages"][-1] == {"role": "user", "content": parts}
    sent = page.locator(".turn.user").last.locator("img.turn-image")
    expect(sent).to_have_count(2)
    assert [img.get_attribute("src") for img in sent.all()] == [red, data_url(BLUE)]
    assert sent.first.evaluate("img => img.naturalWidth") == 96  # drawn, not broken

    # Continue sends the images again.
    completions.finish = "stop"
    answer.get_by_role("button", name="Continue").click()
    expect(answer).to_have_attribute("data-finish", "stop")
    body = completions.bodies[-1]
    assert body["continue_final_message"] is True
    assert body["messages"][-2] == {"role": "user", "content": parts}

    # So do the next turns' histories, and Retry.
    completions.fail_next = True
    chat.ask("And now?", 32)
    failed = chat.answer()
    expect(failed).to_have_attribute("data-outcome", "failed")
    assert completions.bodies[-1]["messages"][2] == {"role": "user", "content": parts}
    failed.get_by_role("button", name="Retry").click()
    expect(chat.answer()).to_have_attribute("data-outcome", "done")
    assert completions.bodies[-1]["messages"][-1] == {"role": "user", "content": "And now?"}
    chat.shoot("chat-images-sent")

    # The stored conversation keeps the images: they are back after a reload.
    stored = page.evaluate(STORED)[0]["exchanges"]
    assert [i["url"] for i in stored[1]["images"]] == [red, data_url(BLUE)]
    page.reload()
    expect(page.locator(".turn.user")).to_have_count(3)
    sent = page.locator(".turn.user").nth(1).locator("img.turn-image")
    expect(sent).to_have_count(2)
    assert [img.get_attribute("src") for img in sent.all()] == [red, data_url(BLUE)]
    expect(page.locator("#chat-save-note")).to_be_hidden()

    # Edit gives a failed message's images back with its text.
    page.select_option("#chat-model", VISION_MODEL)
    completions.fail_next = True
    paste(page, GREEN)
    expect(thumbnails(page)).to_have_count(1)
    green = thumbnails(page).first.get_attribute("src")
    page.fill("#chat-text", "Which is green?")
    page.press("#chat-text", "Enter")
    failed = chat.answer()
    expect(failed).to_have_attribute("data-outcome", "failed")
    failed.get_by_role("button", name="Edit").click()
    assert page.input_value("#chat-text") == "Which is green?"
    expect(thumbnails(page)).to_have_count(1)
    assert thumbnails(page).first.get_attribute("src") == green
    # An image alone may be sent.
    page.fill("#chat-text", "")
    page.click("#chat-send")
    expect(chat.answer()).to_have_attribute("data-outcome", "done")
    image_only = [{"type": "image_url", "image_url": {"url": green}}]
    assert completions.bodies[-1]["messages"][-1] == {"role": "user", "content": image_only}
    unexpected = [e for e in chat.errors.seen if "status of 503" not in e]
    assert unexpected == [], chat.errors.seen


def test_a_model_switch_keeps_attached_images_from_a_text_only_model(
    vision: tuple[Chat, Completions],
) -> None:
    chat, completions = vision
    page = chat.page
    paste(page, RED)
    expect(thumbnails(page)).to_have_count(1)
    page.select_option("#chat-model", DEFAULT_MODEL_ID)
    note = page.locator("#chat-attach-note")
    expect(note).to_contain_text(f"{DEFAULT_MODEL_ID} reads text only")
    expect(page.locator("#chat-attach")).to_be_disabled()
    page.fill("#chat-text", "what is this?")
    page.press("#chat-text", "Enter")
    expect(note).to_contain_text("remove the images or choose another model")
    assert completions.bodies == []
    page.select_option("#chat-model", VISION_MODEL)
    expect(note).to_be_hidden()
    page.press("#chat-text", "Enter")
    expect(chat.answer()).to_have_attribute("data-outcome", "done")
    assert len(completions.bodies) == 1


def test_images_too_large_to_store_stay_in_memory(vision: tuple[Chat, Completions]) -> None:
    """An image larger than this browser's storage: the conversation keeps it
    while the page is open and says it is not saved; its text is saved, and
    no other conversation is pushed out for it."""
    chat, _ = vision
    page = chat.page
    chat.ask("a first conversation", 32)
    expect(chat.answer()).to_have_attribute("data-outcome", "done")
    page.click("#chat-clear")
    noise = png(1600, 1300, None)  # ~6 MB: ~8.3 M characters as a data URL
    assert 5 * MIB < len(noise) < 20 * MIB
    drop(page, file_spec("noise.png", noise))
    expect(thumbnails(page)).to_have_count(1)
    chat.ask("what is this noise?", 32)
    expect(chat.answer()).to_have_attribute("data-outcome", "done")
    save_note = page.locator("#chat-save-note")
    expect(save_note).to_have_text("not saved: images too large")
    expect(save_note).to_be_visible()
    expect(page.locator(".turn.user img.turn-image")).to_have_count(1)
    chat.shoot("chat-images-not-saved")
    stored = page.evaluate(STORED)
    assert [c["title"] for c in stored] == ["what is this noise?", "a first conversation"]
    assert stored[0]["exchanges"][0]["images"] == [{"name": "noise.png", "omitted": True}]
    # The other conversation does not carry the note.
    page.locator("#chat-list li").nth(1).locator(".chat-open").click()
    expect(save_note).to_be_hidden()
    page.locator("#chat-list li").first.locator(".chat-open").click()
    expect(save_note).to_be_visible()

    page.reload()
    expect(page.locator("#chat-list li")).to_have_count(2)
    expect(page.locator(".turn.user .text")).to_have_text("what is this noise?")
    expect(page.locator(".turn.user .turn-image.omitted")).to_contain_text("noise.png: not kept")
    expect(save_note).to_be_hidden()
    assert chat.errors.seen == []
