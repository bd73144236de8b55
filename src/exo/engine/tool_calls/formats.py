"""How a model family writes tool calls, and which family a chat template speaks.

A format names the text around a call's JSON and the JSON's shape, so one
streaming parser reads every family and a grammar can force exactly one
family's syntax:

| family   | a call as the model writes it                                         |
| -------- | --------------------------------------------------------------------- |
| hermes   | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`        |
| llama3   | `{"name": "f", "parameters": {...}}` (bare, or after `<|python_tag|>`) |
| mistral  | `[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "a1b2c3d4e"}]`  |
| mistral (tokenizer v11+, e.g. Small 3.2) | `[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{...}` |
| fallback | the hermes syntax, taught by exo's own system prompt (`fallback.py`)  |
"""

import json
import re
from collections.abc import Sequence
from enum import StrEnum

from exo.shared.types.chat import ToolCall
from exo.shared.types.frozen import FrozenModel


class ToolCallFamily(StrEnum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    FALLBACK = "fallback"


class ToolCallFormat(FrozenModel):
    """The syntax of one family's tool calls.

    `prefix`/`suffix`: the exact text a well-formed call (or, in list form, the
    whole list of calls) is wrapped in, as the family's template renders it;
    a grammar forces these. `markers`: texts that open a call wherever they
    appear in the output (the parser also accepts them without the prefix's
    whitespace). `bare_json_start`: a reply that starts with `{` is a call.
    `list_form`: the calls are one JSON list after one prefix.
    `id_key`: the model writes the call's id into the call object itself.
    `args_marker`: the call is no JSON object but `prefix`, the bare name,
    (`id_marker` and the id,) `args_marker`, then the arguments object.
    `in_template`: the chat template renders tools and calls (pass `tools=` to
    it); otherwise the fallback prompt teaches this format.
    """

    family: ToolCallFamily
    prefix: str
    suffix: str
    markers: tuple[str, ...]
    bare_json_start: bool = False
    name_key: str = "name"
    arguments_key: str = "arguments"
    id_key: str | None = None
    args_marker: str | None = None
    id_marker: str | None = None
    list_form: bool = False
    in_template: bool = True


HERMES_FORMAT = ToolCallFormat(
    family=ToolCallFamily.HERMES,
    prefix="<tool_call>\n",
    suffix="\n</tool_call>",
    markers=("<tool_call>",),
)
LLAMA3_FORMAT = ToolCallFormat(
    family=ToolCallFamily.LLAMA3,
    prefix="",
    suffix="",
    markers=("<|python_tag|>",),
    bare_json_start=True,
    arguments_key="parameters",
)
MISTRAL_FORMAT = ToolCallFormat(
    family=ToolCallFamily.MISTRAL,
    prefix="[TOOL_CALLS]",
    suffix="",
    markers=("[TOOL_CALLS]",),
    id_key="id",
    list_form=True,
)
MISTRAL_ARGS_FORMAT = ToolCallFormat(
    family=ToolCallFamily.MISTRAL,
    prefix="[TOOL_CALLS]",
    suffix="",
    markers=("[TOOL_CALLS]",),
    args_marker="[ARGS]",
)
FALLBACK_FORMAT = HERMES_FORMAT.model_copy(
    update={"family": ToolCallFamily.FALLBACK, "in_template": False}
)

_USES_TOOLS = re.compile(r"\btools\b")


def detect_tool_format(chat_template: str | None) -> ToolCallFormat:
    """The format a model writes calls in, read from its chat template.

    A template that renders `tools` in a syntax not known here gets the
    fallback too: exo can parse only what it can name. So does Qwen3-Coder's
    XML-in-`<tool_call>` syntax (`<function=f><parameter=p>…`).
    """
    if not chat_template or not _USES_TOOLS.search(chat_template):
        return FALLBACK_FORMAT
    if "[TOOL_CALLS]" in chat_template and "[ARGS]" in chat_template:
        if "[CALL_ID]" in chat_template:
            return MISTRAL_ARGS_FORMAT.model_copy(update={"id_marker": "[CALL_ID]"})
        return MISTRAL_ARGS_FORMAT
    if "[TOOL_CALLS]" in chat_template:
        # Mistral 7B v0.3 renders "[TOOL_CALLS] [", Nemo "[TOOL_CALLS][".
        if "[TOOL_CALLS] [" in chat_template:
            return MISTRAL_FORMAT.model_copy(update={"prefix": "[TOOL_CALLS] "})
        return MISTRAL_FORMAT
    if "<tool_call>" in chat_template and "<function=" not in chat_template:
        return HERMES_FORMAT
    if "<|python_tag|>" in chat_template or (
        "Environment: ipython" in chat_template and '"parameters"' in chat_template
    ):
        return LLAMA3_FORMAT
    return FALLBACK_FORMAT


def render_tool_calls(fmt: ToolCallFormat, calls: Sequence[ToolCall]) -> str:
    """The calls as this format's canonical text: what the family's template
    renders and what a grammar forces. `arguments` are kept as written, so a
    call renders back to the text the model produced."""
    if fmt.args_marker is not None:
        texts = []
        for call in calls:
            id_part = f"{fmt.id_marker}{call.id}" if fmt.id_marker is not None else ""
            texts.append(f"{fmt.prefix}{call.name}{id_part}{fmt.args_marker}{call.arguments}")
        return "".join(texts) + fmt.suffix
    objects = []
    for call in calls:
        text = f'{{"{fmt.name_key}": {json.dumps(call.name, ensure_ascii=False)}, '
        text += f'"{fmt.arguments_key}": {call.arguments}'
        if fmt.id_key is not None:
            text += f', "{fmt.id_key}": {json.dumps(call.id)}'
        objects.append(text + "}")
    if fmt.list_form:
        return fmt.prefix + "[" + ", ".join(objects) + "]" + fmt.suffix
    return "\n".join(fmt.prefix + obj + fmt.suffix for obj in objects)
