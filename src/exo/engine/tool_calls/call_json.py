"""An incremental scan of one tool call's JSON object as it is generated.

It does not build values; it notes where each top-level value's text lies, so
the parser can emit a call's name as soon as that string closes and stream its
arguments' text as it arrives. The finished text is checked by `json.loads`;
the scan only has to find the object's end and reject early what can never be
a call.
"""

from dataclasses import dataclass, field
from typing import Literal

_WHITESPACE = " \t\r\n"
_OPENERS = {"{": "}", "[": "]"}

_Expect = Literal["key", "colon", "value", "scalar", "comma"]


@dataclass
class CallJsonScan:
    """Feed the object's text from its `{`; `spans[key]` = (start, end) of a
    top-level value in `text`, end `None` while it is still open. A key not in
    `allowed_keys` (when given) is an error."""

    allowed_keys: frozenset[str] | None
    text: str = ""
    spans: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    done: bool = False
    error: str | None = None
    _closers: list[str] = field(default_factory=list)
    _in_string: bool = False
    _escape: bool = False
    _expect: _Expect = "key"
    _key_start: int = 0
    _key: str = ""

    def feed(self, chunk: str) -> int:
        """Scan `chunk`; returns how many of its characters belong to the
        object (all of them unless it closed or an error was found)."""
        base = len(self.text)
        self.text += chunk
        for n, char in enumerate(chunk):
            self._step(char, base + n)
            if self.done or self.error is not None:
                self.text = self.text[: base + n + 1]
                return n + 1
        return len(chunk)

    def _step(self, char: str, at: int) -> None:
        if not self._closers:
            if char == "{":
                self._closers.append("}")
            else:
                self.error = "a call is a JSON object"
            return
        top = len(self._closers) == 1
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if top:
                    self._string_closed(at)
            return
        if char == '"':
            self._in_string = True
            if top:
                self._string_opened(at)
        elif char in _OPENERS:
            if top:
                if self._expect != "value":
                    self.error = f"unexpected {char!r}"
                    return
                self._open_value(at)
            self._closers.append(_OPENERS[char])
        elif char in "}]":
            if char != self._closers[-1]:
                self.error = f"unexpected {char!r}"
                return
            if top:
                self._close_scalar(at)
                if self._expect not in ("comma", "key"):
                    self.error = "object ends inside a member"
                    return
                self.done = True
            self._closers.pop()
            if len(self._closers) == 1:
                self.spans[self._key] = (self.spans[self._key][0], at + 1)
                self._expect = "comma"
        elif top:
            self._top_level_char(char, at)

    def _string_opened(self, at: int) -> None:
        if self._expect == "key":
            self._key_start = at
        elif self._expect == "value":
            self._open_value(at)
        else:
            self.error = "unexpected string"

    def _string_closed(self, at: int) -> None:
        if self._expect == "key":
            self._key = self.text[self._key_start + 1 : at]
            if self.allowed_keys is not None and self._key not in self.allowed_keys:
                self.error = f"unexpected key {self._key!r}"
            self._expect = "colon"
        else:
            self.spans[self._key] = (self.spans[self._key][0], at + 1)
            self._expect = "comma"

    def _open_value(self, at: int) -> None:
        if self._key in self.spans:
            self.error = f"duplicate key {self._key!r}"
        self.spans[self._key] = (at, None)
        self._expect = "scalar"

    def _close_scalar(self, at: int) -> None:
        if self._expect == "scalar" and self.spans[self._key][1] is None:
            self.spans[self._key] = (self.spans[self._key][0], at)
            self._expect = "comma"

    def _top_level_char(self, char: str, at: int) -> None:
        if char in _WHITESPACE:
            self._close_scalar(at)
        elif char == ":" and self._expect == "colon":
            self._expect = "value"
        elif char == ",":
            self._close_scalar(at)
            if self._expect != "comma":
                self.error = "unexpected ','"
            self._expect = "key"
        elif self._expect == "value":
            self._open_value(at)
        elif self._expect != "scalar":
            self.error = f"unexpected {char!r}"
