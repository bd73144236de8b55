"""Checks the three API request modules (OpenAI chat and completions,
Anthropic Messages, OpenAI Responses) share: how an unsupported value is
reported, and the checks on raw JSON and on tools that read the same in each."""

from collections.abc import Iterable, Iterator
from typing import Any

from pydantic_core import PydanticCustomError


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
