"""Tool calls for models whose chat template has no tool support.

exo then teaches the model one fixed format in the system prompt and renders
the conversation's calls and results as plain text in that same format. The
format is the Hermes syntax that many models were trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- The tools are listed in the system prompt, one JSON object per line, with
  every schema's keys sorted, so the same tools always render to the same text
  (and the same cached tokens), whatever order a client sends keys in.
- Several calls are several such blocks, one per line. Text before the first
  block is the reply's content, separated from it by one newline.
- An assistant turn's calls are rendered exactly as the model is asked to write
  them, with the arguments' text as the model wrote it (the parser keeps it), so
  a call the model wrote in this form renders back to the same tokens and the
  next turn's prompt extends the cached one.
- A tool result is a user turn holding one block per result:

      <tool_response name="get_weather" id="call_…">
      18°C, clear
      </tool_response>

  Consecutive results share one user turn, so the roles still alternate for
  templates that insist on it.
"""

import json
from collections.abc import Sequence
from typing import Any

from exo.engine.tool_calls.formats import FALLBACK_FORMAT, render_tool_calls
from exo.shared.types.chat import ChatTurn, ToolCall, ToolChoice, ToolFunction


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


def render_tool_list(tools: Sequence[ToolFunction]) -> str:
    lines = []
    for tool in tools:
        entry = {"name": tool.name, "description": tool.description}
        entry["parameters"] = _sorted_keys(tool.parameters)
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "\n".join(lines)


def render_fallback_system_prompt(tools: Sequence[ToolFunction]) -> str:
    """The system-prompt section that lists the tools and teaches the call format.

    It does not depend on `tool_choice`: a client that forces a call on one turn
    and not on the next keeps the same prompt prefix (and its cache); a forced
    call is enforced by the runner's grammar, not asked for in words."""
    example = render_tool_calls(
        FALLBACK_FORMAT,
        [ToolCall(id="", name="<function-name>", arguments="<arguments-json-object>")],
    ).replace('"<function-name>"', "<function-name>")
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query. "
        "The functions are listed below, one JSON object per line, "
        "with their parameters as JSON schema:\n"
        f"<tools>\n{render_tool_list(tools)}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments "
        "within <tool_call></tool_call> tags, exactly like this:\n"
        f"{example}\n"
        "Write one such block per call. The results come back in "
        "<tool_response></tool_response> tags. "
        "Call a function only when it helps; otherwise answer in plain text."
    )


def render_fallback_assistant(content: str, calls: Sequence[ToolCall]) -> str:
    """An assistant turn with calls, as the model is asked to write it."""
    if not calls:
        return content
    rendered = render_tool_calls(FALLBACK_FORMAT, calls)
    return f"{content}\n{rendered}" if content else rendered


def render_fallback_tool_result(name: str, call_id: str, content: str) -> str:
    return f'<tool_response name="{name}" id="{call_id}">\n{content}\n</tool_response>'


def fallback_chat_turns(
    turns: Sequence[ChatTurn], tools: Sequence[ToolFunction], tool_choice: ToolChoice
) -> list[ChatTurn]:
    """The conversation as a template without tool support can render it: the
    tool section joined to the system prompt (none when `tool_choice` is
    "none" or there are no tools), calls as assistant text, results as user turns."""
    names = {call.id: call.name for turn in turns for call in turn.tool_calls}
    out: list[ChatTurn] = []
    if tools and tool_choice != "none":
        section = render_fallback_system_prompt(tools)
        if turns and turns[0].role == "system":
            first = turns[0]
            out.append(first.model_copy(update={"content": f"{first.content}\n\n{section}"}))
            turns = turns[1:]
        else:
            out.append(ChatTurn(role="system", content=section))
    previous_role = None
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            content = render_fallback_assistant(turn.content, turn.tool_calls)
            out.append(turn.model_copy(update={"content": content, "tool_calls": ()}))
        elif turn.role == "tool":
            call_id = turn.tool_call_id or ""
            name = turn.name or names.get(call_id, "")
            block = render_fallback_tool_result(name, call_id, turn.content)
            if previous_role == "tool":
                out[-1] = out[-1].model_copy(update={"content": f"{out[-1].content}\n{block}"})
            else:
                out.append(ChatTurn(role="user", content=block))
        else:
            out.append(turn)
        previous_role = turn.role
    return out
