"""Pipeline-parallel inference: real runner processes joined by a real
`mx.distributed` ring over loopback, driven through the runner protocol (or, to
look inside every rank, the engine run directly by `tests.pipeline_rank`)."""

import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from exo.engine.mlx.load import load_model_tokenizer
from exo.engine.mlx.ring_agreements import IDLE_SILENCE_SECONDS
from exo.shared.types.constraints import JsonSchema
from exo.shared.types.tasks import GenerationParams, SampledLogprob, Usage
from exo.worker.runner.protocol import FromRunner, TaskFinished, TaskText
from tests.constraint_examples import PERSON, WEATHER_ARGUMENTS, WEATHER_CALL
from tests.model_factory import make_tiny_llama
from tests.pipeline_harness import (
    REPO_ROOT,
    Pipeline,
    even_bounds,
    rank_environment,
    running_pipeline,
    wait_until,
    write_hostfile,
)

TINY_LAYERS = 6
SMOLLM_LAYERS = 30
GREEDY = GenerationParams(max_tokens=24, temperature=0.0)
SAMPLED = GenerationParams(max_tokens=24, temperature=1.0, seed=7)
# Longer than one prefill chunk (512 tokens), so ranks overlap on chunks.
LONG_PROMPT = list(range(100, 800))
HIT_PROMPT = [*LONG_PROMPT[:650], 11, 12, 13]
# The tiny model's greedy output never reaches EOS (it repeats one word), so a
# task with this budget decodes until it is cancelled or its pipeline breaks.
ENDLESS = GenerationParams(max_tokens=1_000_000, temperature=0.0)
# A killed rank fails the entry's task: the bound asserted and the wait (longer, so
# that a slow machine fails on the assertion, with the time it took). Seen: 0.0-1.1 s,
# the dead rank's connection closing at once.
FAILED_WITHIN_S = 5.0
FAILURE_WAIT_S = 30.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny6") / "tiny-llama-6", smollm_dir, n_layers=TINY_LAYERS
    )


def layer_ranges(layers: int, ranks: int) -> list[tuple[int, int]]:
    bounds = even_bounds(layers, ranks)
    return list(itertools.pairwise(bounds))


def run_requests(pipeline: Pipeline) -> list[tuple[str, Usage]]:
    entry = pipeline.entry
    return [
        entry.generate("greedy", LONG_PROMPT, GREEDY),
        entry.generate("sampled", LONG_PROMPT, SAMPLED),
        entry.generate("hit", HIT_PROMPT, GREEDY),
    ]


def is_chunk_of(task_id: str) -> Callable[[FromRunner], bool]:
    return lambda message: isinstance(message, TaskText) and message.task_id == task_id


@pytest.mark.slow
def test_tiny_pipelines_generate_what_one_runner_does(tiny_dir: Path, tmp_path: Path) -> None:
    outputs: dict[int, list[tuple[str, Usage]]] = {}
    for ranks in (1, 2, 3):
        with running_pipeline(tiny_dir, tmp_path, even_bounds(TINY_LAYERS, ranks)) as pipeline:
            outputs[ranks] = run_requests(pipeline)
        # Stopped through rank 0: every rank reports "stopped" and exits cleanly.
        assert [r.process.returncode for r in pipeline.ranks] == [0] * ranks
        assert [r.statuses[-1].status for r in pipeline.ranks] == ["stopped"] * ranks
    assert outputs[2] == outputs[1]
    assert outputs[3] == outputs[1]
    assert outputs[1][2][1].cached_tokens == 650


