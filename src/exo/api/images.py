"""A request's images: fetched from their http(s) addresses (`fetch_images`),
then decoded and checked (`decode_image`) before the prompt is rendered.

The adapters have already decoded the images sent inline (data URLs, base64:
`request_fields.image_from_url` / `image_from_base64`); what is left here is
the network and the pixels. Every failure is a 400 naming the image's address
or the limit it broke: an image is the client's input, never a 500.

A node started with `--no-fetch-images` fetches nothing: an image given by
address is a 400 asking for it inline (a node that may reach hosts its clients
should not).
"""

import hashlib
import io
import warnings
from dataclasses import dataclass

import anyio
import httpx
from PIL import Image, UnidentifiedImageError

from exo.api.errors import APIError, invalid
from exo.shared.prompt_images import upright_rgb
from exo.shared.types.chat import ChatImage, ChatRequest, ChatTurn

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an image file, inline or fetched
MAX_IMAGE_PIXELS = 50_000_000  # width x height, checked before the pixels are read
FETCH_TIMEOUT_SECONDS = 10  # one image's whole fetch: connecting, redirects, the body
MAX_REDIRECTS = 5
_SHOWN_URL_CHARS = 200
# Content types an image may come with; others (text/html: an error or login
# page) are refused before their body is read.
_NEUTRAL_CONTENT_TYPES = ("application/octet-stream", "binary/octet-stream")


def request_images(request: ChatRequest) -> list[ChatImage]:
    """The request's images, in conversation order."""
    return [image for turn in request.turns for image in turn.images]


def _shown(url: str) -> str:
    return url if len(url) <= _SHOWN_URL_CHARS else url[:_SHOWN_URL_CHARS] + "..."


def _fetch_error(url: str, why: str) -> APIError:
    return invalid(f"could not fetch the image at {_shown(url)}: {why}", "messages", "image_fetch")


async def _fetch(client: httpx.AsyncClient, url: str) -> bytes:
    """The body at `url`: an image's file, at most MAX_IMAGE_BYTES, within the time limit."""
    try:
        with anyio.fail_after(FETCH_TIMEOUT_SECONDS):
            async with client.stream("GET", url) as response:
                if not response.is_success:
                    raise _fetch_error(url, f"the server answered HTTP {response.status_code}")
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if kind and not kind.startswith("image/") and kind not in _NEUTRAL_CONTENT_TYPES:
                    raise _fetch_error(url, f"the server sent {kind}, not an image")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
                    raise _fetch_error(url, _too_large())
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_IMAGE_BYTES:
                        raise _fetch_error(url, _too_large())
                return bytes(body)
    except (TimeoutError, httpx.TimeoutException):
        raise _fetch_error(
            url, f"it took longer than the {FETCH_TIMEOUT_SECONDS:g} s limit"
        ) from None
    except httpx.TooManyRedirects:
        raise _fetch_error(url, f"more than {MAX_REDIRECTS} redirects") from None
    except httpx.UnsupportedProtocol:
        raise _fetch_error(url, "a redirect left http(s)") from None
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise _fetch_error(url, str(error) or type(error).__name__) from None


def _too_large() -> str:
    return f"the image is larger than the {MAX_IMAGE_BYTES} bytes limit"


async def fetch_images(request: ChatRequest, allow_fetch: bool) -> ChatRequest:
    """`request` with every image given by address fetched into its `data`
    (each address once). `allow_fetch` False (`--no-fetch-images`): such an
    image is a 400 asking for it inline."""
    urls = list(dict.fromkeys(image.url for image in request_images(request) if image.url))
    if not urls:
        return request
    if not allow_fetch:
        raise invalid(
            f"this node does not fetch images (--no-fetch-images): send the image at "
            f"{_shown(urls[0])} inline, as a base64 data URL (or base64, for Ollama and "
            "Anthropic)",
            "messages",
            "image_fetch_disabled",
        )
    for url in urls:
        if not url[:8].lower().startswith(("http://", "https://")):
            raise _fetch_error(url, "only http(s) addresses are fetched")
    fetched: dict[str, bytes] = {}
    timeout = httpx.Timeout(FETCH_TIMEOUT_SECONDS)
    async with httpx.AsyncClient(
        follow_redirects=True, max_redirects=MAX_REDIRECTS, timeout=timeout
    ) as client:
        for url in urls:
            fetched[url] = await _fetch(client, url)

    def with_data(turn: ChatTurn) -> ChatTurn:
        if not any(image.url for image in turn.images):
            return turn
        images = tuple(
            ChatImage(offset=image.offset, data=fetched[image.url]) if image.url else image
            for image in turn.images
        )
        return turn.model_copy(update={"images": images})

    return request.model_copy(update={"turns": tuple(with_data(turn) for turn in request.turns)})


@dataclass(frozen=True)
class DecodedImage:
    """An image's pixels (RGB) and their digest, which identifies the picture
    whatever its file format or address (the prefix cache keys on it)."""

    image: Image.Image
    digest: str


def _not_readable(why: object) -> APIError:
    return invalid(f"an image is not a readable image ({why})", "messages", "invalid_image")


def _too_many_pixels(width: int, height: int) -> APIError:
    return invalid(
        f"an image of {width}x{height} pixels is over the {MAX_IMAGE_PIXELS} pixels limit",
        "messages",
        "image_too_large",
    )


def decode_image(data: bytes) -> DecodedImage:
    """The image in `data` (a PNG, JPEG, ... file) as RGB pixels, turned as its
    EXIF orientation says; transparency is laid over white. Its size is checked
    before its pixels are decoded (a small file can hold a huge image)."""
    if len(data) > MAX_IMAGE_BYTES:
        raise invalid(
            f"an image of {len(data)} bytes is over the {MAX_IMAGE_BYTES} bytes limit",
            "messages",
            "image_too_large",
        )
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns below its limit; ours is stricter.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as opened:
                width, height = opened.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise _too_many_pixels(width, height)
                opened.load()
                rgb = upright_rgb(opened)
    except Image.DecompressionBombError as error:
        raise invalid(str(error), "messages", "image_too_large") from None
    except UnidentifiedImageError:
        raise _not_readable("not a format Pillow reads, or a damaged file") from None
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise _not_readable(str(error) or type(error).__name__) from None
    if rgb.width * rgb.height > MAX_IMAGE_PIXELS:  # (turned by EXIF: the same count)
        raise _too_many_pixels(rgb.width, rgb.height)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return DecodedImage(rgb, digest.hexdigest())
