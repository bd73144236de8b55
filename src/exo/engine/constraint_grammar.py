"""The grammar a `Constraint` stands for, in llguidance's Lark dialect, and a
cheap check that llguidance can compile it.

Text only: no tokenizer and no MLX, so the API process can refuse a schema the
runner could not compile (a 400 naming the problem) before any work is queued;
the runner builds the same grammar with its tokenizer's special tokens.

Shapes, for a JSON schema S and tool calls in a family's markers:

    json_schema / json_object   start: %json S
    tool_calls                  start: <prefix> call <suffix> (SEP block)*
                                block: <prefix> call <suffix>   (SEP block: parallel only)
                                list_form: <prefix> "[" call (", " call)* "]" <suffix>
                                call: call_0 | call_1 | ...
                                call_i: "{\"name\": \"<tool i>\", \"arguments\": " %json P_i "}"
    tool_calls, text allowed    start: TEXT? | LEAD <prefix after the marker> call <suffix> ...
                                TEXT: any text holding no marker (and, for bare-JSON
                                      families, not opening with `{`)
                                LEAD: such text, then one marker, ending there

A marker that is a special token ends TEXT by itself (no text lexeme can hold
one), so there the call branch is `TEXT? <[id]> ...`. A marker spelled as text
is the end of the LEAD lexeme instead: llguidance's lexer does not backtrack,
so a separate text lexeme would swallow the marker's first characters.

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

_WHITESPACE_CLASS = r"[\x20\x0A\x0D\x09]"
# JSON whitespace: any of the usual forms (compact, `json.dumps`, indented),
# but at most 16 characters at each place, so a model cannot loop on newlines.
_JSON_WHITESPACE = _WHITESPACE_CLASS + "{1,16}"
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
    rules: list[str] = []
    if constraint.list_form:
        calls = '"[" call (", " call)* "]"' if constraint.parallel else '"[" call "]"'
        first, more = _sequence(calls, suffix), ""
    else:
        first = _sequence("call", suffix)
        more = ""
        if constraint.parallel:
            more = f" ({_CALL_SEPARATOR} block)*"
            rules.append(f"block: {_sequence(prefix, 'call', suffix)}")
    if constraint.text_allowed:
        rules = [*_text_or_calls(constraint, special_tokens, first, more), *rules]
    else:
        rules.insert(0, f"start: {_sequence(prefix, first)}{more}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    rules.extend(
        f"call_{i}: {_call(tool, constraint.arguments_key)}" for i, tool in enumerate(tools)
    )
    return "\n".join(rules) + "\n"


def _text_or_calls(
    constraint: ToolCalls, special_tokens: Mapping[str, int], first: str, more: str
) -> list[str]:
    """The `start` rule and lexemes of a reply that is text, or text then calls
    (`first` is the first call after its prefix, `more` the calls after it)."""
    markers = [m for m in constraint.markers if m]
    branches = ["TEXT?"]
    lexemes = [_text_lexeme("TEXT: /(?s:.+)/", markers, constraint), "ANY_TEXT: /(?s:.*)/"]
    if constraint.bare_json_start:
        branches.append(f"/{_WHITESPACE_CLASS}+/? {first}{more}")
    for n, marker in enumerate(markers):
        if constraint.prefix and not constraint.prefix.startswith(marker):
            continue  # a call after this marker would lack the prefix
        after = _markers(constraint.prefix[len(marker) :], special_tokens)
        if marker in special_tokens:
            opening = f"TEXT? <[{special_tokens[marker]}]>"
        else:
            # The text up to the marker's first occurrence, the marker included.
            spelled = _literal(marker)
            opening = f"LEAD_{n}"
            lead = f"LEAD_{n}: (ANY_TEXT {spelled}) & ~(ANY_TEXT {spelled} /(?s:.+)/)"
            others = [m for m in markers if m != marker]
            lexemes.append(_text_lexeme(lead, others, constraint))
        branches.append(f"{_sequence(opening, after, first)}{more}")
    return ["start: " + " | ".join(branches), *lexemes]


def _text_lexeme(rule: str, markers: list[str], constraint: ToolCalls) -> str:
    """`rule`, less the texts the parser would read a call in: any of `markers`,
    and for bare-JSON families a `{` opening the reply."""
    excluded = [f"~(ANY_TEXT {_literal(m)} ANY_TEXT)" for m in markers]
    if constraint.bare_json_start:
        excluded.append(f'~(/{_WHITESPACE_CLASS}*/ "{{" ANY_TEXT)')
    return " & ".join([rule, *excluded])


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