def test_a_bad_constraint_fails_only_its_task_and_logprobs_cross_the_ring(
    tiny_dir: Path, tmp_path: Path
) -> None:
    broken = JsonSchema(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with running_pipeline(tiny_dir, tmp_path, even_bounds(TINY_LAYERS, 2)) as pipeline:
        entry = pipeline.entry
        entry.submit("broken", LONG_PROMPT[:20], GREEDY.model_copy(update={"constraint": broken}))
        failed = entry.collect("broken", 30).failed
        assert failed is not None and failed.error.startswith("invalid constraint:")
        # Rank 0 refused it before the ring saw it: the next task runs.
        params = GREEDY.model_copy(update={"logprobs": True, "top_logprobs": 3})
        entry.submit("after", LONG_PROMPT[:20], params)
        result = entry.collect("after", 60)
        assert result.finished is not None, result.failed
        chunks = [m for m in result.messages if isinstance(m, TaskText)]
        logprobs = [e for c in chunks if c.logprobs for e in c.logprobs.tokens]
        assert len(logprobs) == result.finished.usage.completion_tokens == GREEDY.max_tokens
        assert all(
            len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in logprobs
        )


def test_cancel_stops_every_rank_and_the_others_batched_with_it_go_on(
    tiny_dir: Path, tmp_path: Path
) -> None:
    with running_pipeline(tiny_dir, tmp_path, even_bounds(TINY_LAYERS, 2)) as pipeline:
        entry, follower = pipeline.ranks
        entry.submit("endless", LONG_PROMPT[:50], ENDLESS)
        entry.submit("beside", LONG_PROMPT[:60], GREEDY.model_copy(update={"max_tokens": 40}))
        entry.wait_for(is_chunk_of("endless"), 30)
        entry.wait_for(is_chunk_of("beside"), 30)
        entry.cancel("endless")
        cancelled, beside = entry.collect_all(["endless", "beside"], 30)
        assert cancelled.failed is not None and cancelled.failed.error == "cancelled"
        # The request decoding beside it is not disturbed, and the ranks are in
        # step again: the next task runs.
        assert beside.finished is not None and beside.finished.usage.completion_tokens == 40
        text, usage = entry.generate("after", LONG_PROMPT[:40], GREEDY)
        assert text and usage.completion_tokens == GREEDY.max_tokens
        statuses = lambda: [s.status for s in follower.statuses]  # noqa: E731
        wait_until(lambda: statuses()[-1] == "ready", 10, "the follower to finish the task")
        assert statuses().count("running") == 2


@pytest.mark.slow
def test_every_rank_keeps_its_cache_entries_intact_and_evicts_with_the_others(
    tiny_dir: Path, tmp_path: Path
) -> None:
    unrelated = list(range(5000, 5300))
    prompts = [LONG_PROMPT, HIT_PROMPT, LONG_PROMPT, unrelated, HIT_PROMPT]
    requests = [{"tokens": p, "params": GREEDY.model_dump()} for p in prompts]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    # Cold references: one runner, prefix cache off.
    with running_pipeline(tiny_dir, tmp_path, [0, TINY_LAYERS], prefix_cache_bytes=0) as single:
        cold = [single.entry.generate(f"cold-{i}", p, GREEDY) for i, p in enumerate(prompts)]

    # Rank 0's budget (512 bytes a token) holds the 700-token prompt and its reply with
    # a branch off it, not the unrelated prompt too; the others' holds everything:
    # rank 0's evictions must happen on every rank.
    budgets = [450_000, 1 << 30, 1 << 30]
    hostfile = write_hostfile(tmp_path, 3)
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.pipeline_rank",
                "--model-dir",
                str(tiny_dir),
                "--start-layer",
                str(start),
                "--end-layer",
                str(end),
                "--byte-budget",
                str(budgets[rank]),
                "--requests",
                str(tmp_path / "requests.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / f"engine-rank-{rank}.log").open("wb"),
            env=rank_environment(tmp_path, hostfile, rank),
            cwd=REPO_ROOT,
        )
        for rank, (start, end) in enumerate(layer_ranges(TINY_LAYERS, 3))
    ]
    reports = []
    for rank, process in enumerate(processes):
        out, _ = process.communicate(timeout=180)
        log = (tmp_path / f"engine-rank-{rank}.log").read_text()[-3000:]
        assert process.returncode == 0, log
        reports.append(json.loads(out.decode().strip().splitlines()[-1]))

    results = reports[0]["results"]
    # The hit path generates what the cold path does.
    assert [r["text"] for r in results] == [text for text, _ in cold]
    assert [r["usage"]["completion_tokens"] for r in results] == [
        u.completion_tokens for _, u in cold
    ]
    assert [r["usage"]["cached_tokens"] for r in results] == [0, 650, 699, 0, 0]
    for report in reports:
        assert report["unchanged"] == [True] * len(prompts)
        assert report["entries"] == reports[0]["entries"]  # same entries, task after task
        assert report["stats"]["evictions"] == reports[0]["stats"]["evictions"] > 0


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_killed_rank_fails_the_task_and_every_rank_exits(
    tiny_dir: Path, tmp_path: Path, victim: int
) -> None:
    with running_pipeline(tiny_dir, tmp_path, even_bounds(TINY_LAYERS, 3)) as pipeline:
        entry = pipeline.entry
        entry.submit("doomed", LONG_PROMPT[:50], ENDLESS)
        entry.submit("queued", LONG_PROMPT[:60], GREEDY)
        entry.wait_for(is_chunk_of("doomed"), 30)
        pipeline.ranks[victim].process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        if victim != 0:
            doomed = entry.collect("doomed", FAILURE_WAIT_S)
            assert doomed.failed is not None
            assert "a rank left the pipeline group" in doomed.failed.error
            failed_after = time.monotonic() - killed_at
            print(f"rank {victim} killed: the task failed {failed_after:.1f}s later")
            assert failed_after < FAILED_WITHIN_S, f"failed after {failed_after:.1f}s"
            queued = entry.collect("queued", 5)
            assert queued.failed is not None
            assert "a rank left the pipeline group" in queued.failed.error
        for rank, runner in enumerate(pipeline.ranks):
            if rank == victim:
                continue
            code = runner.wait_exit(max(0.0, killed_at + 10 - time.monotonic()))
            assert code is not None and code != 0, f"rank {rank} did not fail in time"
            last = runner.statuses[-1]
            assert last.status == "failed"
            assert last.error and "a rank left the pipeline group" in last.error


