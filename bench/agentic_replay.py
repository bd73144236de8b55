"""Multi-session agentic replay: what the prefix cache saves when many coding
sessions share one system prompt and are served round-robin.

Each of N sessions starts with the same system prompt and its own task, then for
each later turn sends a tool result (a file listing, a test log) after the
server's real reply. Sessions take turns: session 1 turn 1, session 2 turn 1, …,
session N turn 1, session 1 turn 2, … Every request is greedy and streamed.

Run against exo (default flags) and then against `mlx_lm.server` (default flags,
the same weights as float32, OpenBLAS preloaded like exo's runners), one after
the other on the same machine, and reports:

* prefilled tokens: exo's (`prompt_tokens - cached_tokens` per request) against
  an ideal cache that keeps every prompt and reply it has seen (computed from
  the token ids of the rendered conversations): target <= 1.05x;
* the TTFT sum: exo's against `mlx_lm.server`'s: target <= 0.75x.

    uv run python bench/agentic_replay.py
"""

import argparse
import os
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from exo_node import float32_copy, mlx_lm_server, start_node, stream_chat
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from exo.engine.token_trie import common_prefix_length

TARGET_PREFILL_RATIO = 1.05
TARGET_TTFT_RATIO = 0.75
READY_TIMEOUT_SECONDS = 300.0

_FILES = ("parser", "router", "cache", "scheduler", "store", "codec", "client", "auth")
_WORDS = (
    "returns", "raises", "buffers", "retries", "validates", "streams", "batches",
    "indexes", "merges", "splits", "caches", "locks", "yields", "parses",
)  # fmt: skip

Message = dict[str, str]


def _code_line(rng: random.Random, index: int) -> str:
    name = rng.choice(_FILES)
    return (
        f"{index:4d}  def {rng.choice(_WORDS)}_{name}_{rng.randint(1, 99)}(self, n: int) -> int:"
        f"  # {rng.choice(_WORDS)} {rng.randint(2, 4096)} items"
    )


def _text(tokenizer: PreTrainedTokenizerBase, rng: random.Random, header: str, tokens: int) -> str:
    """`header`, then numbered code lines until about `tokens` tokens in all."""
    lines = [header]
    index = 1
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < tokens:
        lines.append(_code_line(rng, index))
        index += 1
    return "\n".join(lines)


@dataclass
class Workload:
    system: str
    tasks: list[str]  # per session: its first user message
    tool_results: list[list[str]]  # per session: one per later turn


