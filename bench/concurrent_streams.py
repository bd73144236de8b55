"""Concurrent streams: aggregate decode tokens/s at 1/2/4/8 concurrent streaming
chats, and the time to first token of a short request sent while long
generations run; exo (default flags) vs mlx_lm.server (default flags) on the
same model folder, in one run.

- **aggregate decode tokens/s**: N streams sent at once, each a different
  question, `max_tokens` tokens each (EOS biased away, so every stream decodes
  the same count); all tokens after each stream's first, over the time from the
  earliest first token to the last token. Greedy for both servers; exo is also
  measured with seeded sampling (temperature 0.7, a seed per stream), which it
  batches too (mlx_lm.server serves seeded requests one at a time, so it gets
  unseeded ones).
- **short-request TTFT**: two long generations stream; once both have tokens
  out, a one-token chat is sent; its time to first token, median of the rounds.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from exo_node import StreamResult, float32_copy, mlx_lm_server, start_node, stream_chat
from transformers import AutoTokenizer

TARGET_FOUR_STREAMS = 2.5  # 4 streams vs one, aggregate tokens/s
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


def measure(
    server: Server, concurrency: list[int], max_tokens: int, rounds: int, no_eos: dict[str, float]
) -> tuple[dict[int, float], float]:
    stream_chat(
        httpx.Client(), server.base_url, [{"role": "user", "content": "Hi"}], 4, model=server.model
    )  # warm-up
    rates: dict[int, float] = {}
    for count in concurrency:
        result = run_streams(server, count, max_tokens, no_eos)
        rates[count] = result.tokens_per_second
        print(
            f"{server.label}: {count} streams: {result.tokens} tokens in {result.seconds:.2f}s "
            f"= {result.tokens_per_second:.1f} tok/s"
        )
    ttfts = [short_ttft(server, 4 * max_tokens, no_eos) for _ in range(rounds)]
    print(f"{server.label}: short-request TTFT during 2 long generations: {ttfts}")
    return rates, statistics.median(ttfts)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-rounds", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--skip-mlx-lm", action="store_true", help="run exo only")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exo-streams-"))
    models = args.models_dir or work / "models"
    results: dict[str, tuple[dict[int, float], float]] = {}
    try:
        with start_node(models) as node:
            tokenizer = AutoTokenizer.from_pretrained(str(node.model_dir))
            no_eos = {str(tokenizer.eos_token_id): -100.0}
            model_dir = node.model_dir
            greedy = Server("exo", node.base_url, "SmolLM2-135M-Instruct", lambda i: {})
            seeded = Server(
                "exo seeded",
                node.base_url,
                "SmolLM2-135M-Instruct",
                lambda i: {"temperature": 0.7, "seed": 1000 + i},
            )
            results["exo"] = measure(
                greedy, args.concurrency, args.max_tokens, args.ttft_rounds, no_eos
            )
            results["exo seeded"] = measure(seeded, args.concurrency, args.max_tokens, 1, no_eos)
        if not args.skip_mlx_lm:
            fp32 = float32_copy(model_dir, work / "float32")
            with mlx_lm_server(fp32, work) as base_url:
                mlx = Server("mlx_lm.server", base_url, str(fp32), lambda i: {})
                results["mlx_lm.server"] = measure(
                    mlx, args.concurrency, args.max_tokens, args.ttft_rounds, no_eos
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    header = " | ".join(f"{n} streams" for n in args.concurrency)
    print(f"| aggregate decode tok/s | {header} | short-request TTFT |")
    print("| --- " * (len(args.concurrency) + 2) + "|")
    for label, (rates, ttft) in results.items():
        cells = " | ".join(f"{rates[n]:.1f}" for n in args.concurrency)
        print(f"| {label} | {cells} | {ttft:.2f}s |")
    met = True
    exo_rates, exo_ttft = results["exo"]
    if 1 in exo_rates and 4 in exo_rates:
        scale = exo_rates[4] / exo_rates[1]
        print(f"exo 4 streams / 1 stream: {scale:.2f}x (target >= {TARGET_FOUR_STREAMS}x)")
        met = scale >= TARGET_FOUR_STREAMS
    if "mlx_lm.server" in results:
        mlx_rates, mlx_ttft = results["mlx_lm.server"]
        for n in args.concurrency:
            for label in ("exo", "exo seeded"):
                ratio = results[label][0][n] / mlx_rates[n]
                print(f"{label} / mlx_lm.server at {n} streams: {ratio:.2f}x (target >= 1)")
                met = met and ratio >= 1
        print(f"short-request TTFT exo / mlx_lm.server: {exo_ttft / mlx_ttft:.2f}x (target <= 1)")
        met = met and exo_ttft <= mlx_ttft
    print(f"targets {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
