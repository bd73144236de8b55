"""Speculative decoding: decode tokens/s of one exo node with its drafts and
without, on workloads that copy from the prompt and one that copies nothing;
and `mlx_lm.server` on the edit workload.

One `exo` node with default flags (`--speculation prompt-lookup`) serves both
sides: "without" sends `"speculation": false` per request, so both sides share
the process and its warm state. Every request is streamed, greedy (temperature
0) with `max_tokens` (default 300) and `stream_options.include_usage`.

Workloads (the built-in SmolLM2-135M-Instruct):

* (a) edit: a ~380-token Python file (`SOURCE`) in the prompt, the model asked
  to rewrite it in full with one method renamed. With speculation, three ways:
  prompt lookup only; `prediction` = the original file (as editors use OpenAI's
  Predicted Outputs); and a copy ceiling, `prediction` = the model's own greedy
  reply (from an unmeasured warm-up without speculation), so every draft is
  right: what verification gains at best. Also `mlx_lm.server` (default flags,
  the float32 weights exo runs, OpenBLAS preloaded) on the same prompt, without
  `prediction` (it does not support it; nor prompt lookup, only a draft model).
* (a) edit, tool call: the same file, the request offers an
  `edit_file(path, old_string, new_string)` tool (`tool_choice: "required"`),
  whose arguments quote the file; prompt lookup, and `prediction` = the file.
* (b) prose: "Write a short story about a lighthouse keeper.", which copies
  nothing from its prompt; but the small model's greedy story starts repeating
  its own paragraphs after ~150 tokens, which prompt lookup drafts from. So
  also with `frequency_penalty` 0.5 (on both sides; still deterministic), which
  keeps it from repeating: text that copies nothing at all.
* (c) 4 streams at once of the edit workload (each renaming a different
  function of the file), prompt lookup and `prediction` = the file.

Speed of one stream = (completion_tokens - 1) / (time of its last content chunk
- time of its first); a tool call's argument deltas count as content chunks
(the first comes once the call's name is parsed, a dozen tokens in, on both
sides alike). Of 4 streams: the sum of their completion_tokens / (the last
stream's last chunk - the earliest first chunk). Each round runs every side of a workload back to
back, the order reversed every other round (`--rounds`, default 3); a
workload's figures are medians over the rounds, and each ratio is the median of
the rounds' own ratios (a round's runs are close in time, so the machine's
drift cancels out of them). Acceptance = accepted_draft_tokens / drafted_tokens
from `usage.completion_tokens_details`, summed over the rounds. Greedy decoding
with and without drafts must write the same text: the script checks every reply
against the warm-up's.

Targets: (a) with speculation >= 2x without and >= 2x `mlx_lm.server`; (b)
>= 0.97x without; (c) >= 1.5x the aggregate without. The copy ceiling is
reported against (a)'s targets too, but does not count towards the exit status.

    uv run python bench/speculative.py
    uv run python bench/speculative.py --quick     # 1 round, 96 tokens: a smoke run
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from exo_node import (
    MODEL_ID,
    REQUEST_TIMEOUT_SECONDS,
    CpuMeter,
    float32_copy,
    median,
    mlx_lm_server,
    runner_pid,
    sse_data,
    start_node,
)

TARGET_EDIT = 2.0  # (a): vs exo without speculation, and vs mlx_lm.server
TARGET_PROSE = 0.97  # (b): vs exo without speculation
TARGET_STREAMS = 1.5  # (c): aggregate, vs exo without speculation
STREAMS = 4
# A run counts as quiet when other processes used at most this many cores on average.
QUIET_FOREIGN_CORES = 0.15

SOURCE = """import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1


@dataclass
class Cart:
    items: list[Item] = field(default_factory=list)

    def add(self, item: Item) -> None:
        for existing in self.items:
            if existing.name == item.name:
                existing.quantity += item.quantity
                return
        self.items.append(item)

    def remove(self, name: str) -> None:
        self.items = [item for item in self.items if item.name != name]

    def total(self) -> float:
        return sum(item.price * item.quantity for item in self.items)


def load_cart(path: Path) -> Cart:
    data = json.loads(path.read_text())
    cart = Cart()
    for entry in data["items"]:
        cart.add(Item(entry["name"], float(entry["price"]), int(entry["quantity"])))
    return cart


def save_cart(cart: Cart, path: Path) -> None:
    data = {
        "items": [
            {"name": item.name, "price": item.price, "quantity": item.quantity}
            for item in cart.items
        ]
    }
    path.write_text(json.dumps(data, indent=2))