def make_workload(
    tokenizer: PreTrainedTokenizerBase,
    sessions: int,
    turns: int,
    system_tokens: int,
    tool_tokens: tuple[int, int],
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    system = _text(
        tokenizer,
        rng,
        "You are a coding agent. Read the tool results, then answer with the next step "
        "in one short sentence. Project conventions follow.",
        system_tokens,
    )
    tasks = [
        f"Session {s}: the test for {rng.choice(_FILES)}.py fails with an off-by-one error "
        f"when n is {rng.randint(2, 500)}. Find the cause."
        for s in range(sessions)
    ]
    results = [
        [
            _text(
                tokenizer,
                rng,
                f"Tool result (read_file {rng.choice(_FILES)}_{s}_{t}.py):",
                rng.randint(*tool_tokens),
            )
            for t in range(1, turns)
        ]
        for s in range(sessions)
    ]
    return Workload(system, tasks, results)


@dataclass
class Request:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ideal_cached: int
    ttft: float


@dataclass
class Replay:
    requests: list[Request] = field(default_factory=list)

    @property
    def prefilled(self) -> int:
        return sum(r.prompt_tokens - r.cached_tokens for r in self.requests)

    @property
    def ideal_prefilled(self) -> int:
        return sum(r.prompt_tokens - r.ideal_cached for r in self.requests)

    @property
    def ttft_sum(self) -> float:
        return sum(r.ttft for r in self.requests)


class IdealCache:
    """Keeps the KV of everything a server must have computed: every prompt and, after
    it, every reply but its last token (drawn, never fed back)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.seen: list[tuple[int, ...]] = []

    def render(self, messages: list[Message], generation: bool) -> tuple[int, ...]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=False
        )
        assert isinstance(text, str)
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def cached(self, prompt: tuple[int, ...]) -> int:
        best = max((common_prefix_length(prompt, s) for s in self.seen), default=0)
        return min(best, len(prompt) - 1)

    def remember(
        self, prompt: tuple[int, ...], with_reply: tuple[int, ...], completion_tokens: int
    ) -> None:
        """`with_reply`: the conversation rendered with the reply as its last turn."""
        self.seen += [prompt, with_reply[: len(prompt) + max(completion_tokens - 1, 0)]]


def replay(
    base_url: str,
    model: str,
    workload: Workload,
    ideal: IdealCache,
    max_tokens: int,
    label: str,
) -> Replay:
    sessions = len(workload.tasks)
    turns = 1 + len(workload.tool_results[0])
    history: list[list[Message]] = [
        [{"role": "system", "content": workload.system}] for _ in range(sessions)
    ]
    result = Replay()
    with httpx.Client() as client:
        hello: list[Message] = [{"role": "user", "content": "Hi"}]
        warm = stream_chat(client, base_url, hello, 2, model=model)
        ideal.remember(ideal.render(hello, generation=True), (), 0)
        print(f"{label}: warm-up ttft {warm.ttft:.2f}s")
        for turn in range(turns):
            for s in range(sessions):
                content = workload.tasks[s] if turn == 0 else workload.tool_results[s][turn - 1]
                messages = [*history[s], {"role": "user", "content": content}]
                prompt = ideal.render(messages, generation=True)
                ideal_cached = ideal.cached(prompt)
                reply = stream_chat(client, base_url, messages, max_tokens, model=model)
                history[s] = [*messages, {"role": "assistant", "content": reply.text}]
                with_reply = ideal.render(history[s], generation=False)
                ideal.remember(prompt, with_reply, reply.completion_tokens)
                request = Request(
                    s, turn, reply.prompt_tokens, reply.cached_tokens, ideal_cached, reply.ttft
                )
                result.requests.append(request)
                print(
                    f"{label}: session {s + 1:2d} turn {turn + 1}: prompt {request.prompt_tokens:5d} "
                    f"(rendered {len(prompt)}), cached {request.cached_tokens:5d}, "
                    f"ideal {ideal_cached:5d}, ttft {request.ttft:6.2f}s"
                )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument(
        "--tool-tokens", type=int, nargs=2, default=(60, 120), metavar=("MIN", "MAX")
    )
    parser.add_argument("--max-tokens", type=int, default=12, help="max_tokens of each reply")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="reuse this models folder (skips the import)"
    )
    parser.add_argument("--skip-mlx-lm", action="store_true", help="run exo only")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="exo-agentic-"))
    models = args.models_dir or work / "models"
    try:
        with start_node(models) as node:
            tokenizer = AutoTokenizer.from_pretrained(str(node.model_dir))
            workload = make_workload(
                tokenizer,
                args.sessions,
                args.turns,
                args.system_tokens,
                tuple(args.tool_tokens),
                args.seed,
            )
            exo = replay(
                node.base_url, "SmolLM2-135M-Instruct", workload, IdealCache(tokenizer),
                args.max_tokens, "exo",
            )  # fmt: skip
            stats = httpx.get(f"{node.base_url}/v1/cache/stats", timeout=10).json()["data"][0]
            model_dir = node.model_dir
        mlx: Replay | None = None
        if not args.skip_mlx_lm:
            fp32 = float32_copy(model_dir, work / "float32")
            with mlx_lm_server(fp32, work) as (base_url, _):
                mlx = replay(
                    base_url, str(fp32), workload, IdealCache(tokenizer), args.max_tokens,
                    "mlx_lm.server",
                )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{args.sessions} sessions x {args.turns} turns, round-robin, system prompt "
          f"~{args.system_tokens} tokens, tool results {args.tool_tokens[0]}-{args.tool_tokens[1]} "
          f"tokens, replies <= {args.max_tokens} tokens")  # fmt: skip
    print(
        f"cache: {stats['entries']} entries, {stats['chunks']} chunks, {stats['bytes'] / 1e6:.1f} MB, "
        f"{stats['evictions']} evictions, hits {stats['hits_exact'] + stats['hits_partial']} "
        f"of {stats['lookups']}"
    )
    prefill_ratio = exo.prefilled / exo.ideal_prefilled
    print(
        f"exo prefilled {exo.prefilled} tokens, the ideal cache {exo.ideal_prefilled}: "
        f"{prefill_ratio:.3f}x (target <= {TARGET_PREFILL_RATIO}x)"
    )
    met = prefill_ratio <= TARGET_PREFILL_RATIO
    print(f"exo TTFT sum {exo.ttft_sum:.1f}s")
    if mlx is not None:
        ttft_ratio = exo.ttft_sum / mlx.ttft_sum
        print(
            f"mlx_lm.server TTFT sum {mlx.ttft_sum:.1f}s (prompt tokens "
            f"{sum(r.prompt_tokens for r in mlx.requests)}): exo/mlx_lm {ttft_ratio:.3f}x "
            f"(target <= {TARGET_TTFT_RATIO}x)"
        )
        met = met and ttft_ratio <= TARGET_TTFT_RATIO
    print(f"targets {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
