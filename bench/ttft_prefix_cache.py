"""Time to first token with and without a KV prefix cache hit, through the HTTP API.

Starts a real `exo` node on a free loopback port, then for each of N distinct
conversations:

* cold: a ~2,000-token user message nobody has sent before (random records,
  unique per conversation), streamed; TTFT = request sent -> first content chunk;
* hit: the same conversation re-sent with the cold answer as the assistant
  turn and a new ~100-token user message appended; the node should restore the
  first ~2,000 tokens from its prefix cache and prefill only the rest.

Reports per-conversation figures and medians of cold TTFT, hit TTFT, hit/cold
and `usage.prompt_tokens_details.cached_tokens`. Target: hit <= 0.1 x cold.

    uv run python bench/ttft_prefix_cache.py
"""

import argparse
import os
import random
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from exo_node import (
    CpuMeter,
    CpuUsage,
    ExoNode,
    StreamResult,
    median,
    runner_pid,
    start_node,
    stream_chat,
)
from tokenizers import Tokenizer

TARGET_RATIO = 0.1

_NOUNS = (
    "lighthouse",
    "orchard",
    "violin",
    "glacier",
    "lantern",
    "harbor",
    "meadow",
    "telescope",
    "bakery",
    "canyon",
    "library",
    "compass",
    "windmill",
    "river",
    "market",
    "bridge",
    "garden",
    "observatory",
    "quarry",
    "vineyard",
)
_ADJECTIVES = (
    "old",
    "quiet",
    "crimson",
    "distant",
    "busy",
    "frozen",
    "golden",
    "narrow",
    "ancient",
    "hidden",
    "bright",
    "hollow",
    "silver",
    "windy",
    "green",
)
_CITIES = (
    "Lisbon",
    "Oslo",
    "Kyoto",
    "Quito",
    "Nairobi",
    "Tallinn",
    "Hobart",
    "Cusco",
    "Tromso",
    "Valparaiso",
    "Bergen",
    "Hanoi",
    "Reykjavik",
    "Marrakesh",
    "Zagreb",
)
_VERBS = ("was rebuilt", "was painted", "was measured", "was sold", "was visited", "was mapped")


def _record(rng: random.Random, index: int) -> str:
    return (
        f"Record {index}: the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} of "
        f"{rng.choice(_CITIES)} {rng.choice(_VERBS)} in {rng.randint(1600, 2024)} "
        f"and is {rng.randint(2, 950)} meters from the {rng.choice(_NOUNS)}."
    )


def _text_of_tokens(tokenizer: Tokenizer, rng: random.Random, header: str, tokens: int) -> str:
    """Random records after `header`, about `tokens` tokens long in all."""
    lines = [header]
    count = len(tokenizer.encode(header, add_special_tokens=False).ids)
    index = 1
    while count < tokens:
        line = _record(rng, index)
        lines.append(line)
        count += len(tokenizer.encode("\n" + line, add_special_tokens=False).ids)
        index += 1
    return "\n".join(lines)


# A request counts as quiet when other processes used at most this many cores on average.
QUIET_FOREIGN_CORES = 0.15


@dataclass
class ConversationResult:
    cold: StreamResult
    hit: StreamResult
    cold_cpu: CpuUsage
    hit_cpu: CpuUsage

    @property
    def quiet(self) -> bool:
        return max(self.cold_cpu.foreign_cores, self.hit_cpu.foreign_cores) <= QUIET_FOREIGN_CORES

    @property
    def ratio(self) -> float:
        return self.hit.ttft / self.cold.ttft


def run_conversation(
    client: httpx.Client,
    node: ExoNode,
    meter: CpuMeter,
    tokenizer: Tokenizer,
    seed: int,
    prompt_tokens: int,
    suffix_tokens: int,
    max_tokens: int,
) -> ConversationResult:
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:12]
    document = _text_of_tokens(
        tokenizer,
        rng,
        f"Archive {tag}. Read these records carefully; questions follow.",
        prompt_tokens - 40,  # leave room for the chat template and the question
    )
    first = [{"role": "user", "content": document + "\n\nWhich record mentions Oslo first?"}]
    meter.start()
    cold = stream_chat(client, node.base_url, first, max_tokens)
    cold_cpu = meter.stop()
    question = _text_of_tokens(
        tokenizer,
        rng,
        "Here are a few more records, added later:",
        # The new suffix is everything after the cached prompt: the assistant's
        # answer, the chat template's tags, the new records and the question.
        suffix_tokens - 55,
    )
    second = [
        *first,
        {"role": "assistant", "content": cold.text},
        {"role": "user", "content": question + "\nWhich of these new records is the oldest?"},
    ]
    meter.start()
    hit = stream_chat(client, node.base_url, second, max_tokens)
    return ConversationResult(cold, hit, cold_cpu, meter.stop())