def apply_discount(cart: Cart, percent: float) -> float:
    if not 0 <= percent <= 100:
        raise ValueError("percent must be between 0 and 100")
    return cart.total() * (1 - percent / 100)
"""
# (old name, new name): the edit of (a), then the other streams' of (c).
RENAMES = [
    ("total", "subtotal"),
    ("save_cart", "write_cart"),
    ("load_cart", "read_cart"),
    ("apply_discount", "discounted_total"),
]
PROSE = "Write a short story about a lighthouse keeper."
# The greedy story repeats its paragraphs after ~150 tokens (as the small model's
# greedy prose does); with this penalty it does not, and copies nothing.
PROSE_PENALTY = 0.5
EDIT_TOOL = {
    "type": "function",
    "function": {
        "name": "edit_file",
        "description": "Replace old_string with new_string in the file at path.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "old_string": {"type": "string"},
                "new_string": {"type": "string"},
            },
            "required": ["path", "old_string", "new_string"],
        },
    },
}

Messages = list[dict[str, str]]


def edit_messages(old: str, new: str) -> Messages:
    return [
        {
            "role": "user",
            "content": f"Here is cart.py:\n\n```python\n{SOURCE}```\n\nRewrite the whole file, "
            f"renaming the function `{old}` to `{new}`. Reply with the complete file in one "
            "code block and nothing else.",
        }
    ]


def tool_messages() -> Messages:
    return [
        {
            "role": "user",
            "content": f"Here is cart.py:\n\n```python\n{SOURCE}```\n\nCall edit_file with path "
            '"cart.py", old_string the `save_cart` function as it is now, and new_string the '
            "same function renamed to `write_cart`.",
        }
    ]


def predicted(text: str) -> dict[str, Any]:
    return {"prediction": {"type": "content", "content": text}}


NO_SPECULATION: dict[str, Any] = {"speculation": False}


@dataclass
class Reply:
    """One streamed reply; times in perf_counter() seconds."""

    text: str  # content, then each tool call's name and arguments
    times: list[float]  # one per chunk with content or tool-call arguments
    usage: dict[str, Any]

    @property
    def tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0))

    def detail(self, name: str) -> int:
        return int((self.usage.get("completion_tokens_details") or {}).get(name, 0) or 0)


@dataclass
class Run:
    """A measured run: one reply, or several streamed at once."""

    replies: list[Reply]
    foreign_cores: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replies)

    @property
    def tokens_per_second(self) -> float:
        first = min(r.times[0] for r in self.replies if r.times)
        last = max(r.times[-1] for r in self.replies if r.times)
        # One stream: its tokens after the first; several: all of them.
        tokens = self.tokens - 1 if len(self.replies) == 1 else self.tokens
        return tokens / (last - first) if last > first else float("nan")

    def total(self, name: str) -> int:
        return sum(r.detail(name) for r in self.replies)

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.replies]


def stream_reply(
    client: httpx.Client,
    base_url: str,
    model: str,
    messages: Messages,
    max_tokens: int,
    **extra: Any,
) -> Reply:
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    times: list[float] = []
    usage: dict[str, Any] = {}
    url = f"{base_url}/v1/chat/completions"
    for payload in sse_data(client, url, body, REQUEST_TIMEOUT_SECONDS):
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            got = False
            if delta.get("content"):
                content.append(delta["content"])
                got = True
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                parts = calls.setdefault(int(call.get("index", 0)), [])
                if function.get("name"):
                    parts.append(f"\n[{function['name']}] ")
                if function.get("arguments"):
                    parts.append(function["arguments"])
                    got = True
            if got:
                times.append(time.perf_counter())
    text = "".join(content) + "".join("".join(calls[i]) for i in sorted(calls))
    return Reply(text, times, usage)


@dataclass(frozen=True)
class Side:
    """One way of serving a workload: a server and the request's extra fields."""

    label: str
    base_url: str
    model: str
    extra: Callable[[int], dict[str, Any]]  # per stream index
    speculates: bool = True


@dataclass
class Workload:
    label: str
    target: float
    streams: list[Messages]  # one: a single stream
    base: dict[str, Any]  # request fields of every side (tools)
    sides: list[Side] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)  # greedy texts without speculation
    runs: dict[str, list[Run]] = field(default_factory=dict)


