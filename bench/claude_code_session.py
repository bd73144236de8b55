"""A multi-turn Claude-Code-shaped session through `POST /v1/messages`.

Every turn re-sends the whole conversation as Claude Code does: a system prompt
whose first line is a billing header with a fresh `cch=` hash, a long fixed
instruction block, tools with JSON schemas, and a history that grows by one
assistant message of `tool_use` blocks (the server's real reply, forced with
`tool_choice`) and one user message of `tool_result` blocks per turn.

Two nodes serve the same session in one run: exo with its default flags, and
exo with the prefix cache off (`--prefix-cache-bytes 0`, every prefill cold).
Reported per turn: the prompt, the tokens an ideal cache could reuse (all of
the previous request plus its reply), what exo reused (`cache_read_input_tokens`)
and the time to the reply's first content block vs the cold node. The replies
are forced tool calls, and exo sends a `tool_use` block whole once the call is
complete, so that time is prefill plus the whole call's decode (the decode part
is the same on both nodes).

    uv run python bench/claude_code_session.py [--turns 6]
"""

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exo_node import REQUEST_TIMEOUT_SECONDS, sse_data, start_node

TOOLS = [
    {
        "name": "Read",
        "description": "Read a file from the local filesystem. " * 20,
        "input_schema": {
            "type": "object",
            "properties": {
                "file_path": {
                    "type": "string",
                    "description": "The absolute path",
                    "maxLength": 40,
                },
                "limit": {"type": "integer", "description": "Lines to read", "maximum": 2000},
            },
            "required": ["file_path"],
            "additionalProperties": False,
        },
    },
    {
        "name": "Edit",
        "description": "Replace text in a file. " * 20,
        "input_schema": {
            "type": "object",
            "properties": {
                "file_path": {"type": "string", "maxLength": 40},
                "old_string": {"type": "string", "maxLength": 40},
                "new_string": {"type": "string", "maxLength": 40},
            },
            "required": ["file_path", "old_string", "new_string"],
            "additionalProperties": False,
        },
    },
]
INSTRUCTIONS = "\n".join(
    f"- Rule {i}: read before you edit, keep changes small, and explain what changed."
    for i in range(60)
)


def request_body(cch: str, messages: list[dict[str, Any]], tool: str) -> dict[str, Any]:
    return {
        "model": "claude-opus-4-5",
        "max_tokens": 128000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch={cch};",
            },
            {
                "type": "text",
                "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": INSTRUCTIONS, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": tool},
        "messages": messages,
        "metadata": {"user_id": json.dumps({"session_id": "bench"})},
    }


@dataclass
class Turn:
    prompt: int
    reused: int
    ttft: float
    blocks: list[dict[str, Any]]
    completion: int


def send(client: httpx.Client, base_url: str, body: dict[str, Any]) -> Turn:
    usage: dict[str, int] = {}
    blocks: list[dict[str, Any]] = []
    ttft = float("nan")
    start = time.perf_counter()
    for data in sse_data(client, f"{base_url}/v1/messages", body, REQUEST_TIMEOUT_SECONDS):
        event = json.loads(data)
        kind = event["type"]
        if kind == "content_block_start" and ttft != ttft:
            ttft = time.perf_counter() - start
        if kind == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif kind == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            blocks[-1]["partial"] = blocks[-1].get("partial", "") + event["delta"]["partial_json"]
        elif kind == "message_start":
            usage |= event["message"]["usage"]
        elif kind == "message_delta":
            usage |= event["usage"]
        elif kind == "error":
            raise RuntimeError(f"stream error: {event['error']}")
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial", "{}") or "{}")
    prompt = (
        usage.get("input_tokens", 0)
        + usage.get("cache_read_input_tokens", 0)
        + usage.get("cache_creation_input_tokens", 0)
    )
    return Turn(
        prompt, usage.get("cache_read_input_tokens", 0), ttft, blocks, usage["output_tokens"]
    )


def run_session(base_url: str, turns: int, seed: int) -> list[Turn]:
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Fix the greeting in greet.py so it says hello to the user."}
    ]
    results = []
    with httpx.Client() as client:
        for turn in range(turns):
            tool = "Read" if turn % 2 == 0 else "Edit"
            cch = f"{rng.getrandbits(20):05x}"
            result = send(client, base_url, request_body(cch, messages, tool))
            results.append(result)
            uses = [b for b in result.blocks if b["type"] == "tool_use"]
            messages.append({"role": "assistant", "content": result.blocks})
            output = "\n".join(f"{i:4d}  line {i} of the file" for i in range(rng.randint(8, 16)))
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use["id"], "content": output}
                        for use in uses
                    ],
                }
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description="A Claude-Code-shaped session through /v1/messages"
    )
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    with start_node() as cached_node:
        cached = run_session(cached_node.base_url, args.turns, seed=1)
        with start_node(models_dir=cached_node.models_dir, prefix_cache_bytes=0) as cold_node:
            cold = run_session(cold_node.base_url, args.turns, seed=1)
    print(f"{'turn':>4} {'prompt':>7} {'reusable':>8} {'reused':>7} {'block':>7} {'cold':>7} ratio")
    reusable_sum = reused_sum = 0
    previous: Turn | None = None
    for index, (hot, base) in enumerate(zip(cached, cold, strict=True)):
        # An ideal cache holds the previous request and its reply.
        reusable = previous.prompt + previous.completion if previous else 0
        if previous:
            reusable_sum += reusable
            reused_sum += min(hot.reused, reusable)
        print(
            f"{index + 1:>4} {hot.prompt:>7} {reusable:>8} {hot.reused:>7} "
            f"{hot.ttft:>6.2f}s {base.ttft:>6.2f}s {hot.ttft / base.ttft:5.2f}"
        )
        previous = hot
    share = reused_sum / reusable_sum if reusable_sum else float("nan")
    later = [h.ttft / c.ttft for h, c in zip(cached[1:], cold[1:], strict=True)]
    print(f"reused {reused_sum} of {reusable_sum} reusable tokens: {share:.1%} (target >= 95%)")
    print(
        f"time to the first content block, cache / cold, turns 2..{args.turns}: "
        f"mean {sum(later) / len(later):.3f}"
    )
    return 0 if share >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
