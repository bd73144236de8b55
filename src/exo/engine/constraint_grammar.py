"""The grammar a `Constraint` stands for, in llguidance's Lark dialect, and a
cheap check that llguidance can compile it.

Text only: no tokenizer and no MLX, so the API process can refuse a schema the
runner could not compile (a 400 naming the problem) before any work is queued;
the runner builds the same grammar with its tokenizer's special tokens.

Shapes, for a JSON schema S and tool calls in a family's markers:

    json_schema / json_object   start: %json S
    tool_calls                  start: block | start: block (SEP block)*   (parallel)
                                block: <prefix> call <suffix>
                                list_form: <prefix> "[" call (", " call)* "]" <suffix>
                                call: call_0 | call_1 | ...
                                call_i: "{\"name\": \"<tool i>\", \"arguments\": " %json P_i "}"

Each tool's argument schema is the top level of its own `%json`, so its
`$ref`s resolve against itself, as its author wrote them. The call envelope is
fixed text, formatted as the families' templates show it (Python's `json.dumps`
style). Generation ends after the grammar: the matcher then allows only EOS.
"""

import json
import re
from collections.abc import Mapping
from typing import Any

import llguidance
from loguru import logger

from exo.shared.types.constraints import Constraint, JsonObject, JsonSchema, ToolCalls, ToolSpec

# JSON whitespace: any of the usual forms (compact, `json.dumps`, indented),
# but at most 16 characters at each place, so a model cannot loop on newlines.
_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,16}"
# Between parallel calls (`</tool_call>\n<tool_call>`).
_CALL_SEPARATOR = r"/[\x20\x0A]{1,2}/"
# llguidance reports "at LINE(COLUMN): message", then the grammar's lines around it.
_ERROR_LOCATION = re.compile(r"^at \d+\(\d+\): ")
_ERROR_EXCERPT = re.compile(r"\n\s*\d+ \| ")


class ConstraintError(ValueError):
    """The constraint cannot be enforced: its message names the problem."""


def constraint_grammar(constraint: Constraint, special_tokens: Mapping[str, int] = {}) -> str:
    """The Lark grammar (llguidance dialect) of the texts `constraint` admits.

    `special_tokens` (text -> id) are the tokenizer's special tokens: where a
    marker contains one, the grammar asks for that token, not its spelling."""
    match constraint:
        case JsonObject():
            return f"start: {_json({'type': 'object'}, strict=True)}\n"
        case JsonSchema(json_schema=schema, strict=strict):
            return f"start: {_json(schema, strict)}\n"
        case ToolCalls():
            return _tool_calls_grammar(constraint, special_tokens)


def check_constraint(constraint: Constraint) -> None:
    """Raise `ConstraintError` unless llguidance compiles the constraint's
    grammar (about a millisecond for typical schemas; no tokenizer needed)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        constraint_grammar(constraint)
    )
    if is_error:
        raise ConstraintError(describe_grammar_error(constraint, messages[0]))
    for message in messages:
        logger.debug(f"constraint {constraint.kind}: ignored by the grammar: {message}")


def describe_grammar_error(constraint: Constraint, message: str) -> str:
    """A user-facing account of llguidance's `message` about `constraint`'s grammar:
    which part failed (the schema, or which tool's parameters), and why."""
    match constraint:
        case JsonObject():
            return f"json_object grammar: {_error_reason(message)}"
        case JsonSchema():
            return f"json_schema: {_error_reason(message)}"
        case ToolCalls():
            for tool in constraint.tools:
                is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                    f"start: {_json(tool.parameters, tool.strict)}\n"
                )
                if is_error:
                    return f"parameters of tool {tool.name!r}: {_error_reason(messages[0])}"
            return f"tool-call grammar: {_error_reason(message)}"


def _error_reason(message: str) -> str:
    excerpt = _ERROR_EXCERPT.search(message)
    reason = message[: excerpt.start()] if excerpt else message
    return _ERROR_LOCATION.sub("", reason.strip())


def _json(schema: Mapping[str, Any], strict: bool) -> str:
    # Our whitespace rule first: a schema's own `x-guidance` options win.
    options = {"whitespace_pattern": _JSON_WHITESPACE, "lenient": not strict}
    own = schema.get("x-guidance")
    if isinstance(own, Mapping):
        options |= own
    return "%json " + json.dumps({**schema, "x-guidance": options})


def _tool_calls_grammar(constraint: ToolCalls, special_tokens: Mapping[str, int]) -> str:
    tools = [t for t in constraint.tools if constraint.named in (None, t.name)]
    prefix = _markers(constraint.prefix, special_tokens)
    suffix = _markers(constraint.suffix, special_tokens)
    if constraint.list_form:
        calls = '"[" call (", " call)* "]"' if constraint.parallel else '"[" call "]"'
        rules = [f"start: {_sequence(prefix, calls, suffix)}"]
    else:
        start = f"block ({_CALL_SEPARATOR} block)*" if constraint.parallel else "block"
        rules = [f"start: {start}", f"block: {_sequence(prefix, 'call', suffix)}"]
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    rules.extend(
        f"call_{i}: {_call(tool, constraint.arguments_key)}" for i, tool in enumerate(tools)
    )
    return "\n".join(rules) + "\n"


def _call(tool: ToolSpec, arguments_key: str) -> str:
    opening = f'{{"name": {json.dumps(tool.name)}, {json.dumps(arguments_key)}: '
    return f'{_literal(opening)} {_json(tool.parameters, tool.strict)} "}}"'


def _markers(text: str, special_tokens: Mapping[str, int]) -> str:
    """`text` as grammar items: special tokens by id, the rest as literal text."""
    if not text:
        return ""
    names = sorted((t for t in special_tokens if t and t in text), key=len, reverse=True)
    if not names:
        return _literal(text)
    items: list[str] = []
    for piece in re.split("(" + "|".join(map(re.escape, names)) + ")", text):
        if piece in special_tokens:
            items.append(f"<[{special_tokens[piece]}]>")
        elif piece:
            items.append(_literal(piece))
    return " ".join(items)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _sequence(*items: str) -> str:
    return " ".join(item for item in items if item)