def chat_tokens(model_dir: Path, *turns: str) -> list[int]:
    tokenizer = load_model_tokenizer(model_dir)
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert isinstance(tokens, list)
    return tokens


@pytest.mark.slow
def test_smollm_pipelines_generate_what_one_runner_does(smollm_dir: Path, tmp_path: Path) -> None:
    question = chat_tokens(smollm_dir, "What is the capital of France?")
    outputs: dict[int, list[tuple[str, Usage]]] = {}
    for ranks in (1, 2, 3):
        bounds = even_bounds(SMOLLM_LAYERS, ranks)
        with running_pipeline(smollm_dir, tmp_path, bounds) as pipeline:
            entry = pipeline.entry
            answer, usage = entry.generate("question", question, GREEDY)
            follow_up = chat_tokens(
                smollm_dir, "What is the capital of France?", answer, "And of Italy?"
            )
            outputs[ranks] = [(answer, usage), entry.generate("follow-up", follow_up, GREEDY)]
    assert "Paris" in outputs[1][0][0]

    def without_cached(turns: list[tuple[str, Usage]]) -> list[tuple[str, int, int]]:
        return [(text, u.prompt_tokens, u.completion_tokens) for text, u in turns]

    for ranks in (2, 3):
        assert without_cached(outputs[ranks]) == without_cached(outputs[1])
        # A single runner decodes one step ahead, so it also holds (and stores) the
        # KV of the reply's end-of-turn token; rank 0 of a pipeline never forwards
        # it, so the follow-up reuses at most one token less there.
        local, piped = outputs[1][1][1].cached_tokens, outputs[ranks][1][1].cached_tokens
        assert local - 1 <= piped <= local
    assert outputs[3][1][1].cached_tokens >= len(question) - 1


