"""Request images: fetched from a real HTTP server (limits, time, redirects,
errors, `--no-fetch-images`), then decoded to RGB pixels whose digest names
the picture whatever its file format."""

import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from PIL import Image

from exo.api import images
from exo.api.errors import APIError
from exo.api.images import decode_image, fetch_images, request_images
from exo.shared.types.chat import ChatImage, ChatRequest, ChatTurn


def picture_file(image_format: str, color: tuple[int, int, int] = (200, 30, 40)) -> bytes:
    image = Image.new("RGB", (4, 3), color)
    image.putpixel((1, 1), (0, 255, 0))
    out = io.BytesIO()
    image.save(out, format=image_format, lossless=True)  # (WebP's; the others ignore it)
    return out.getvalue()


PNG = picture_file("PNG")
BIG = b"\0" * 5000  # over the patched byte limit


class _Handler(BaseHTTPRequestHandler):
    released: threading.Event

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet tests

    def _send(self, status: int, body: bytes, kind: str = "image/png", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        for name, value in headers.items():
            self.send_header(name, value)
        if "Transfer-Encoding" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if "Transfer-Encoding" in headers:  # chunked, with no length to check first
            for start in range(0, len(body), 1000):
                chunk = body[start : start + 1000]
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.write(body)

    def do_GET(self) -> None:
        match self.path:
            case "/cat.png":
                self._send(200, PNG)
            case "/octets":
                self._send(200, PNG, "application/octet-stream")
            case "/big":
                self._send(200, BIG)
            case "/big-chunked":
                self._send(200, BIG, **{"Transfer-Encoding": "chunked"})
            case "/page":
                self._send(200, b"<html>log in</html>", "text/html; charset=utf-8")
            case "/redirect":
                self._send(302, b"", "text/plain", Location="/cat.png")
            case "/loop":
                self._send(302, b"", "text/plain", Location="/loop")
            case "/to-ftp":
                self._send(302, b"", "text/plain", Location="ftp://127.0.0.1/cat.png")
            case "/slow":
                self.released.wait(5)  # answers after the client gave up
                self._send(200, PNG)
            case _:
                self._send(404, b"not found", "text/plain")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that stopped reading (over a limit) is expected


@pytest.fixture
def server() -> Iterator[str]:
    released = threading.Event()
    handler = type("Handler", (_Handler,), {"released": released})
    httpd = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        released.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def with_images(*turn_images: tuple[ChatImage, ...]) -> ChatRequest:
    turns = tuple(ChatTurn(role="user", content="Look", images=i) for i in turn_images)
    return ChatRequest(model="m", turns=turns)


async def fetch_error(url: str) -> str:
    with pytest.raises(APIError) as caught:
        await fetch_images(with_images((ChatImage(url=url),)), allow_fetch=True)
    assert caught.value.status == 400
    assert url in caught.value.message
    return caught.value.message


# ---- fetch_images ----


async def test_url_images_are_fetched_in_place(server: str) -> None:
    inline = ChatImage(offset=1, data=b"inline bytes")
    request = with_images(
        (inline, ChatImage(offset=4, url=f"{server}/cat.png")),
        (ChatImage(url=f"{server}/redirect"), ChatImage(url=f"{server}/octets")),
    )
    fetched = await fetch_images(request, allow_fetch=True)
    assert request_images(fetched) == [
        inline,
        ChatImage(offset=4, data=PNG),
        ChatImage(data=PNG),
        ChatImage(data=PNG),
    ]
    assert [turn.content for turn in fetched.turns] == ["Look", "Look"]


async def test_a_request_without_url_images_is_returned_as_is() -> None:
    request = with_images((ChatImage(data=PNG),))
    assert await fetch_images(request, allow_fetch=False) is request


async def test_no_fetch_images_asks_for_the_image_inline(server: str) -> None:
    url = f"{server}/cat.png"
    with pytest.raises(APIError) as caught:
        await fetch_images(with_images((ChatImage(url=url),)), allow_fetch=False)
    assert caught.value.status == 400
    message = caught.value.message
    assert "does not fetch images (--no-fetch-images)" in message
    assert url in message and "data URL" in message


@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
async def test_an_image_over_the_byte_limit_is_refused(
    server: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 1000)
    assert "larger than the 1000 bytes limit" in await fetch_error(server + path)


async def test_a_slow_server_runs_into_the_time_limit(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images, "FETCH_TIMEOUT_SECONDS", 0.3)
    assert "longer than the 0.3 s limit" in await fetch_error(f"{server}/slow")


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/missing", "the server answered HTTP 404"),
        ("/page", "the server sent text/html, not an image"),
        ("/loop", f"more than {images.MAX_REDIRECTS} redirects"),
        ("/to-ftp", "a redirect left http(s)"),
    ],
)
async def test_fetch_failures_name_the_url_and_why(server: str, path: str, why: str) -> None:
    assert why in await fetch_error(server + path)


async def test_an_unreachable_host_is_a_400() -> None:
    assert "could not fetch the image" in await fetch_error("http://127.0.0.1:1/cat.png")


# ---- decode_image ----


@pytest.mark.parametrize("image_format", ["BMP", "TIFF", "WEBP"])
def test_the_same_pixels_have_the_same_digest_whatever_the_format(image_format: str) -> None:
    decoded = decode_image(picture_file(image_format))
    as_png = decode_image(PNG)
    assert decoded.digest == as_png.digest
    assert decoded.image.mode == "RGB" and decoded.image.size == (4, 3)
    assert decoded.image.tobytes() == as_png.image.tobytes()


def test_other_pixels_or_another_shape_have_another_digest() -> None:
    other_color = decode_image(picture_file("PNG", color=(200, 30, 41)))
    reshaped = Image.new("RGB", (3, 4))
    reshaped.frombytes(decode_image(PNG).image.tobytes())
    out = io.BytesIO()
    reshaped.save(out, format="PNG")
    digests = {decode_image(PNG).digest, other_color.digest, decode_image(out.getvalue()).digest}
    assert len(digests) == 3


def test_transparency_is_laid_over_white_and_grey_becomes_rgb() -> None:
    clear = io.BytesIO()
    Image.new("RGBA", (2, 2), (10, 20, 30, 0)).save(clear, format="PNG")
    assert decode_image(clear.getvalue()).image.getpixel((0, 0)) == (255, 255, 255)
    grey = io.BytesIO()
    Image.new("L", (2, 2), 7).save(grey, format="PNG")
    assert decode_image(grey.getvalue()).image.getpixel((0, 0)) == (7, 7, 7)


@pytest.mark.parametrize("data", [b"", b"not an image at all", PNG[:40]])
def test_unreadable_bytes_are_a_400(data: bytes) -> None:
    with pytest.raises(APIError) as caught:
        decode_image(data)
    assert caught.value.status == 400
    assert "not a readable image (" in caught.value.message


def test_an_image_over_the_pixel_limit_is_refused_before_its_pixels_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 11)
    with pytest.raises(APIError) as caught:
        decode_image(PNG)
    assert caught.value.status == 400
    assert "4x3 pixels is over the 11 pixels limit" in caught.value.message
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 12)
    assert decode_image(PNG).image.size == (4, 3)


def test_an_image_file_over_the_byte_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", len(PNG) - 1)
    with pytest.raises(APIError) as caught:
        decode_image(PNG)
    assert f"over the {len(PNG) - 1} bytes limit" in caught.value.message


def test_request_images_are_in_conversation_order() -> None:
    first, second, third = (ChatImage(offset=i, data=b"x") for i in range(3))
    request = with_images((first, second), (), (third,))
    assert request_images(request) == [first, second, third]