def summarize(label: str, results: list[ConversationResult]) -> float:
    print()
    if not results:
        print(f"{label}: none")
        return float("nan")
    ratio = median([r.ratio for r in results])
    print(f"{label}:")
    print(
        f"  cold TTFT      {median([r.cold.ttft for r in results]):6.2f} s  "
        f"(prompt {median([float(r.cold.prompt_tokens) for r in results]):.0f} tokens, "
        f"cached_tokens {median([float(r.cold.cached_tokens) for r in results]):.0f})"
    )
    print(
        f"  hit TTFT       {median([r.hit.ttft for r in results]):6.2f} s  "
        f"(prompt {median([float(r.hit.prompt_tokens) for r in results]):.0f} tokens, "
        f"cached_tokens {median([float(r.hit.cached_tokens) for r in results]):.0f}, "
        f"new {median([float(r.hit.prompt_tokens - r.hit.cached_tokens) for r in results]):.0f})"
    )
    print(f"  hit/cold       {ratio:.3f}  (target <= {TARGET_RATIO})")
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(
        description="TTFT of a cold ~2k-token prompt vs a prefix-cache hit, via a real exo node."
    )
    parser.add_argument("--conversations", type=int, default=3, help="distinct conversations")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="cold prompt size")
    parser.add_argument(
        "--suffix-tokens",
        type=int,
        default=100,
        help="new suffix size: the assistant turn plus the new user message",
    )
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each request")
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="reuse this models folder (skips the import when the model is there); "
        "default: a temp folder",
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=None,
        help="passed to exo (0 disables the cache: a control run); default exo's",
    )
    parser.add_argument("--seed", type=int, default=1234, help="seed of the random records")
    parser.add_argument("--keep-logs", action="store_true", help="keep the node's temp folder")
    args = parser.parse_args()

    results: list[ConversationResult] = []
    with (
        start_node(args.models_dir, args.prefix_cache_bytes, args.keep_logs) as node,
        httpx.Client() as client,
    ):
        tokenizer = Tokenizer.from_file(str(node.model_dir / "tokenizer.json"))
        warm = stream_chat(client, node.base_url, [{"role": "user", "content": "Hi!"}], 4)
        print(f"warm-up request: ttft {warm.ttft:.2f}s")
        processes = {"client": os.getpid(), "node": node.process.pid}
        pid = runner_pid(node)
        if pid is not None:
            processes["runner"] = pid
        meter = CpuMeter(processes)
        for index in range(args.conversations):
            result = run_conversation(
                client,
                node,
                meter,
                tokenizer,
                args.seed + index,
                args.prompt_tokens,
                args.suffix_tokens,
                args.max_tokens,
            )
            results.append(result)
            cold, hit = result.cold, result.hit
            print(
                f"conversation {index + 1}: "
                f"cold ttft {cold.ttft:6.2f}s (prompt {cold.prompt_tokens}, "
                f"cached {cold.cached_tokens}) | "
                f"hit ttft {hit.ttft:6.2f}s (prompt {hit.prompt_tokens}, "
                f"cached {hit.cached_tokens}, new {hit.prompt_tokens - hit.cached_tokens}) | "
                f"hit/cold {result.ratio:.3f} | other processes: cold "
                f"{result.cold_cpu.foreign_cores:.2f}, hit {result.hit_cpu.foreign_cores:.2f} cores"
            )
        stats = client.get(f"{node.base_url}/v1/cache/stats", timeout=10).json()
        print(f"cache stats: {stats['data'][0]}")

    ratio = summarize(f"medians over all {len(results)} conversations", results)
    quiet = [r for r in results if r.quiet]
    if len(quiet) < len(results):
        summarize(
            f"medians over quiet conversations only (other processes <= {QUIET_FOREIGN_CORES} cores)",
            quiet,
        )
    met = ratio <= TARGET_RATIO
    print(f"target {'met' if met else 'MISSED'} (all conversations)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
