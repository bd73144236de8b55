"""Split instances on loopback: single-stream decode tokens/s of one rank and of
2 pipeline ranks, for the built-in model and a tiny mixture of experts, in one run.

Each instance is real runner processes on an `mx.distributed` ring over
127.0.0.1 (the tests' harness, as `bench/pipeline.py`); the instances of a
model stay up together and take turns each round, so a slower minute of a
shared machine hits both alike. Decode: (completion tokens - 1) / (last chunk -
first chunk) of a greedy story, medians over the rounds (quiet ones when any).

Target on this machine: 2 pipeline ranks >= 0.95 x one rank. Both ranks share
one machine's cores here, so this measures the split's overhead, not a speedup:
on two machines each rank has its own memory bandwidth, which is what a pipeline
buys (a model that fits no single machine), not faster decode of one stream.

Not measured, because exo does not do them yet: tensor-parallel ranks, and
several streams batched on a split instance (a pipeline serves one request at a
time).

    uv run python bench/split.py
"""

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' harness
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/pipeline.py's measuring

from pipeline import STORY, Run, chat, measure

from exo.engine.mlx.load import load_model_tokenizer
from exo.engine.mlx.shard import model_layer_count
from exo.models.builtin import DEFAULT_MODEL_ID, ensure_default_model
from exo.models.store import model_dir
from tests.model_factory import make_tiny_model
from tests.pipeline_harness import even_bounds, running_pipeline

TARGET = 0.95


def decode_speeds(model: Path, work: Path, rounds: int, max_tokens: int) -> dict[int, float]:
    """Median decode tokens/s of 1 rank and of 2 pipeline ranks."""
    layers = model_layer_count(model)
    tokenizer = load_model_tokenizer(model)
    runs: dict[int, list[Run]] = {1: [], 2: []}
    with ExitStack() as stack:
        pipelines = {
            ranks: stack.enter_context(
                running_pipeline(model, work, even_bounds(layers, ranks), ready_timeout=300)
            )
            for ranks in runs
        }
        warm_up = chat(tokenizer, [{"role": "user", "content": STORY}])
        for pipeline in pipelines.values():
            measure(pipeline, "warm-up", warm_up, 8)
        for i in range(rounds):
            story = chat(tokenizer, [{"role": "user", "content": f"Story {i + 1}. {STORY}"}])
            for ranks in (1, 2) if i % 2 == 0 else (2, 1):
                label = f"{model.name}: {ranks} rank(s), story {i + 1}"
                runs[ranks].append(
                    measure(pipelines[ranks], f"story-{i}", story, max_tokens, label)
                )
    return {
        ranks: statistics.median(
            r.decode_tps for r in ([r for r in measured if r.quiet] or measured)
        )
        for ranks, measured in runs.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="split-instance decode benchmark")
    parser.add_argument("--models-dir", type=Path, help="a folder holding the imported model")
    parser.add_argument("--max-tokens", type=int, default=128, help="decode length")
    parser.add_argument("--rounds", type=int, default=4, help="decode runs per instance")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-bench-split-") as temp:
        work = Path(temp)
        models = args.models_dir or work / "models"
        ensure_default_model(models)
        smollm = model_dir(models, DEFAULT_MODEL_ID)
        moe = make_tiny_model("qwen3_moe", work / "tiny-qwen3-moe", smollm, n_layers=8)
        speeds = {
            path.name: decode_speeds(path, work, args.rounds, args.max_tokens)
            for path in (smollm, moe)
        }
    print("\nsummary (median decode tokens/s, quiet runs)")
    met = True
    for name, speed in speeds.items():
        ratio = speed[2] / speed[1]
        met &= ratio >= TARGET
        print(
            f"  {name}: 1 rank {speed[1]:.2f}, 2 pipeline ranks {speed[2]:.2f} "
            f"({ratio:.2f} x; target >= {TARGET})"
        )
    print("  tensor ranks, 4 streams on a split instance: not measured (not built yet)")
    print(f"\n{'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