def run(side: Side, workload: Workload, max_tokens: int) -> Run:
    """The workload's streams sent at once through `side`."""
    count = len(workload.streams)
    results: list[Reply | BaseException] = [RuntimeError("no result")] * count
    barrier = threading.Barrier(count)

    def one(index: int) -> None:
        try:
            with httpx.Client() as client:
                barrier.wait(timeout=60)
                results[index] = stream_reply(
                    client,
                    side.base_url,
                    side.model,
                    workload.streams[index],
                    max_tokens,
                    **workload.base,
                    **side.extra(index),
                )
        except BaseException as error:  # reported below
            results[index] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    replies = [r for r in results if isinstance(r, Reply)]
    if len(replies) != count:
        raise RuntimeError(f"{workload.label} / {side.label}: streams failed: {results}")
    return Run(replies)


def ratio_of_rounds(mine: list[Run], theirs: list[Run]) -> float:
    return median(
        [a.tokens_per_second / b.tokens_per_second for a, b in zip(mine, theirs, strict=True)]
    )


def acceptance(runs: list[Run]) -> str:
    drafted = sum(r.total("drafted_tokens") for r in runs)
    accepted = sum(r.total("accepted_draft_tokens") for r in runs)
    return f"{accepted}/{drafted} = {accepted / drafted:.2f}" if drafted else "0/0"


