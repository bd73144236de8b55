"""What a 4-row verify step costs, and what cutting its refused tokens out of
the batch cache adds: exo's `batch_order.realign` (moves at most a draft's
tokens per row) against mlx-lm's `BatchKVCache.finalize` (rolls every row),
at several context lengths.

In process, the built-in model loaded as a runner loads it
(`load_for_inference`: the few-rows CPU kernel; OpenBLAS preloaded, the
script runs itself again in a runner's environment). For each context
length, a batch cache of 4 rows of that many tokens; each figure is the
median of `--steps` timings of one forward pass evaluated, cache included:

- plain: 4 rows x 1 token;
- verify: 4 rows x 3 tokens (a draft of 2), no cut;
- + realign / + roll: the verify step, then the rows keep 3, 2, 1 and 1 of
  the 3 tokens they fed, cut out by each way (its time includes the step).

With `--cut-only`, only the cut is timed, on caches of the built-in model's
shape (its layers, KV heads and head size) filled with random values: no
forward pass, so long contexts take seconds.

    uv run python bench/verify_step.py
    uv run python bench/verify_step.py --cut-only --contexts 620,4000,16000
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

CHILD = "EXO_BENCH_VERIFY_STEP_CHILD"
ROWS = 4
WIDTH = 3
KEPT = [3, 2, 1, 1]  # of the WIDTH tokens each row fed
CHUNK = 512  # prompt tokens per forward pass while the rows are filled
# Cuts a verify step's refused tokens (beyond the rows' fewest) out of the cache.
Cut = Callable[[list[Any], list[int]], None]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--contexts", default="620,4000", help="tokens per row")
    parser.add_argument("--steps", type=int, default=8, help="timings per figure")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="a models folder (else a temporary one)"
    )
    parser.add_argument("--cut-only", action="store_true", help="time only the cut")
    args = parser.parse_args()
    if os.environ.get(CHILD) is None:
        return _in_runner_environment()
    models = args.models_dir or Path(tempfile.mkdtemp(prefix="exo-verify-step-"))
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.cut_only:
        measure_cut(contexts, args.steps, models)
    else:
        measure(contexts, args.steps, models)
    return 0


def measure_cut(contexts: list[int], steps: int, models: Path) -> None:
    import json

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from exo.engine.mlx.batch_order import realign
    from exo.models.builtin import ensure_default_model

    config = json.loads((ensure_default_model(models) / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    refused = [WIDTH - k for k in KEPT]
    extra = [r - min(refused) for r in refused]
    print(f"{layers} layers, {heads} KV heads of {size}; {ROWS} rows, refused {extra}")
    print(f"{'context':>8} {'realign':>10} {'roll':>10}")
    for context in contexts:
        cache: list[BatchKVCache] = []
        for _ in range(layers):
            rows = []
            for _ in range(ROWS):
                row = KVCache()
                held = mx.random.normal((1, heads, context, size))
                row.update_and_fetch(held, held)
                rows.append(row)
            cache.append(BatchKVCache.merge(rows))  # pyright: ignore[reportAttributeAccessIssue]
        mx.eval([c.state for c in cache])
        times: dict[str, list[float]] = {"realign": [], "roll": []}
        for _ in range(steps):
            for name in times:
                fed = mx.random.normal((ROWS, heads, WIDTH, size))
                for layer in cache:
                    layer.update_and_fetch(fed, fed)
                    layer.trim(min(refused))
                mx.eval([c.state for c in cache])
                before = time.perf_counter()
                if name == "realign":
                    realign(cache, extra, [None] * ROWS)
                else:
                    for layer in cache:
                        layer.prepare(right_padding=extra)
                        layer.finalize()
                mx.eval([c.state for c in cache])
                times[name].append(time.perf_counter() - before)
                for layer in cache:  # back near the context length
                    layer.trim(WIDTH - min(refused))
        realigned, rolled = (statistics.median(times[n]) * 1e3 for n in ("realign", "roll"))
        print(f"{context:>8} {realigned:>8.1f}ms {rolled:>8.1f}ms")


def _in_runner_environment() -> int:
    from exo.worker.runner.blas import runner_environment

    env = runner_environment(
        Path(tempfile.mkdtemp(prefix="exo-verify-step-blas-")), dict(os.environ)
    )
    env[CHILD] = "1"
    return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode


def measure(contexts: list[int], steps: int, models: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from exo.engine.mlx.batch_order import realign
    from exo.engine.mlx.load import load_for_inference
    from exo.models.builtin import ensure_default_model

    model, _ = load_for_inference(ensure_default_model(models))

    def batch(context: int) -> list[BatchKVCache]:
        """4 rows of `context` tokens each (random KV: the cost is the same)."""
        rows: list[list[KVCache]] = []
        for _ in range(ROWS):
            caches = [KVCache() for _ in range(len(cast(list[Any], model.layers)))]  # pyright: ignore[reportAttributeAccessIssue]
            for start in range(0, context, CHUNK):
                chunk = min(CHUNK, context - start)
                model(mx.random.randint(0, 1000, (1, chunk)), cache=caches)
                mx.eval([c.state for c in caches])
            rows.append(caches)
        merged = [BatchKVCache.merge(list(layer)) for layer in zip(*rows, strict=True)]  # pyright: ignore[reportAttributeAccessIssue]
        mx.eval([c.state for c in merged])
        return merged

    def timed(cache: list[BatchKVCache], width: int, cut: Cut | None) -> float:
        before = time.perf_counter()
        model(mx.random.randint(0, 1000, (ROWS, width)), cache=cache)
        if cut is not None:
            refused = [WIDTH - k for k in KEPT]
            fewest = min(refused)
            for layer in cache:
                layer.trim(fewest)
            cut(cache, [r - fewest for r in refused])
        mx.eval([c.state for c in cache])
        seconds = time.perf_counter() - before
        for layer in cache:  # back to the context length for the next timing
            layer.trim(width if cut is None else 1)
        return seconds

    def rolled(cache: list[BatchKVCache], extra: list[int]) -> None:
        for layer in cache:
            layer.prepare(right_padding=extra)
            layer.finalize()

    def moved(cache: list[BatchKVCache], extra: list[int]) -> None:
        realign(cache, extra, [None] * ROWS)

    print(f"{'context':>8} {'plain':>9} {'verify':>9} {'+ realign':>10} {'+ roll':>9}")
    for context in contexts:
        cache = batch(context)
        figures = {}
        for name, width, cut in (
            ("plain", 1, None),
            ("verify", WIDTH, None),
            ("realign", WIDTH, moved),
            ("roll", WIDTH, rolled),
        ):
            timed(cache, width, cut)  # warm
            figures[name] = statistics.median(timed(cache, width, cut) for _ in range(steps))
        plain = figures["plain"]
        print(
            f"{context:>8} {plain * 1e3:>7.1f}ms "
            + " ".join(
                f"{figures[n] * 1e3:>6.1f}ms ({figures[n] / plain:.1f}x)"
                for n in ("verify", "realign", "roll")
            )
        )


if __name__ == "__main__":
    sys.exit(main())
