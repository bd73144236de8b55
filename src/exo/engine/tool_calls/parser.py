"""Streaming tool-call parser: generated text deltas in, text and call events out.

Feed it the reply's content (after the reasoning split) as it is generated:

    parser = ToolCallParser(detect_tool_format(template))
    for delta in deltas:
        handle(parser.feed(delta))
    handle(parser.finish())

Events, in the order a client needs them:
- `TextPiece`: text outside calls. Only a possible start of a call marker and
  trailing whitespace are held back (whitespace next to a call is framing that
  the chat template writes itself, not content); everything else goes out at once.
- `ToolCallStart`: a call's index, id and name, as soon as the name is known
  (formats whose model writes the id: as soon as the id is known too).
- `ToolCallArgumentsPiece`: the arguments' JSON text, in pieces as it arrives.
- `ToolCallEnd`: the call complete and checked.
- `ToolCallAbandoned`: a started call turned out malformed; its raw text follows
  as a `TextPiece`.

A call that is malformed (bad JSON, no name, arguments not an object, cut off
by the end of the output) comes back as the text the model wrote, with a
warning in the log; the parser never raises on model output.
"""

import json
import re
import secrets
import string
from collections.abc import Callable
from enum import Enum, auto
from typing import Annotated, Any, Literal

from loguru import logger
from pydantic import Field

from exo.engine.tool_calls.call_json import CallJsonScan
from exo.engine.tool_calls.formats import ToolCallFamily, ToolCallFormat
from exo.shared.types.chat import ToolCall
from exo.shared.types.frozen import FrozenModel

_WHITESPACE = " \t\r\n"
_ALPHANUMERIC = string.ascii_letters + string.digits
# what a function name or call id written bare (before an args marker) may hold
_BARE_NAME = re.compile(r"[\w.:-]*")
_MAX_BARE_NAME = 256


class TextPiece(FrozenModel):
    kind: Literal["text"] = "text"
    text: str


class ToolCallStart(FrozenModel):
    kind: Literal["tool_call_start"] = "tool_call_start"
    index: int
    id: str
    name: str


class ToolCallArgumentsPiece(FrozenModel):
    kind: Literal["tool_call_arguments"] = "tool_call_arguments"
    index: int
    text: str


class ToolCallEnd(FrozenModel):
    kind: Literal["tool_call_end"] = "tool_call_end"
    index: int
    call: ToolCall


class ToolCallAbandoned(FrozenModel):
    kind: Literal["tool_call_abandoned"] = "tool_call_abandoned"
    index: int


ToolCallEvent = Annotated[
    TextPiece | ToolCallStart | ToolCallArgumentsPiece | ToolCallEnd | ToolCallAbandoned,
    Field(discriminator="kind"),
]


class ParsedReply(FrozenModel):
    """A whole reply parsed at once: its text and the calls it made."""

    content: str
    tool_calls: tuple[ToolCall, ...]


def openai_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def mistral_call_id() -> str:
    # Mistral templates refuse any id but 9 alphanumerics.
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class _State(Enum):
    TEXT = auto()  # outside calls, watching for a marker
    OPENING = auto()  # after a marker, before the call's `{` (or the list's `[`)
    HEADER = auto()  # a bare call header: name, id, up to the args marker
    CALL = auto()  # inside a call's JSON object (or, after a header, its arguments)
    BETWEEN = auto()  # after a call: its suffix, a list's `,`/`]`, llama's `;`


