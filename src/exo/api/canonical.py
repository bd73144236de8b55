"""Volatile parts of a request, removed before the prompt is rendered.

Some clients put text into the prompt that changes on every request without
changing its meaning. Ahead of a long, otherwise fixed prompt it defeats the
prefix cache: Claude Code starts its system prompt with a billing header whose
`cch=` hash is new each time, in front of ~20k tokens of tools and instructions.
Every such pattern is listed in `VOLATILE_PATTERNS`, in one place, and nothing
else of a request is altered.

Tool schemas need no canonical key order: the chat template renders a schema
with its keys in the order the client sent them (`tojson` keeps insertion
order), and a client sends its tools the same way on every request. Sorting
them would only reorder what the model reads (e.g. the order in which it writes
the arguments).
"""

import re

from exo.shared.types.chat import ChatRequest
from exo.shared.types.frozen import FrozenModel


class VolatilePattern(FrozenModel):
    """Text matching `regex` in the system turns is removed."""

    name: str
    regex: str  # multiline: `^` and `$` are line boundaries
    why: str


VOLATILE_PATTERNS = (
    VolatilePattern(
        name="anthropic-billing-header",
        # The whole line with its line break: `cc_version=…; cc_entrypoint=…; cch=…;`
        regex=r"^x-anthropic-billing-header:[^\n]*(?:\n|\Z)",
        why="Claude Code's per-request hash (cch=) in front of its system prompt",
    ),
)

_COMPILED = tuple(re.compile(pattern.regex, re.MULTILINE) for pattern in VOLATILE_PATTERNS)


def canonical_system_text(text: str) -> str:
    for pattern in _COMPILED:
        text = pattern.sub("", text)
    return text


def canonical_request(request: ChatRequest) -> ChatRequest:
    """`request` with the volatile patterns removed from its system turns."""
    turns = tuple(
        turn.model_copy(update={"content": canonical_system_text(turn.content)})
        if turn.role == "system"
        else turn
        for turn in request.turns
    )
    if turns == request.turns:
        return request
    return request.model_copy(update={"turns": turns})
