"""One generated reply read as it streams: reasoning, text and tool calls.

The output first goes through the reasoning split (when the model thinks),
then its answer through the tool-call parser (when the request offered tools).
Every API adapter turns these events into its own deltas; none of them splits
or parses itself.
"""

from collections.abc import Callable

from exo.engine.reasoning import (
    ContentPiece,
    ReasoningPiece,
    ReasoningSplitter,
    ThinkingMarkers,
    detect_thinking_markers,
    prompt_opens_thinking,
)
from exo.engine.tool_calls.formats import ToolCallFormat
from exo.engine.tool_calls.parser import TextPiece, ToolCallEvent, ToolCallParser

ReplyEvent = ReasoningPiece | ToolCallEvent


class ReplyParser:
    def __init__(
        self,
        thinking: ThinkingMarkers | None,
        starts_inside_thinking: bool,
        tool_format: ToolCallFormat | None,
        new_call_id: Callable[[], str] | None = None,
    ) -> None:
        self._splitter = (
            ReasoningSplitter(thinking, starts_inside_thinking) if thinking is not None else None
        )
        self._tools = ToolCallParser(tool_format, new_call_id) if tool_format is not None else None

    @classmethod
    def for_prompt(
        cls,
        chat_template: str | None,
        prompt: str,
        tool_format: ToolCallFormat | None,
        new_call_id: Callable[[], str] | None = None,
    ) -> "ReplyParser":
        """For a reply to `prompt` (the rendered prompt text, or its end);
        `tool_format` None when the request offered no tools, so calls stay
        text; `new_call_id` names the calls (each API has its own id style)."""
        thinking = detect_thinking_markers(chat_template)
        inside = thinking is not None and prompt_opens_thinking(prompt, thinking)
        return cls(thinking, inside, tool_format, new_call_id)

    def feed(self, delta: str) -> list[ReplyEvent]:
        if self._splitter is None:
            return self._answer(delta)
        return self._route(self._splitter.feed(delta))

    def finish(self) -> list[ReplyEvent]:
        events = self._route(self._splitter.finish()) if self._splitter is not None else []
        if self._tools is not None:
            events.extend(self._tools.finish())
        return events

    def _route(self, pieces: list[ReasoningPiece | ContentPiece]) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        for piece in pieces:
            if isinstance(piece, ReasoningPiece):
                events.append(piece)
            else:
                events.extend(self._answer(piece.text))
        return events

    def _answer(self, text: str) -> list[ReplyEvent]:
        if self._tools is None:
            return [TextPiece(text=text)] if text else []
        return list(self._tools.feed(text))
