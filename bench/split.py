"""Split instances on loopback: single-stream decode tokens/s of one rank, of 2
pipeline ranks and of 2 tensor ranks, and the aggregate tokens/s of 4 streams on
each kind of split instance, for the built-in model and a tiny mixture of
experts, in one run.

Each instance is real runner processes on an `mx.distributed` ring over
127.0.0.1 (the tests' harness, as `bench/pipeline.py`); the instances of a
model stay up together and take turns each round, so a slower minute of a
shared machine hits all alike. Decode: (completion tokens - 1) / (last chunk -
first chunk) of a greedy story, medians over the rounds (quiet ones when any).
4 streams: the sum of 4 concurrent greedy stories' completion tokens over the
time from the first chunk of any to the last chunk of all.

Targets on this machine: 2 pipeline ranks >= 0.95 x one rank, 2 tensor ranks
>= 0.8 x one rank, 4 streams on 2 pipeline ranks >= 2 x one stream there. Both ranks share one machine's cores here, so this measures
the split's overhead, not a speedup: on two machines each rank has its own
memory bandwidth and compute (a tensor rank reads half of every layer's
weights per token), which is what tensor parallelism buys over a fast link.
The built-in model (9 attention heads, 3 KV heads) splits in 2 tensor ranks
unevenly: 2 KV heads (6 query heads) and 1 (3).


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

from mlx_lm.tokenizer_utils import TokenizerWrapper
from pipeline import STORY, Run, chat, measure

from exo.engine.mlx.load import load_model_tokenizer
from exo.engine.mlx.shard import model_layer_count
from exo.models.builtin import DEFAULT_MODEL_ID, ensure_default_model
from exo.models.store import model_dir
from exo.shared.types.tasks import GenerationParams
from tests.model_factory import make_tiny_model
from tests.pipeline_harness import Pipeline, even_bounds, running_pipeline

TARGET = 0.95
TENSOR_TARGET = 0.8
STREAMS_TARGET = 2.0


# Instance kinds: (label, pipeline ranks' layer bounds or None for tensor, tensor ranks).
KINDS = ("1 rank", "2 pipeline ranks", "2 tensor ranks")
STREAMS = 4


def decode_speeds(model: Path, work: Path, rounds: int, max_tokens: int) -> dict[str, float]:
    """Median decode tokens/s of each kind of instance, and the aggregate of
    `STREAMS` streams on each split kind."""
    layers = model_layer_count(model)
    tokenizer = load_model_tokenizer(model)
    kinds = KINDS
    runs: dict[str, list[Run]] = {kind: [] for kind in kinds}
    streams: dict[str, list[float]] = {kind: [] for kind in kinds[1:]}
    with ExitStack() as stack:
        instances = {
            kind: stack.enter_context(
                running_pipeline(
                    model,
                    work,
                    even_bounds(layers, 2 if kind == KINDS[1] else 1),
                    ready_timeout=300,
                    tensor_ranks=2 if kind == KINDS[2] else 0,
                )
            )
            for kind in kinds
        }
        warm_up = chat(tokenizer, [{"role": "user", "content": STORY}])
        for instance in instances.values():
            measure(instance, "warm-up", warm_up, 8)
        for i in range(rounds):
            story = chat(tokenizer, [{"role": "user", "content": f"Story {i + 1}. {STORY}"}])
            for kind in kinds if i % 2 == 0 else reversed(kinds):
                label = f"{model.name}: {kind}, story {i + 1}"
                runs[kind].append(
                    measure(instances[kind], f"story-{i}-{kind}", story, max_tokens, label)
                )
            for kind, measured in streams.items():
                measured.append(aggregate(instances[kind], kind, tokenizer, i, max_tokens))
    speeds = {
        kind: statistics.median(
            r.decode_tps for r in ([r for r in measured if r.quiet] or measured)
        )
        for kind, measured in runs.items()
    }
    for kind, measured in streams.items():
        speeds[f"{STREAMS} streams on {kind}"] = statistics.median(measured)
    return speeds


def aggregate(
    instance: Pipeline, kind: str, tokenizer: TokenizerWrapper, round: int, max_tokens: int
) -> float:
    """Tokens/s of `STREAMS` greedy stories decoded together."""
    entry = instance.entry
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0, stop=())
    task_ids = [f"streams-{kind}-{round}-{n}" for n in range(STREAMS)]
    for n, task_id in enumerate(task_ids):
        story = chat(tokenizer, [{"role": "user", "content": f"Tale {round}-{n}. {STORY}"}])
        entry.submit(task_id, story, params)
    results = entry.collect_all(task_ids, 600)
    tokens = sum(r.finished.usage.completion_tokens for r in results if r.finished)
    first = min(t for r in results for t in r.text_times)
    last = max(t for r in results for t in r.text_times)
    tps = tokens / (last - first)
    print(f"  {STREAMS} streams on {kind}, round {round + 1}: {tps:5.2f} tok/s", flush=True)
    return tps


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
        one = speed[KINDS[0]]
        print(f"  {name}: " + ", ".join(f"{kind} {tps:.2f}" for kind, tps in speed.items()))
        for kind, target in ((KINDS[1], TARGET), (KINDS[2], TENSOR_TARGET)):
            if kind in speed:
                ratio = speed[kind] / one
                met &= ratio >= target
                print(f"    {kind}: {ratio:.2f} x one rank (target >= {target})")
            streams = f"{STREAMS} streams on {kind}"
            if streams in speed:
                ratio = speed[streams] / speed[kind]
                pipeline = kind == KINDS[1]
                met &= not pipeline or ratio >= STREAMS_TARGET
                goal = f" (target >= {STREAMS_TARGET})" if pipeline else ""
                print(f"    {streams}: {ratio:.2f} x one stream there{goal}")
    print(f"\n{'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
