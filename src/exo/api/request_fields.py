"""Checks the three API request modules (OpenAI chat and completions,
Anthropic Messages, OpenAI Responses) share: how an unsupported value is
reported, the checks on raw JSON, on tools and on images (a data URL or base64
decoded, an http(s) URL kept) that read the same in each, and the base of
every request body (`RequestBody`)."""

import base64
import binascii
import math
from collections.abc import Iterable, Iterator
from typing import Any, cast

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from exo.shared.types.chat import ChatImage
from exo.shared.types.frozen import FrozenModel

# Deepest nesting of objects and arrays a request body may have: chat
# templates and grammar compilers recurse through it (Python's recursion
# limit, about 1000, fails a few hundred levels down). Real tool schemas nest
# a few levels.
MAX_JSON_DEPTH = 64


def unsupported(message: str) -> PydanticCustomError:
    """A validation error whose message is shown as is (no "Value error, " prefix)."""
    return PydanticCustomError("unsupported_parameter", "{reason}", {"reason": message})


def declared_types(items: Any) -> Iterator[object]:
    """The `type` of each entry of a raw JSON list (None for an entry that is not
    an object or names none); nothing when `items` is not a list. Read before
    validation, so an error can name the type a client sent rather than a union
    mismatch."""
    for item in items if isinstance(items, list) else ():  # pyright: ignore[reportUnknownVariableType]
        yield item.get("type") if isinstance(item, dict) else None  # pyright: ignore[reportUnknownMemberType]


def reject_non_function_choice(choice: Any) -> Any:
    """A raw `tool_choice` object must name a function (OpenAI's APIs)."""
    if isinstance(choice, dict) and choice.get("type") != "function":  # pyright: ignore[reportUnknownMemberType]
        raise unsupported(
            f"tool_choice {choice.get('type')!r} is not supported: "  # pyright: ignore[reportUnknownMemberType]
            'send "auto", "none", "required" or a function'
        )
    return choice


def reject_repeated_names(names: Iterable[str]) -> None:
    names = list(names)
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise unsupported(f"tool names must be distinct; repeated: {', '.join(repeated)}")


def choice_not_among_tools(kind: str, name: str, names: set[str]) -> PydanticCustomError:
    """`tool_choice` names a tool (`kind`: "function" or "tool") that `tools` lacks."""
    return unsupported(
        f"tool_choice names the {kind} {name!r}, which is not among tools "
        f"({', '.join(sorted(names)) or 'none given'})"
    )


# Why a field is accepted and ignored, in the words every API's list uses.
NO_END_USERS = "an end user's id, for OpenAI's abuse monitoring: exo has none"
CACHE_BY_TOKENS = "the prefix cache matches prompts by their tokens, with no keys or breakpoints"
SCHEMA_NOT_SHOWN = "the schema is not shown to the model: the grammar enforces it"


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _where(path: tuple[object, ...]) -> str:
    # Keys are shown with their lone surrogates escaped: the message must encode.
    shown = ".".join(str(part).encode("utf-8", "backslashreplace").decode() for part in path)
    return shown or "the request body"


def sound_json_problem(body: object) -> str | None:
    """Why a decoded JSON body cannot be used, or None: nested deeper than
    `MAX_JSON_DEPTH`, a string (or key) with a lone surrogate (a `\\ud800`
    escape: not UTF-8, so no tokenizer or reply can carry it), or a number
    JSON does not have (`NaN`, `Infinity`, or one too large for a float).
    Walked without recursion, so any depth is safe to look at."""
    pending: list[tuple[object, tuple[object, ...]]] = [(body, ())]
    while pending:
        value, path = pending.pop()
        if isinstance(value, dict):
            entries = cast(dict[object, object], value).items()
        elif isinstance(value, list):
            entries = enumerate(cast(list[object], value))
        elif isinstance(value, str) and _has_lone_surrogate(value):
            return f"{_where(path)}: holds a lone surrogate (strings must be valid Unicode)"
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{_where(path)}: numbers must be finite"
        else:
            continue
        if len(path) >= MAX_JSON_DEPTH:
            return f"{_where(path)}: nested deeper than {MAX_JSON_DEPTH} levels"
        for key, item in entries:
            if isinstance(key, str) and _has_lone_surrogate(key):
                return f"{_where((*path, key))}: the key holds a lone surrogate"
            pending.append((item, (*path, key)))
    return None


class RequestBody(FrozenModel):
    """The body of a generation or token-count request: before its fields are
    read, the whole decoded JSON must be sound (`sound_json_problem`)."""

    @model_validator(mode="before")
    @classmethod
    def _sound_json(cls, body: Any) -> Any:
        if problem := sound_json_problem(body):
            raise unsupported(problem)
        return body


# ---- images ----

_IMAGE_SCHEMES = ("http://", "https://")


def image_from_base64(text: str) -> ChatImage:
    """An image sent as base64 text (whitespace allowed, as MIME wraps it): its
    bytes. Malformed base64 or nothing at all is a 400 naming the field."""
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise unsupported("the image is not valid base64") from None
    if not data:
        raise unsupported("the image is empty")
    return ChatImage(data=data)


def image_from_url(url: str) -> ChatImage:
    """An image sent as an address: a base64 `data:` URL is decoded here, an
    http(s) URL is kept for the node to fetch (`exo.api.images`); any other
    scheme is a 400 naming the field."""
    if url[:5].lower() == "data:":
        header, comma, payload = url[5:].partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise unsupported(
                "an image data URL must be base64: data:image/png;base64,<the file as base64>"
            )
        return image_from_base64(payload)
    if url[:8].lower().startswith(_IMAGE_SCHEMES):
        return ChatImage(url=url)
    shown = url if len(url) <= 60 else url[:60] + "..."
    raise unsupported(f"an image URL must be a base64 data URL or an http(s) URL, not {shown!r}")


def text_with_images(pieces: Iterable[str | ChatImage]) -> tuple[str, tuple[ChatImage, ...]]:
    """A message's text pieces joined, and its images, each at the length of
    the text before it (`ChatImage.offset`)."""
    texts: list[str] = []
    images: list[ChatImage] = []
    length = 0
    for piece in pieces:
        if isinstance(piece, ChatImage):
            images.append(piece.model_copy(update={"offset": length}))
        else:
            texts.append(piece)
            length += len(piece)
    return "".join(texts), tuple(images)


def check_raw_image(reference: object, where: str, base64_only: bool = False) -> None:
    """An image of the raw body (a data or http(s) URL; base64 when
    `base64_only`), checked before validation: past a `str | list` content
    union pydantic would report the string mismatch first. `where` names the
    part in the message; a reference that is not a string is left to the
    part's own validation."""
    if not isinstance(reference, str):
        return
    try:
        image_from_base64(reference) if base64_only else image_from_url(reference)
    except PydanticCustomError as error:
        raise unsupported(f"{where}: {error.message()}") from None
