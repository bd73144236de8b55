"""What every API adapter consumes: one reply as a stream of events.

The generation service (below the adapters) renders the prompt, runs the task
on a runner and reads the output through `engine.reply.ReplyParser`, so the
adapters (OpenAI chat/completions, Anthropic Messages, Responses) only turn
these events into their own wire format:

    ReasoningPiece* / TextPiece* / ToolCallStart, ToolCallArgumentsPiece*, ToolCallEnd
    (in any interleaving the model produced; a ToolCallAbandoned follows a start
    whose call turned out malformed, and its raw text then comes as TextPiece)
    TokenLogprobs*   (only when the request asked for logprobs)
    KeepAlive*       (whenever nothing came for a while, e.g. a long prefill)
    ReplyFinished    (always last: why it stopped, usage, the complete calls)
"""

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from exo.engine.reasoning import ReasoningPiece
from exo.engine.tool_calls.parser import (
    TextPiece,
    ToolCallAbandoned,
    ToolCallArgumentsPiece,
    ToolCallEnd,
    ToolCallStart,
)
from exo.shared.types.chat import ToolCall
from exo.shared.types.frozen import FrozenModel
from exo.shared.types.tasks import Usage

# "stop": end of turn or EOS; "stop_sequence": one of the request's stop strings
# (`stop_sequence` says which); "length": max_tokens or the context ran out;
# "tool_calls": the reply ends with one or more complete tool calls.
ReplyFinishReason = Literal["stop", "stop_sequence", "length", "tool_calls"]


class TopLogprob(FrozenModel):
    token: str
    logprob: float
    bytes: tuple[int, ...]


class TokenLogprob(FrozenModel):
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top_logprobs: tuple[TopLogprob, ...] = ()


class TokenLogprobs(FrozenModel):
    kind: Literal["logprobs"] = "logprobs"
    tokens: tuple[TokenLogprob, ...]


# What SSE streams without a keep-alive event of their own send (a comment line).
KEEPALIVE_COMMENT = ": keep-alive\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """One server-sent event named by its payload's type, as the Anthropic and
    Responses streams send them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class KeepAlive(FrozenModel):
    """Nothing came for a while (a long prefill): streams send their keep-alive."""

    kind: Literal["keep_alive"] = "keep_alive"


class ReplyFinished(FrozenModel):
    kind: Literal["finished"] = "finished"
    finish_reason: ReplyFinishReason
    stop_sequence: str | None = None
    usage: Usage
    tool_calls: tuple[ToolCall, ...] = ()
    # Of `usage.completion_tokens`, those the model spent thinking (markers included).
    reasoning_tokens: int = 0


ReplyEvent = (
    ReasoningPiece
    | TextPiece
    | ToolCallStart
    | ToolCallArgumentsPiece
    | ToolCallEnd
    | ToolCallAbandoned
    | TokenLogprobs
    | KeepAlive
    | ReplyFinished
)


@dataclass(frozen=True)
class PreparedReply:
    """A request that passed every check (4xx errors are raised before this
    exists, as `APIError`); `events` runs it. Errors during the run raise
    `APIError` (5xx) from the iterator: a streaming adapter reports them in-stream."""

    reply_id: str
    model: str  # the served model's id (what answered, whatever name the client used)
    prompt_tokens: int
    created: int
    events: AsyncIterator[ReplyEvent]
