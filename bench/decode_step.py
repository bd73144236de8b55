"""What one decode step of one request costs at agent context lengths: exo's
CPU forward pass (the few-rows kernels for the matmuls and for attention,
`cpu_few_rows.py`, `cpu_attention.py`) against mlx-lm's (MLX's `sgemm` and
`scaled_dot_product_attention`, as `mlx_lm.server` runs the model on this CPU).

In process, the built-in model twice: loaded as a runner loads it
(`load_for_inference`) and as mlx-lm loads it (`load_model`, then dequantized
to float32 as exo does: MLX's CPU quantized matmul is far slower); OpenBLAS
preloaded for both (the script runs itself again in a runner's environment).
For each context length, one cache per side filled with that many prompt
tokens; then steps feeding 1 token (a plain decode step) and 3 or 9 (a
verify step of a draft of 2 or 8), the two sides taking turns, each figure the
median of `--steps` timings of a forward pass evaluated, cache included.

    uv run python bench/decode_step.py               # 600 and 4,000 tokens, ~5 min
    uv run python bench/decode_step.py --contexts 16000 --widths 1
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

CHILD = "EXO_BENCH_DECODE_STEP_CHILD"
CHUNK = 512  # prompt tokens per forward pass while a cache is filled


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--contexts", default="600,4000", help="prompt tokens cached")
    parser.add_argument("--widths", default="1,3,9", help="tokens a step feeds")
    parser.add_argument("--steps", type=int, default=8, help="timings per figure")
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="a models folder (else a temporary one)"
    )
    args = parser.parse_args()
    if os.environ.get(CHILD) is None:
        return _in_runner_environment()
    models = args.models_dir or Path(tempfile.mkdtemp(prefix="exo-decode-step-"))
    measure(
        [int(c) for c in args.contexts.split(",")],
        [int(w) for w in args.widths.split(",")],
        args.steps,
        models,
    )
    return 0


def _in_runner_environment() -> int:
    from exo.worker.runner.blas import runner_environment

    env = runner_environment(
        Path(tempfile.mkdtemp(prefix="exo-decode-step-blas-")), dict(os.environ)
    )
    env[CHILD] = "1"
    return subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode


def measure(contexts: list[int], widths: list[int], steps: int, models: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from exo.engine.mlx.cpu_attention import few_rows_attention, mlx_attention
    from exo.engine.mlx.cpu_threads import blas_for_kernel
    from exo.engine.mlx.load import dequantize_f32, load_for_inference
    from exo.models.builtin import ensure_default_model

    folder = ensure_default_model(models)
    exo_model, _ = load_for_inference(folder)
    mlx_model, _ = load_model(folder)
    mlx_model = dequantize_f32(mlx_model)  # float32 weights, as exo's
    mlx_model.set_dtype(mx.float32)
    mx.eval(mlx_model.parameters())
    files = sys.modules[type(exo_model).__module__]  # both models' attention is looked up here
    sides = {"exo": (exo_model, few_rows_attention), "mlx-lm": (mlx_model, mlx_attention)}

    def filled(model: Any, context: int) -> list[Any]:
        blas_for_kernel.for_matmul()
        cache = make_prompt_cache(model)
        for start in range(0, context, CHUNK):
            model(mx.random.randint(0, 1000, (1, min(CHUNK, context - start))), cache=cache)
            mx.eval([layer.state for layer in cache])
        return cache

    def timed(model: Any, cache: list[Any], width: int) -> float:
        # exo's kernel passes set OpenBLAS to one thread, restored by a bigger
        # matmul of exo's: mlx-lm's side always gets OpenBLAS's own count.
        blas_for_kernel.for_matmul()
        before = time.perf_counter()
        logits = model(mx.random.randint(0, 1000, (1, width)), cache=cache)
        mx.eval(logits, [layer.state for layer in cache])
        seconds = time.perf_counter() - before
        for layer in cache:  # back to the context length for the next timing
            layer.trim(width)
        return seconds

    print(f"{'context':>8} {'tokens':>6} {'exo':>9} {'mlx-lm':>9} {'mlx-lm / exo':>13}")
    for context in contexts:
        caches: dict[str, list[Any]] = {}
        for name, (model, attention) in sides.items():
            files.scaled_dot_product_attention = attention  # pyright: ignore[reportAttributeAccessIssue]
            caches[name] = filled(model, context)
        for width in widths:
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(steps + 1):  # the first of each side: warm-up
                for name, (model, attention) in sides.items():
                    files.scaled_dot_product_attention = attention  # pyright: ignore[reportAttributeAccessIssue]
                    times[name].append(timed(model, caches[name], width))
            exo, mlx = (statistics.median(cast(list[float], times[n][1:])) for n in sides)
            print(
                f"{context:>8} {width:>6} {exo * 1e3:>7.1f}ms {mlx * 1e3:>7.1f}ms {mlx / exo:>12.2f}x",
                flush=True,
            )
    files.scaled_dot_product_attention = few_rows_attention  # pyright: ignore[reportAttributeAccessIssue]


if __name__ == "__main__":
    sys.exit(main())