@pytest.mark.slow
def test_a_silent_rank_fails_the_group_within_the_idle_bound(
    tiny_dir: Path, tmp_path: Path
) -> None:
    with running_pipeline(tiny_dir, tmp_path, even_bounds(TINY_LAYERS, 2)) as pipeline:
        entry, follower = pipeline.ranks
        # Only rank 0 takes tasks; one sent to another rank fails at once.
        follower.submit("misrouted", LONG_PROMPT[:10], GREEDY)
        misrouted = follower.collect("misrouted", 10)
        assert misrouted.failed is not None and "only rank 0" in misrouted.failed.error
        # A hung (not dead) rank: its sockets stay open, so only the bound on
        # rank 0's heartbeat round notices.
        follower.process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            code = entry.wait_exit(IDLE_SILENCE_SECONDS + 10)
            assert code not in (None, 0)
            assert time.monotonic() - stopped_at >= IDLE_SILENCE_SECONDS - 1
            last = entry.statuses[-1]
            assert last.status == "failed" and last.error and "sent nothing" in last.error
        finally:
            follower.process.send_signal(signal.SIGCONT)
        assert follower.wait_exit(10) not in (None, 0)


@pytest.mark.slow
def test_constraints_logprobs_and_stop_strings_act_where_the_last_rank_samples(
    smollm_dir: Path, tmp_path: Path
) -> None:
    person = chat_tokens(smollm_dir, "Describe a person as JSON.")
    weather = chat_tokens(smollm_dir, "What is the weather in Paris?")
    capital = chat_tokens(smollm_dir, "What is the capital of France?")
    greedy = GenerationParams(max_tokens=40, temperature=0.0)
    requests = {
        "json": (
            person,
            greedy.model_copy(
                update={
                    "constraint": JsonSchema(json_schema=PERSON),
                    "logprobs": True,
                    "top_logprobs": 2,
                }
            ),
        ),
        "tool": (weather, greedy.model_copy(update={"constraint": WEATHER_CALL})),
        "stop": (capital, greedy.model_copy(update={"stop": ("Paris",), "logprobs": True})),
    }
    replies: dict[int, dict[str, tuple[str, list[SampledLogprob], TaskFinished]]] = {}
    for ranks in (1, 2):
        with running_pipeline(smollm_dir, tmp_path, even_bounds(SMOLLM_LAYERS, ranks)) as pipeline:
            replies[ranks] = {}
            for task_id, (tokens, params) in requests.items():
                pipeline.entry.submit(task_id, tokens, params)
                result = pipeline.entry.collect(task_id, 120)
                assert result.finished is not None, result.failed
                chunks = [m for m in result.messages if isinstance(m, TaskText)]
                logprobs = [e for c in chunks if c.logprobs for e in c.logprobs.tokens]
                replies[ranks][task_id] = (result.text, logprobs, result.finished)
    # The same tokens, logprobs and endings (greedy) whether one process samples or the last rank.
    assert replies[2] == replies[1]

    text, logprobs, finished = replies[2]["json"]
    jsonschema.validate(json.loads(text), PERSON)
    assert finished.finish_reason == "stop"
    assert len(logprobs) == finished.usage.completion_tokens - 1  # the EOS is not reported
    # Greedy: the drawn token leads its alternatives (the mask's rejects are left out).
    assert all(1 <= len(entry.top_logprobs) <= 2 for entry in logprobs)
    assert all(entry.top_logprobs[0].token == entry.token for entry in logprobs)

    text, logprobs, finished = replies[2]["tool"]
    assert text.startswith(WEATHER_CALL.prefix) and text.endswith(WEATHER_CALL.suffix)
    call = json.loads(text.removeprefix(WEATHER_CALL.prefix).removesuffix(WEATHER_CALL.suffix))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER_ARGUMENTS)
    assert logprobs == []

    text, logprobs, finished = replies[2]["stop"]
    assert "Paris" not in text
    assert (finished.finish_reason, finished.stop_sequence) == ("stop", "Paris")
    assert len(logprobs) == finished.usage.completion_tokens