class ToolCallParser:
    """Reads one reply's calls in one format; see the module docstring for the events."""

    def __init__(self, fmt: ToolCallFormat, new_call_id: Callable[[], str] | None = None) -> None:
        self._fmt = fmt
        self._new_call_id = new_call_id or (
            mistral_call_id if fmt.family == ToolCallFamily.MISTRAL else openai_call_id
        )
        self._allowed_keys = frozenset(
            key for key in (fmt.name_key, fmt.arguments_key, fmt.id_key) if key is not None
        )
        self._state = _State.TEXT
        self._pending = ""  # input not yet consumed by the state machine
        self._seen_text = False  # any non-whitespace text so far (bare JSON only opens a reply)
        self._after_call = False  # strip the whitespace that follows a call
        self._raw = ""  # the text of the call being read, as the model wrote it
        self._in_list = False
        self._args_only = False  # the object being read is the arguments (after a header)
        self._scan = CallJsonScan(self._allowed_keys)
        self._next_index = 0
        self._started: ToolCallStart | None = None
        self._arguments_sent = 0  # characters of the arguments' text already sent

    def feed(self, delta: str) -> list[ToolCallEvent]:
        self._pending += delta
        events: list[ToolCallEvent] = []
        while self._pending and self._step(events):
            pass
        return events

    def finish(self) -> list[ToolCallEvent]:
        events: list[ToolCallEvent] = []
        match self._state:
            case _State.TEXT:
                self._emit_text(events, self._pending)
            case _State.OPENING | _State.HEADER | _State.CALL:
                self._malformed(events, self._raw + self._pending, "the output ended inside a call")
            case _State.BETWEEN:
                pass  # a missing closing suffix or `]` after complete calls is forgiven
        self._pending = ""
        self._state = _State.TEXT
        return events

    def _step(self, events: list[ToolCallEvent]) -> bool:
        """Advance on `_pending`; False when it must wait for more input."""
        match self._state:
            case _State.TEXT:
                return self._step_text(events)
            case _State.OPENING:
                return self._step_opening(events)
            case _State.HEADER:
                return self._step_header(events)
            case _State.CALL:
                return self._step_call(events)
            case _State.BETWEEN:
                return self._step_between(events)

    def _step_text(self, events: list[ToolCallEvent]) -> bool:
        text = self._pending
        if self._after_call:
            text = text.lstrip(_WHITESPACE)
            if not text:
                self._pending = ""
                return False
            self._after_call = False
        if self._fmt.bare_json_start and not self._seen_text:
            stripped = text.lstrip(_WHITESPACE)
            if not stripped:
                self._pending = text
                return False
            if stripped.startswith("{"):
                self._pending = stripped
                self._open_call(text[: len(text) - len(stripped)])
                return True
        found = [(text.find(m), m) for m in self._fmt.markers]
        hits = [(at, m) for at, m in found if at >= 0]
        if hits:
            at, marker = min(hits)
            before = text[:at].rstrip(_WHITESPACE)
            self._emit_text(events, before)
            self._pending = text[at + len(marker) :]
            # the whitespace before a call is framing, unless the call proves malformed
            self._open_call(text[len(before) : at + len(marker)])
            return True
        hold = _partial_marker_length(text, self._fmt.markers)
        sendable = text[: len(text) - hold]
        kept = sendable.rstrip(_WHITESPACE)
        self._emit_text(events, kept)
        self._pending = text[len(kept) :]
        return False

    def _open_call(self, raw: str) -> None:
        self._raw = raw
        self._in_list = False
        self._args_only = False
        self._state = _State.OPENING

    def _step_opening(self, events: list[ToolCallEvent]) -> bool:
        text = self._pending.lstrip(_WHITESPACE)
        self._raw += self._pending[: len(self._pending) - len(text)]
        self._pending = text
        if not text:
            return False
        if self._fmt.args_marker is not None and not self._args_only:
            self._state = _State.HEADER
            return True
        if self._fmt.list_form and not self._in_list:
            if text[0] != "[":
                self._malformed(events, self._raw, "the calls are not a JSON list")
                return True
            self._raw += "["
            self._pending = text[1:]
            self._in_list = True
            return True
        if text[0] != "{":
            self._malformed(events, self._raw, "a call is a JSON object")
            return True
        self._scan = CallJsonScan(None if self._args_only else self._allowed_keys)
        self._state = _State.CALL
        return True

    def _step_header(self, events: list[ToolCallEvent]) -> bool:
        fmt = self._fmt
        assert fmt.args_marker is not None
        text = self._pending
        at = text.find(fmt.args_marker)
        seen = (
            text[:at]
            if at >= 0
            else text[: len(text) - _partial_marker_length(text, self._header_markers())]
        )
        if fmt.id_marker is not None and fmt.id_marker in seen:
            name, _, call_id = seen.partition(fmt.id_marker)
        else:
            name, call_id = seen, ""
        valid = (
            _BARE_NAME.fullmatch(name) is not None
            and _BARE_NAME.fullmatch(call_id) is not None
            and len(seen) <= _MAX_BARE_NAME
        )
        if not valid or (at >= 0 and not name):
            self._malformed(events, self._raw, "no function name before the arguments")
            return True
        if at < 0:
            return False
        self._raw += text[: at + len(fmt.args_marker)]
        self._pending = text[at + len(fmt.args_marker) :]
        self._start(events, name, call_id or None)
        self._args_only = True
        self._state = _State.OPENING
        return True

    def _header_markers(self) -> tuple[str, ...]:
        fmt = self._fmt
        return tuple(m for m in (fmt.args_marker, fmt.id_marker) if m is not None)

    def _step_call(self, events: list[ToolCallEvent]) -> bool:
        used = self._scan.feed(self._pending)
        self._raw += self._pending[:used]
        self._pending = self._pending[used:]
        if self._scan.error is not None:
            self._malformed(events, self._raw, self._scan.error)
            return True
        self._stream_call(events)
        if self._scan.done:
            self._complete_call(events)
            return True
        return False

    def _stream_call(self, events: list[ToolCallEvent]) -> None:
        scan, fmt = self._scan, self._fmt
        if self._args_only:
            self._send_arguments(events, 0, len(scan.text))
            return
        if self._started is None:
            name = _string_value(scan, fmt.name_key)
            if name is None:
                return
            model_id = _string_value(scan, fmt.id_key) if fmt.id_key is not None else None
            if fmt.id_key is not None and model_id is None:
                return  # wait for the id the model writes after the arguments
            self._start(events, name, model_id)
        span = scan.spans.get(fmt.arguments_key)
        if span is None or scan.text[span[0]] != "{":
            return  # arguments given as a string (or absent) are sent once decoded
        self._send_arguments(events, span[0], span[1] if span[1] is not None else len(scan.text))

    def _send_arguments(self, events: list[ToolCallEvent], start: int, end: int) -> None:
        """Send what is new of the arguments' text, which lies at `scan.text[start:end]`."""
        assert self._started is not None
        piece = self._scan.text[start + self._arguments_sent : end]
        if piece:
            self._arguments_sent += len(piece)
            events.append(ToolCallArgumentsPiece(index=self._started.index, text=piece))

    def _start(self, events: list[ToolCallEvent], name: str, model_id: str | None) -> None:
        call_id = (
            model_id
            if model_id is not None and len(model_id) == 9 and model_id.isalnum()
            else self._new_call_id()
        )
        self._started = ToolCallStart(index=self._next_index, id=call_id, name=name)
        self._next_index += 1
        self._arguments_sent = 0
        events.append(self._started)

    def _complete_call(self, events: list[ToolCallEvent]) -> None:
        scan, fmt = self._scan, self._fmt
        try:
            value: Any = json.loads(scan.text)
        except json.JSONDecodeError as error:
            self._malformed(events, self._raw, f"invalid JSON: {error}")
            return
        if self._args_only:
            started = self._started
            assert started is not None
            name, arguments = started.name, scan.text  # the scan only reads objects
        else:
            name = value.get(fmt.name_key)
            arguments = _arguments_text(scan, value.get(fmt.arguments_key), fmt.arguments_key)
            if not isinstance(name, str) or not name:
                self._malformed(events, self._raw, f"no {fmt.name_key!r} string")
                return
            if arguments is None:
                self._malformed(events, self._raw, f"{fmt.arguments_key!r} is not a JSON object")
                return
            if self._started is None:
                model_id = value.get(fmt.id_key) if fmt.id_key is not None else None
                self._start(events, name, model_id if isinstance(model_id, str) else None)
            started = self._started
            assert started is not None
        if self._arguments_sent == 0:
            events.append(ToolCallArgumentsPiece(index=started.index, text=arguments))
        call = ToolCall(id=started.id, name=name, arguments=arguments)
        events.append(ToolCallEnd(index=started.index, call=call))
        self._started = None
        self._args_only = False
        self._raw = ""
        self._state = _State.BETWEEN

    def _step_between(self, events: list[ToolCallEvent]) -> bool:
        text = self._pending.lstrip(_WHITESPACE)
        if not text:
            self._pending = ""
            return False
        fmt = self._fmt
        if self._in_list:
            if text[0] == ",":
                self._pending = text[1:]
                self._state = _State.OPENING
                return True
            if text[0] == "]":
                text = text[1:]
                self._in_list = False
        elif fmt.bare_json_start and text[0] in ";{":
            # llama writes several calls as `{...}; {...}`
            self._pending = text.lstrip(";")
            self._raw = text[: len(text) - len(self._pending)]
            self._state = _State.OPENING
            return True
        if fmt.suffix.strip():
            suffix = fmt.suffix.strip()
            if text.startswith(suffix):
                text = text[len(suffix) :]
            elif suffix.startswith(text):
                self._pending = text
                return False  # the suffix may be arriving
        self._pending = text
        self._in_list = False
        self._after_call = True
        self._state = _State.TEXT
        return True

    def _malformed(self, events: list[ToolCallEvent], raw: str, reason: str) -> None:
        logger.warning(
            f"model wrote a malformed {self._fmt.family} tool call ({reason}); "
            f"returned as text: {raw[:200]!r}"
        )
        if self._started is not None:
            events.append(ToolCallAbandoned(index=self._started.index))
            self._started = None
        self._emit_text(events, raw)
        self._raw = ""
        self._in_list = False
        self._args_only = False
        self._state = _State.TEXT

    def _emit_text(self, events: list[ToolCallEvent], text: str) -> None:
        if text:
            self._seen_text = self._seen_text or bool(text.strip(_WHITESPACE))
            events.append(TextPiece(text=text))


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a marker could continue."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def _string_value(scan: CallJsonScan, key: str | None) -> str | None:
    span = scan.spans.get(key) if key is not None else None
    if span is None or span[1] is None or scan.text[span[0]] != '"':
        return None
    try:
        value = json.loads(scan.text[span[0] : span[1]])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) and value else None


def _arguments_text(scan: CallJsonScan, value: object, key: str) -> str | None:
    """The arguments as JSON object text: the object as the model wrote it; an
    object encoded in a string, decoded; absent or null, `{}`. None if invalid."""
    if isinstance(value, dict):
        start, end = scan.spans[key]
        return scan.text[start:end]
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return None
        return json.dumps(decoded, ensure_ascii=False) if isinstance(decoded, dict) else None
    return None


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> ParsedReply:
    """A whole reply at once: its content and its calls."""
    parser = ToolCallParser(fmt)
    events = [*parser.feed(text), *parser.finish()]
    return ParsedReply(
        content="".join(e.text for e in events if isinstance(e, TextPiece)),
        tool_calls=tuple(e.call for e in events if isinstance(e, ToolCallEnd)),
    )
