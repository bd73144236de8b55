"""Pipeline-parallel inference on loopback: TTFT and decode speed for 1, 2 and 3
ranks, and the prefix cache's TTFT on a 2-rank instance, all in one run.

Each instance is N real runner processes (`exo.worker.runner.runner_main`, with
OpenBLAS preloaded as the node does) on an `mx.distributed` ring over
127.0.0.1, layers split evenly, driven through the runner protocol. The three
instances stay up together and take turns, so a slower minute of a shared
machine hits every rank count alike.

* decode: a new story prompt each round, `temperature 0`, `--max-tokens` tokens;
  (completion tokens - 1) / (last chunk - first chunk). TTFT: submit -> first text.
* cache (2 ranks, and 1 for reference): a ~2,000-token prompt of random records
  (cold), then the same conversation plus the answer and a new ~100-token user
  message (a hit: only the new suffix is prefilled).

Targets: 2-rank decode >= 0.8 x 1-rank decode; hit TTFT <= 0.1 x cold TTFT; and
the 2- and 3-rank greedy texts equal the 1-rank ones. Exit status 0 when met.

    uv run python bench/pipeline.py
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' runner harness

import psutil
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.load import load_model_tokenizer
from exo.models.builtin import DEFAULT_MODEL_ID, ensure_default_model
from exo.models.store import model_dir
from exo.shared.types.tasks import GenerationParams
from exo.worker.runner.protocol import TaskFailed, TaskFinished, TaskText
from tests import pipeline_harness
from tests.pipeline_harness import Pipeline, even_bounds, running_pipeline

LAYERS = 30  # SmolLM2-135M
DECODE_TARGET = 0.8
# A run counts as quiet when other processes kept at most this many cores busy.
QUIET_OTHER_CORES = 0.15
CACHE_TARGET = 0.1
STORY = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the village and every character in detail."
)
_PLACES = ("Oslo", "Lima", "Quito", "Hanoi", "Dakar", "Perth", "Bergen", "Porto", "Zagreb")
_THINGS = ("bridge", "tower", "library", "harbour", "mill", "chapel", "market", "lighthouse")


@dataclass
class Run:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    decode_tps: float
    text: str
    other_cores: float  # busy cores outside the ranks meanwhile

    @property
    def quiet(self) -> bool:
        return self.other_cores <= QUIET_OTHER_CORES


def measure(
    pipeline: Pipeline, task_id: str, tokens: list[int], max_tokens: int, label: str = ""
) -> Run:
    """One request; with a `label` its figures are printed, with the cores other
    processes than the ranks kept busy meanwhile (a shared machine skews them)."""
    runner = pipeline.entry
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0, stop=())
    ranks = [psutil.Process(r.process.pid) for r in pipeline.ranks]
    ranks_cpu, machine_cpu = _cpu(ranks), psutil.cpu_times()
    started = time.monotonic()
    runner.submit(task_id, tokens, params)
    deadline = started + 600
    chunk_times: list[float] = []
    text = ""
    while True:
        message = runner.next_message(deadline)
        if getattr(message, "task_id", None) != task_id:
            continue
        if isinstance(message, TaskText) and message.text:
            chunk_times.append(time.monotonic())
            text += message.text
        elif isinstance(message, TaskFailed):
            raise RuntimeError(f"task failed: {message.error}")
        elif isinstance(message, TaskFinished):
            usage = message.usage
            break
    elapsed = time.monotonic() - started
    now = psutil.cpu_times()
    machine_busy = (now.user + now.system) - (machine_cpu.user + machine_cpu.system)
    other_cores = (machine_busy - (_cpu(ranks) - ranks_cpu)) / elapsed
    span = chunk_times[-1] - chunk_times[0] if len(chunk_times) > 1 else 0.0
    run = Run(
        ttft=chunk_times[0] - started,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        decode_tps=(usage.completion_tokens - 1) / span if span else 0.0,
        text=text,
        other_cores=other_cores,
    )
    if label:
        print(
            f"  {label:<24} TTFT {run.ttft:6.2f} s  prompt {run.prompt_tokens:5d}  "
            f"cached {run.cached_tokens:5d}  completion {run.completion_tokens:4d}  "
            f"decode {run.decode_tps:5.2f} tok/s  other cores {other_cores:4.2f}",
            flush=True,
        )
    return run


def _cpu(processes: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


def chat(tokenizer: TokenizerWrapper, messages: list[dict[str, str]]) -> list[int]:
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert isinstance(tokens, list)
    return tokens


def records(tokenizer: TokenizerWrapper, rng: random.Random, header: str, tokens: int) -> str:
    """Random records after `header`, about `tokens` tokens long."""
    lines = [header]
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < tokens:
        lines.append(
            f"Record {len(lines)}: the {rng.choice(_THINGS)} of {rng.choice(_PLACES)} was "
            f"rebuilt in {rng.randint(1600, 2024)}, {rng.randint(2, 950)} meters from the "
            f"{rng.choice(_THINGS)}."
        )
    return "\n".join(lines)


def cache_conversation(
    pipeline: Pipeline, tokenizer: TokenizerWrapper, seed: int, prompt: int, suffix: int
) -> tuple[Run, Run]:
    rng = random.Random(seed)
    document = records(tokenizer, rng, f"Archive {seed}. Questions follow.", prompt - 40)
    first = [{"role": "user", "content": document + "\n\nWhich record mentions Oslo first?"}]
    cold = measure(pipeline, f"cold-{seed}", chat(tokenizer, first), 8, f"{seed} rank(s), cold")
    later = records(tokenizer, rng, "A few more records, added later:", suffix - 55)
    second = [
        *first,
        {"role": "assistant", "content": cold.text},
        {"role": "user", "content": later + "\nWhich of these new records is the oldest?"},
    ]
    return cold, measure(
        pipeline, f"hit-{seed}", chat(tokenizer, second), 8, f"{seed} rank(s), hit"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="pipeline-parallel inference benchmark")
    parser.add_argument("--models-dir", type=Path, help="a folder holding the imported model")
    parser.add_argument("--max-tokens", type=int, default=128, help="decode length")
    parser.add_argument("--rounds", type=int, default=5, help="decode runs per instance")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--suffix-tokens", type=int, default=100)
    parser.add_argument(
        "--openblas-thread-timeout",
        default=pipeline_harness.OPENBLAS_THREAD_TIMEOUT,
        help="log2 cycles OpenBLAS threads spin before sleeping; 'default': OpenBLAS's own",
    )
    args = parser.parse_args()
    timeout = args.openblas_thread_timeout
    pipeline_harness.OPENBLAS_THREAD_TIMEOUT = None if timeout == "default" else timeout

    rank_counts = (1, 2, 3)
    with tempfile.TemporaryDirectory(prefix="exo-bench-pipeline-") as temp, ExitStack() as stack:
        work = Path(temp)
        models = args.models_dir or work / "models"
        ensure_default_model(models)
        smollm = model_dir(models, DEFAULT_MODEL_ID)
        tokenizer = load_model_tokenizer(smollm)
        # All instances stay up and take turns, so a slower minute of a shared
        # machine hits every rank count alike.
        pipelines = {
            ranks: stack.enter_context(
                running_pipeline(smollm, work, even_bounds(LAYERS, ranks), ready_timeout=300)
            )
            for ranks in rank_counts
        }
        warm_up = chat(tokenizer, [{"role": "user", "content": STORY}])
        for pipeline in pipelines.values():
            measure(pipeline, "warm-up", warm_up, 8)
        runs: dict[int, list[Run]] = {ranks: [] for ranks in rank_counts}
        for i in range(args.rounds):
            # A new prompt each round (past the template's system prompt): a cold TTFT.
            story = chat(tokenizer, [{"role": "user", "content": f"Story {i + 1}. {STORY}"}])
            order = rank_counts[i % 3 :] + rank_counts[: i % 3]
            for ranks in order:
                label = f"{ranks} rank(s), story {i + 1}"
                runs[ranks].append(
                    measure(pipelines[ranks], f"story-{i}", story, args.max_tokens, label)
                )
        cache = {
            ranks: cache_conversation(
                pipelines[ranks], tokenizer, ranks, args.prompt_tokens, args.suffix_tokens
            )
            for ranks in (1, 2)
        }
    decode: dict[int, float] = {}
    ttft: dict[int, float] = {}
    for ranks, measured in runs.items():
        counted = [r for r in measured if r.quiet] or measured  # all, if none was quiet
        decode[ranks] = statistics.median(r.decode_tps for r in counted)
        ttft[ranks] = statistics.median(r.ttft for r in counted)
    texts = {ranks: [r.text for r in measured] for ranks, measured in runs.items()}

    print("\nsummary (medians of the quiet story runs)")
    for ranks in rank_counts:
        print(
            f"  {ranks} rank(s): TTFT {ttft[ranks]:.2f} s, decode {decode[ranks]:.2f} tok/s "
            f"({decode[ranks] / decode[1]:.2f} x 1 rank)"
        )
    for ranks, (cold, hit) in cache.items():
        print(
            f"  {ranks} rank(s) cache: cold {cold.ttft:.2f} s, hit {hit.ttft:.2f} s "
            f"({hit.prompt_tokens - hit.cached_tokens} new tokens), hit/cold {hit.ttft / cold.ttft:.3f}"
        )
    same = texts[2] == texts[1] and texts[3] == texts[1]
    print(f"  greedy text of 2 and 3 ranks {'equals' if same else 'DIFFERS FROM'} 1 rank's")
    decode_ratio = decode[2] / decode[1]
    cold, hit = cache[2]
    cache_ratio = hit.ttft / cold.ttft
    met = same and decode_ratio >= DECODE_TARGET and cache_ratio <= CACHE_TARGET
    print(
        f"\n2-rank decode / 1-rank decode = {decode_ratio:.2f} (target >= {DECODE_TARGET}); "
        f"2-rank hit/cold TTFT = {cache_ratio:.3f} (target <= {CACHE_TARGET}): "
        f"{'met' if met else 'MISSED'}"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
