"""Split a reasoning model's output into its thinking and its answer, streaming.

A reasoning model writes its thinking between two markers, then the answer:
`<think>\\n…\\n</think>\\n\\nanswer`. Some templates open the thinking
themselves at the end of the prompt (QwQ, DeepSeek-R1 end the generation
prompt with `<think>\\n`), so the output starts inside it and shows only the
closing marker. Which markers a model uses comes from its chat template; where
the output starts, from the rendered prompt.

Thinking is recognised only at the start of the output, and once: a marker
later in the answer is the answer's text. The newlines around the markers are
the template's framing (it writes them back when it renders the turn), so the
reasoning and the answer come out without them. The answer then goes through
the tool-call parser.
"""

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.types.frozen import FrozenModel

_WHITESPACE = " \t\r\n"


class ThinkingMarkers(FrozenModel):
    start: str
    end: str


# The pairs reasoning models' templates use (the same list mlx-lm recognises).
KNOWN_THINKING_MARKERS = (
    ThinkingMarkers(start="<think>", end="</think>"),
    ThinkingMarkers(start="<longcat_think>", end="</longcat_think>"),
    ThinkingMarkers(start="<|think:start|>", end="<|think:end|>"),
)


def detect_thinking_markers(chat_template: str | None) -> ThinkingMarkers | None:
    """The thinking markers a chat template writes, or None for a model that does not think."""
    for markers in KNOWN_THINKING_MARKERS:
        if chat_template and markers.end in chat_template:
            return markers
    return None


def prompt_opens_thinking(prompt: str, markers: ThinkingMarkers) -> bool:
    """Whether the rendered prompt leaves the output inside the thinking: it
    ends with the start marker (and whitespace), as QwQ's generation prompt does."""
    return prompt.rstrip(_WHITESPACE).endswith(markers.start)


class ReasoningPiece(FrozenModel):
    kind: Literal["reasoning"] = "reasoning"
    text: str


class ContentPiece(FrozenModel):
    kind: Literal["content"] = "content"
    text: str


ReasoningEvent = Annotated[ReasoningPiece | ContentPiece, Field(discriminator="kind")]

_Phase = Literal["opening", "thinking", "answer_start", "answer"]


class ReasoningSplitter:
    """Feed output deltas; get reasoning and content pieces.

    Held back only what could still be a marker, and whitespace that may turn
    out to be the framing around one.
    """

    def __init__(self, markers: ThinkingMarkers, starts_inside: bool) -> None:
        self._markers = markers
        # "opening": the output may start with the start marker (when the prompt
        # opened the thinking, a repeated marker there is swallowed).
        self._phase: _Phase = "opening"
        self._starts_inside = starts_inside
        self._pending = ""
        self._reasoning_started = False

    def feed(self, delta: str) -> list[ReasoningEvent]:
        self._pending += delta
        events: list[ReasoningEvent] = []
        while self._pending and self._step(events):
            pass
        return events

    def finish(self) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        text, self._pending = self._pending, ""
        match self._phase:
            case "opening":
                if self._starts_inside:
                    self._reasoning(events, text.strip(_WHITESPACE))
                else:
                    events.extend(_content(text))
            case "thinking":
                # cut off while thinking: no answer; a partial end marker is dropped
                self._reasoning(events, text[: len(text) - self._partial_end(text)].rstrip())
            case "answer_start":
                pass  # only the whitespace after the end marker was left
            case "answer":
                events.extend(_content(text))
        return events

    def _step(self, events: list[ReasoningEvent]) -> bool:
        match self._phase:
            case "opening":
                return self._step_opening(events)
            case "thinking":
                return self._step_thinking(events)
            case "answer_start":
                self._pending = self._pending.lstrip(_WHITESPACE)
                if self._pending:
                    self._phase = "answer"
                return bool(self._pending)
            case "answer":
                events.extend(_content(self._pending))
                self._pending = ""
                return False

    def _step_opening(self, events: list[ReasoningEvent]) -> bool:
        text = self._pending.lstrip(_WHITESPACE)
        start = self._markers.start
        if text.startswith(start):
            self._pending = text[len(start) :]
            self._phase = "thinking"
            return True
        if start.startswith(text):
            return False  # empty, or the start marker still arriving
        self._phase = "thinking" if self._starts_inside else "answer"
        return True

    def _step_thinking(self, events: list[ReasoningEvent]) -> bool:
        text = self._pending
        if not self._reasoning_started:
            text = text.lstrip(_WHITESPACE)
        end = self._markers.end
        at = text.find(end)
        if at >= 0:
            self._reasoning(events, text[:at].rstrip(_WHITESPACE))
            self._pending = text[at + len(end) :]
            self._phase = "answer_start"
            return True
        hold = self._partial_end(text)
        sendable = text[: len(text) - hold].rstrip(_WHITESPACE)
        self._reasoning(events, sendable)
        self._pending = text[len(sendable) :]
        return False

    def _partial_end(self, text: str) -> int:
        end = self._markers.end
        for k in range(min(len(end) - 1, len(text)), 0, -1):
            if text.endswith(end[:k]):
                return k
        return 0

    def _reasoning(self, events: list[ReasoningEvent], text: str) -> None:
        if text:
            self._reasoning_started = True
            events.append(ReasoningPiece(text=text))


def _content(text: str) -> list[ReasoningEvent]:
    return [ContentPiece(text=text)] if text else []
