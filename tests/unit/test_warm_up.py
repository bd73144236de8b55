"""`warm_up`: after it, a fresh process's first request on a model is not slower
than its second, even with every on-disk cache of compiled kernels empty (MLX's
under the temp folder, numba's of the CPU decode kernel): it compiles nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Timing noise allowance on a shared machine, on top of the ratio.
SLOWER_AT_MOST = 1.5
NOISE_SECONDS = 0.15

# Run in a fresh process: two requests of the same shape (greedy rows and one drawn
# at a temperature, decoding together), timed, after `warm_up` when asked; which
# compiled-kernel files the first request added to the (empty) caches.
FIRST_AND_SECOND = """
import json, sys, time
from pathlib import Path

import pytest
import tests  # OpenBLAS, as in the test process
from exo.engine.mlx.batch import ContinuousBatcher
from exo.engine.mlx.generate import LocalModel, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.warm_up import warm_up
from exo.shared.types.tasks import GenerationParams

model_dir, caches, warm = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:4]], sys.argv[4] == "1"
model, tokenizer = load_for_inference(model_dir)
local = LocalModel(model, tokenizer)
if warm:
    warm_up(local, local.make_cache())
no_eos = {tokenizer.eos_token_id: -100.0}
greedy = GenerationParams(max_tokens=24, temperature=0, logit_bias=no_eos)
drawn = GenerationParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, logit_bias=no_eos)

def files() -> set[Path]:
    return {p for cache in caches for p in cache.rglob("*") if p.is_file()}

def request(first_token: int) -> float:
    batch = ContinuousBatcher(TextGenerator(local, tokenizer, None))
    for n, params in enumerate([greedy, greedy, drawn]):
        batch.add(str(n), [1, first_token + n, 300, 301, 302, 303], params)
    started = time.monotonic()
    while not batch.idle:
        batch.step()
    return time.monotonic() - started

before = files()
first = request(1000)
compiled = sorted(p.name for p in files() - before)
second = request(2000)
print(json.dumps({"first": first, "second": second, "compiled": compiled}))
"""


def first_and_second(model_dir: Path, tmp_path: Path, warm: bool) -> tuple[float, float, list[str]]:
    """The two requests' seconds, and the compiled-kernel files the first one added."""
    numba_cache, mlx_temp = tmp_path / "numba", tmp_path / "temp"
    numba_cache.mkdir()
    mlx_temp.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba_cache), "TMPDIR": str(mlx_temp)}
    argv = [str(model_dir), str(numba_cache), str(mlx_temp), "1" if warm else "0"]
    done = subprocess.run(
        [sys.executable, "-c", FIRST_AND_SECOND, *argv],
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    timed = json.loads(done.stdout.strip().splitlines()[-1])
    return float(timed["first"]), float(timed["second"]), list(timed["compiled"])


@pytest.mark.serial
def test_after_warm_up_a_cold_process_s_first_request_compiles_nothing_and_is_not_slower(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first, second, compiled = first_and_second(tiny_model_dir, tmp_path, warm=True)
    assert compiled == []
    assert first <= SLOWER_AT_MOST * second + NOISE_SECONDS, (first, second)