# The workloads' names for `--workloads`, in the order they run.
WORKLOADS = ("edit", "tool", "prose", "fresh", "streams")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every side")
    parser.add_argument("--max-tokens", type=int, default=300, help="max_tokens of each reply")
    parser.add_argument("--quick", action="store_true", help="1 round of 96 tokens: a smoke run")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="reuse this models folder (skips the import)"
    )
    parser.add_argument("--skip-mlx-lm", action="store_true", help="run exo only")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"which to run, of {','.join(WORKLOADS)} (the edit one always runs: the warm-up uses it)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the node's temp folder")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 1, 96

    work = Path(tempfile.mkdtemp(prefix="exo-speculative-"))
    models = args.models_dir or work / "models"
    started = time.monotonic()
    try:
        with start_node(models, keep_logs=args.keep_logs) as node, ExitStack() as stack:
            url = node.base_url
            without = Side("without", url, MODEL_ID, lambda i: NO_SPECULATION, speculates=False)
            lookup = Side("lookup", url, MODEL_ID, lambda i: {})
            with_file = Side("prediction=file", url, MODEL_ID, lambda i: predicted(SOURCE))
            edit = Workload("(a) edit", TARGET_EDIT, [edit_messages(*RENAMES[0])], {})
            tool = Workload(
                "(a) edit, tool call",
                TARGET_EDIT,
                [tool_messages()],
                {"tools": [EDIT_TOOL], "tool_choice": "required"},
            )
            story = [{"role": "user", "content": PROSE}]
            prose = Workload("(b) prose", TARGET_PROSE, [story], {})
            fresh = Workload(
                f"(b) prose, frequency_penalty {PROSE_PENALTY}",
                TARGET_PROSE,
                [story],
                {"frequency_penalty": PROSE_PENALTY},
            )
            streams = Workload(
                f"(c) {STREAMS} streams, edit",
                TARGET_STREAMS,
                [edit_messages(*RENAMES[i % len(RENAMES)]) for i in range(STREAMS)],
                {},
            )
            chosen = set(args.workloads.split(","))
            if unknown := chosen - set(WORKLOADS):
                parser.error(f"unknown workloads {sorted(unknown)}; known: {WORKLOADS}")
            everything = dict(zip(WORKLOADS, [edit, tool, prose, fresh, streams], strict=True))
            workloads = [w for key, w in everything.items() if key in chosen or w is edit]
            # Warm-up, not measured: each workload's greedy replies without speculation.
            for workload in workloads:
                workload.reference = run(without, workload, args.max_tokens).texts
            run(lookup, edit, 32)
            ceiling = Side("copy ceiling", url, MODEL_ID, lambda i: predicted(edit.reference[i]))
            edit.sides = [without, lookup, with_file, ceiling]
            tool.sides = [without, lookup, with_file]
            prose.sides = [without, lookup]
            fresh.sides = [without, lookup]
            streams.sides = [without, lookup, with_file]
            processes = {"client": os.getpid(), "node": node.process.pid}
            if (pid := runner_pid(node)) is not None:
                processes["runner"] = pid
            mlx_text: list[str] = []
            if not args.skip_mlx_lm:
                fp32 = float32_copy(node.model_dir, work / "float32")
                mlx_url, mlx_pid = stack.enter_context(mlx_lm_server(fp32, work))
                processes["mlx_lm.server"] = mlx_pid
                mlx = Side("mlx_lm.server", mlx_url, str(fp32), lambda i: {}, speculates=False)
                mlx_text = run(mlx, edit, 8).texts  # warm-up
                mlx_text = run(mlx, edit, args.max_tokens).texts
                edit.sides.append(mlx)
            meter = CpuMeter(processes)
            print(f"warm-up done after {time.monotonic() - started:.0f}s")

            for index in range(1, args.rounds + 1):
                for workload in workloads:
                    sides = workload.sides if index % 2 else workload.sides[::-1]
                    for side in sides:
                        meter.start()
                        result = run(side, workload, args.max_tokens)
                        result.foreign_cores = meter.stop().foreign_cores
                        workload.runs.setdefault(side.label, []).append(result)
                        reference = (
                            mlx_text if side.label == "mlx_lm.server" else workload.reference
                        )
                        prediction = (
                            f", prediction accepted/rejected "
                            f"{result.total('accepted_prediction_tokens')}/"
                            f"{result.total('rejected_prediction_tokens')}"
                            if "prediction" in side.label or "ceiling" in side.label
                            else ""
                        )
                        print(
                            f"round {index} {workload.label} / {side.label}: {result.tokens} tokens, "
                            f"{result.tokens_per_second:6.2f} tok/s, drafted "
                            f"{result.total('drafted_tokens')}, accepted "
                            f"{result.total('accepted_draft_tokens')}{prediction}, same text "
                            f"{result.texts == reference}, other processes "
                            f"{result.foreign_cores:.2f} cores"
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"{args.rounds} round(s), max_tokens {args.max_tokens}, greedy; medians over the rounds; "
        f"ratios: median of each round's ratio"
    )
    if mlx_text:
        print(
            f"mlx_lm.server writes the same text as exo on (a) edit: {mlx_text == edit.reference}"
        )
    print(
        "| workload | exo without speculation tok/s | exo with speculation tok/s | with/without "
        "| acceptance (accepted/drafted) | same output | mlx_lm.server tok/s "
        "| with/mlx_lm.server | target |"
    )
    print("| --- " * 9 + "|")
    met = True
    identical = True
    for workload in workloads:
        base = workload.runs["without"]
        identical = identical and all(r.texts == workload.reference for r in base)
        theirs = workload.runs.get("mlx_lm.server")
        for side in workload.sides:
            if not side.speculates:
                continue
            mine = workload.runs[side.label]
            same = all(r.texts == workload.reference for r in mine)
            identical = identical and same
            ratio = ratio_of_rounds(mine, base)
            ok = ratio >= workload.target
            mlx_cells = "| — | — "
            target = f">= {workload.target}x without"
            if theirs:
                versus = ratio_of_rounds(mine, theirs)
                mlx_cells = (
                    f"| {median([r.tokens_per_second for r in theirs]):.2f} | {versus:.2f}x "
                )
                ok = ok and versus >= TARGET_EDIT
                target += f", >= {TARGET_EDIT}x mlx_lm.server"
            ceiling_row = side.label == "copy ceiling"
            if not ceiling_row:
                met = met and ok
            verdict = ("met" if ok else "MISSED") + (
                " (ceiling: not counted)" if ceiling_row else ""
            )
            print(
                f"| {workload.label}, {side.label} "
                f"| {median([r.tokens_per_second for r in base]):.2f} "
                f"| {median([r.tokens_per_second for r in mine]):.2f} | {ratio:.2f}x "
                f"| {acceptance(mine)} | {'yes' if same else 'NO'} {mlx_cells}"
                f"| {target}: {verdict} |"
            )
    print(f"replies identical with and without speculation: {identical}")
    foreign = [r.foreign_cores for w in workloads for runs in w.runs.values() for r in runs]
    busy = sum(cores > QUIET_FOREIGN_CORES for cores in foreign)
    print(
        f"other processes during the runs: median {median(foreign):.2f} cores, max "
        f"{max(foreign, default=0.0):.2f}; {busy} of {len(foreign)} runs above "
        f"{QUIET_FOREIGN_CORES} cores"
    )
    print(f"targets {'met' if met else 'MISSED'}; wall time {time.monotonic() - started:.0f}s")
    return 0 if met and identical else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
