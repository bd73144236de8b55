"""Concurrent streams: aggregate decode tokens/s at 1/2/4/8 concurrent streaming
chats, and the time to first token of a short request sent while long
generations run; exo (default flags) vs mlx_lm.server (default flags) on the
same model folder, in one run.

- **aggregate decode tokens/s**: N streams sent at once, each a different
  question, `max_tokens` tokens each (EOS biased away, so every stream decodes
  the same count); all tokens after each stream's first, over the time from the
  earliest first token to the last token. Greedy for both servers, and sampled
  at temperature 0.7 with top-p 0.9 (the model's recommended top-p, sent to
  both): exo with a seed per stream, which it batches too, mlx_lm.server
  without (it serves seeded requests one at a time).
- **short-request TTFT**: two long generations stream; once both have tokens
  out, a one-token chat is sent; its time to first token, median of the rounds.

Both servers run at once (idle between their rounds): for each concurrency the
servers' rounds alternate, `--repeats` times with the order rotating, and the
median is reported, so a slow spell of the machine does not fall on one server
only. The ratios (and the targets) are the median over the repeats of each
repeat's own ratio: a repeat's rounds run back to back, so the machine's drift
over the run (10 % and more on a shared VM) cancels out of them. Each round
also prints the CPU time per token of each process (exo's node and runner;
mlx_lm.server's one process).

mlx_lm.server runs the float32 copy of the model that exo's runner runs on the
CPU (the built-in model is a quantized GGUF, dequantized at load), with OpenBLAS
preloaded as for exo's runners.

    uv run python bench/concurrent_streams.py
    uv run python bench/concurrent_streams.py --concurrency 1 4 --max-tokens 64
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from exo_node import (
    MODEL_ID,
    CpuMeter,
    StreamResult,
    float32_copy,
    mlx_lm_server,
    runner_pid,
    start_node,
    stream_chat,
)
from transformers import AutoTokenizer

TARGET_FOUR_STREAMS = 2.5  # 4 streams vs one, aggregate tokens/s
# Like against like: greedy vs greedy, exo's seeded sampling vs mlx_lm.server's
# unseeded sampling at the same temperature (it serves seeded requests one at a time).
PAIRS = [("exo", "mlx_lm.server"), ("exo seeded", "mlx_lm.server sampled")]
# The built-in model's recommended top-p (its generation_config.json), which exo
# applies by default and mlx_lm.server does not: sent to both, so both do it.
SAMPLED_TOP_P = 0.9
QUESTIONS = [
    "Tell me a long story about a lighthouse keeper.",
    "Explain how a steam engine works, in detail.",
    "Describe a walk through a busy market.",
    "Write a letter to a friend about your garden.",
    "Explain the rules of chess to a beginner.",
    "Describe the history of the bicycle.",
    "Tell me about the planets of the solar system.",
    "Write a recipe for bread, step by step.",
]


@dataclass(frozen=True)
class Server:
    label: str
    base_url: str
    model: str
    extra: Callable[[int], dict[str, Any]]  # per stream index: extra request fields


@dataclass(frozen=True)
class Round:
    streams: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def run_streams(server: Server, count: int, max_tokens: int, no_eos: dict[str, float]) -> Round:
    """`count` streams at once; their decode tokens over the decode window."""
    results: list[StreamResult | BaseException] = [RuntimeError("no result")] * count
    barrier = threading.Barrier(count)

    def one(index: int) -> None:
        try:
            with httpx.Client() as client:
                barrier.wait(timeout=60)
                sent = time.perf_counter()
                result = stream_chat(
                    client,
                    server.base_url,
                    [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
                    max_tokens,
                    model=server.model,
                    logit_bias=no_eos,
                    **server.extra(index),
                )
                # Stream times are relative to each stream's send: make them absolute.
                result.content_times = [sent + t for t in result.content_times]
                results[index] = result
        except BaseException as error:  # reported below
            results[index] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = [r for r in results if isinstance(r, StreamResult)]
    if len(done) != count:
        raise RuntimeError(f"{server.label}: streams failed: {results}")
    start = min(r.content_times[0] for r in done)
    end = max(r.content_times[-1] for r in done)
    tokens = sum(r.completion_tokens - 1 for r in done)
    return Round(count, tokens, end - start)


def short_ttft(server: Server, long_tokens: int, no_eos: dict[str, float]) -> float:
    """TTFT of a one-token chat sent while two long generations stream."""
    started = threading.Event()
    streaming = [0, 0]
    errors: list[BaseException] = []

    def long(index: int) -> None:
        try:
            with httpx.Client() as client:
                body: dict[str, Any] = {
                    "model": server.model,
                    "messages": [{"role": "user", "content": QUESTIONS[index]}],
                    "max_tokens": long_tokens,
                    "temperature": 0,
                    "stream": True,
                    "logit_bias": no_eos,
                }
                url = f"{server.base_url}/v1/chat/completions"
                with client.stream("POST", url, json=body, timeout=600) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and '"content"' in line:
                            streaming[index] += 1
                            if min(streaming) >= 3:
                                started.set()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=long, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    if not started.wait(timeout=300):
        raise RuntimeError(f"{server.label}: the long generations did not start: {errors}")
    with httpx.Client() as client:
        short = stream_chat(
            client, server.base_url, [{"role": "user", "content": "Say hi."}], 1, model=server.model
        )
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{server.label}: {errors}")
    return short.ttft


def warm_up(server: Server) -> None:
    with httpx.Client() as client:
        stream_chat(
            client, server.base_url, [{"role": "user", "content": "Hi"}], 4, model=server.model
        )


def measure_rates(
    servers: list[Server],
    concurrency: list[int],
    max_tokens: int,
    repeats: int,
    no_eos: dict[str, float],
    meters: dict[str, CpuMeter],
) -> dict[str, dict[int, list[float]]]:
    """Aggregate tok/s per server and concurrency, one per repeat. The servers'
    rounds alternate (the order rotating each repeat), so a slow spell of the
    machine falls on all of them, not on whichever ran last."""
    samples: dict[str, dict[int, list[float]]] = {
        s.label: {n: [] for n in concurrency} for s in servers
    }
    for count in concurrency:
        for repeat in range(repeats):
            shift = repeat % len(servers)
            for server in servers[shift:] + servers[:shift]:
                meter = meters[server.label]
                meter.start()
                result = run_streams(server, count, max_tokens, no_eos)
                usage = meter.stop()
                samples[server.label][count].append(result.tokens_per_second)
                cpu = ", ".join(
                    f"{name} {usage.cpu_ms_per(name, result.tokens + count):.1f}"
                    for name in meter.processes
                )
                print(
                    f"{server.label}: {count} streams: {result.tokens} tokens in "
                    f"{result.seconds:.2f}s = {result.tokens_per_second:.1f} tok/s "
                    f"(CPU ms/token: {cpu}; other processes {usage.foreign_cores:.2f} cores)"
                )
    return samples


def measure_ttft(server: Server, rounds: int, long_tokens: int, no_eos: dict[str, float]) -> float:
    ttfts = [short_ttft(server, long_tokens, no_eos) for _ in range(rounds)]
    print(f"{server.label}: short-request TTFT during 2 long generations: {ttfts}")
    return statistics.median(ttfts)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="rounds per concurrency (median)")
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--skip-mlx-lm", action="store_true", help="run exo only")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exo-streams-"))
    models = args.models_dir or work / "models"
    samples: dict[str, dict[int, list[float]]] = {}
    ttfts: dict[str, float] = {}
    try:
        with start_node(models) as node, ExitStack() as stack:
            tokenizer = AutoTokenizer.from_pretrained(str(node.model_dir))
            no_eos = {str(tokenizer.eos_token_id): -100.0}
            servers = [
                Server("exo", node.base_url, MODEL_ID, lambda i: {}),
                Server(
                    "exo seeded",
                    node.base_url,
                    MODEL_ID,
                    lambda i: {"temperature": 0.7, "top_p": SAMPLED_TOP_P, "seed": 1000 + i},
                ),
            ]
            warm_up(servers[0])  # the runner starts with the first request
            exo_processes = {"node": node.process.pid, "runner": runner_pid(node) or -1}
            meters = {s.label: CpuMeter(exo_processes) for s in servers}
            if not args.skip_mlx_lm:
                fp32 = float32_copy(node.model_dir, work / "float32")
                base_url, pid = stack.enter_context(mlx_lm_server(fp32, work))
                servers.append(Server("mlx_lm.server", base_url, str(fp32), lambda i: {}))
                servers.append(
                    Server(
                        "mlx_lm.server sampled",
                        base_url,
                        str(fp32),
                        lambda i: {"temperature": 0.7, "top_p": SAMPLED_TOP_P},
                    )
                )
                for label in ("mlx_lm.server", "mlx_lm.server sampled"):
                    meters[label] = CpuMeter({"server": pid})
            for server in servers:
                warm_up(server)
            samples = measure_rates(
                servers, args.concurrency, args.max_tokens, args.repeats, no_eos, meters
            )
            for server in servers:
                rounds = args.ttft_rounds if server.label in ("exo", "mlx_lm.server") else 1
                ttfts[server.label] = measure_ttft(server, rounds, 4 * args.max_tokens, no_eos)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rates = {
        label: {n: statistics.median(values) for n, values in by_count.items()}
        for label, by_count in samples.items()
    }
    results = {label: (rates[label], ttfts[label]) for label in rates}

    print()
    header = " | ".join(f"{n} streams" for n in args.concurrency)
    print(f"| aggregate decode tok/s | {header} | short-request TTFT |")
    print("| --- " * (len(args.concurrency) + 2) + "|")
    for label, (by_count, ttft) in results.items():
        cells = " | ".join(f"{by_count[n]:.1f}" for n in args.concurrency)
        print(f"| {label} | {cells} | {ttft:.2f}s |")
    met = True
    exo_rates, exo_ttft = results["exo"]
    if 1 in exo_rates and 4 in exo_rates:
        scale = exo_rates[4] / exo_rates[1]
        print(f"exo 4 streams / 1 stream: {scale:.2f}x (target >= {TARGET_FOUR_STREAMS}x)")
        met = scale >= TARGET_FOUR_STREAMS
    if "mlx_lm.server" in results:
        mlx_ttft = results["mlx_lm.server"][1]
        for n in args.concurrency:
            for label, baseline in PAIRS:
                paired = zip(samples[label][n], samples[baseline][n], strict=True)
                ratios = [mine / theirs for mine, theirs in paired]
                ratio = statistics.median(ratios)
                each = ", ".join(f"{r:.2f}" for r in ratios)
                print(
                    f"{label} / {baseline} at {n} streams: {ratio:.2f}x "
                    f"(median of the repeats' {each}; target >= 1)"
                )
                met = met and ratio >= 1
        print(f"short-request TTFT exo / mlx_lm.server: {exo_ttft / mlx_ttft:.2f}x (target <= 1)")
        met = met and exo_ttft <= mlx_ttft
    print(f"targets {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
