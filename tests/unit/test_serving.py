"""The runner's serving loop without a process: the node's messages fed to its
inbox, its `FromRunner` messages read back from the stream it writes, a real
tiny model behind either batch (`OneAtATime`, `ContinuousBatcher`)."""

import io
import queue
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.nn as nn
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.batch import Batch, BatchOutput, ContinuousBatcher, PromptProgress
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.one_at_a_time import OneAtATime
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.ring import PeerLost
from exo.shared.prefix_digests import DIGEST_TOKENS, prefix_digests
from exo.shared.prompt_images import PromptImage
from exo.shared.types.constraints import JsonSchema
from exo.shared.types.ids import TaskId
from exo.shared.types.tasks import GenerationParams
from exo.worker.runner.inbox import Inbox, StopRequested
from exo.worker.runner.protocol import (
    CacheStatsReport,
    Cancel,
    FromRunner,
    Generate,
    PrefillProgress,
    Shutdown,
    StatusChanged,
    TaskFailed,
    TaskFinished,
    TaskText,
    ToRunner,
    from_runner_adapter,
)
from exo.worker.runner.serving import Runner

GREEDY = GenerationParams(max_tokens=8, temperature=0)
BROKEN = JsonSchema(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
Loaded = tuple[nn.Module, TokenizerWrapper]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Loaded:
    return load_for_inference(tiny_model_dir)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40_000) for _ in range(n)]


def task(name: str, tokens: list[int], params: GenerationParams = GREEDY) -> Generate:
    return Generate(task_id=TaskId(name), tokens=tokens, params=params)


def generator(tiny: Loaded, cache: KVPrefixCache | None = None, chunk: int = 512) -> TextGenerator:
    model, tokenizer = tiny
    return TextGenerator(LocalModel(model, tokenizer), tokenizer, cache, prefill_step_tokens=chunk)


class ProtocolOut(io.StringIO):
    """The runner's protocol stream: its messages, each shown to `on_message` as
    it is written."""

    def __init__(self, on_message: Callable[[FromRunner], None] = lambda message: None) -> None:
        super().__init__()
        self.messages: list[FromRunner] = []
        self._on_message = on_message

    def write(self, s: str, /) -> int:
        for line in s.splitlines():
            message = from_runner_adapter.validate_json(line)
            self.messages.append(message)
            self._on_message(message)
        return super().write(s)

    @property
    def ended(self) -> int:
        return sum(isinstance(m, TaskFinished | TaskFailed) for m in self.messages)


Node = queue.Queue[ToRunner | None]  # what the node sends, read by the runner's inbox


def serve_until(
    make_batch: Callable[[Runner], Batch],
    messages: Sequence[ToRunner],
    tasks_ended: int,
    on_message: Callable[[Node, FromRunner], None] = lambda node, message: None,
) -> list[FromRunner]:
    """Serve `messages`; the node asks to stop once `tasks_ended` tasks ended.
    `on_message` sees each message as the runner writes it, and may answer it."""
    node: Node = queue.Queue()
    for message in messages:
        node.put(message)
    out = ProtocolOut(lambda message: on_message(node, message))
    runner = Runner(out, Inbox(node))

    def keep_alive() -> None:
        if out.ended >= tasks_ended:
            node.put(Shutdown())

    with pytest.raises(StopRequested):
        runner.serve(make_batch(runner), keep_alive)
    return out.messages


def one_at_a_time(tiny: Loaded, chunk: int = 512) -> Callable[[Runner], Batch]:
    def make(runner: Runner) -> Batch:
        return OneAtATime(
            generator(tiny, KVPrefixCache(1 << 30), chunk),
            runner.report_progress,
            runner.is_cancelled,
        )

    return make


def continuous(tiny: Loaded) -> Callable[[Runner], Batch]:
    return lambda runner: ContinuousBatcher(generator(tiny, KVPrefixCache(1 << 30)))


def of_task(messages: list[FromRunner], name: str) -> list[FromRunner]:
    return [m for m in messages if getattr(m, "task_id", None) == name]


def statuses(messages: list[FromRunner]) -> list[str]:
    return [m.status for m in messages if isinstance(m, StatusChanged)]


@pytest.mark.parametrize("batch", ["one_at_a_time", "continuous"])
def test_either_batch_serves_tasks_in_the_one_loop(tiny: Loaded, batch: str) -> None:
    prompts = {"a": prompt(30, seed=1), "b": prompt(20, seed=2)}
    make = one_at_a_time(tiny) if batch == "one_at_a_time" else continuous(tiny)
    unknown = Cancel(task_id=TaskId("nobody"))  # a cancel for no task of ours: ignored
    messages = serve_until(make, [task("a", prompts["a"]), unknown, task("b", prompts["b"])], 2)

    for name, tokens in prompts.items():
        mine = of_task(messages, name)
        assert mine[0] == PrefillProgress(task_id=TaskId(name), done=0, total=len(tokens) - 1)
        assert (
            PrefillProgress(task_id=TaskId(name), done=len(tokens) - 1, total=len(tokens) - 1)
            in mine
        )
        finished = mine[-1]
        assert isinstance(finished, TaskFinished)
        assert finished.usage.completion_tokens == GREEDY.max_tokens
        text = "".join(m.text for m in mine if isinstance(m, TaskText))
        if batch == "one_at_a_time":  # exactly `generate`'s reply
            outputs = list(generator(tiny).generate(tokens, GREEDY))
            assert text == "".join(o.text for o in outputs if isinstance(o, TextDelta))
            assert outputs[-1] == Finished(finished.finish_reason, finished.usage)
    expected = ["running", "ready"] * 2 if batch == "one_at_a_time" else ["running", "ready"]
    assert statuses(messages) == expected
    # Every task's end reports the cache's stats, right after it.
    ends = [i for i, m in enumerate(messages) if isinstance(m, TaskFinished)]
    assert all(isinstance(messages[i + 1], StatusChanged | CacheStatsReport) for i in ends)
    assert isinstance(messages[-1], CacheStatsReport)
    assert messages[-1].stats.entries == 2


def test_a_prompt_being_served_is_reported_as_cached_from_its_start(tiny: Loaded) -> None:
    """Routing sends a session's next turn where its prompt is cached; the
    turn may come the moment this reply ends, before a report from its end
    reached the node it comes to."""
    tokens = prompt(3 * DIGEST_TOKENS + 5, seed=3)
    messages = serve_until(continuous(tiny), [task("a", tokens)], 1)
    first_text = next(i for i, m in enumerate(messages) if isinstance(m, TaskText))
    reports = [m for m in messages[:first_text] if isinstance(m, CacheStatsReport)]
    assert reports, "no cache report before the reply began"
    assert set(prefix_digests(tokens)) <= set(reports[-1].summary)
    assert reports[-1].stats.entries == 0  # (nothing cached yet)
    last = messages[-1]
    assert isinstance(last, CacheStatsReport) and set(prefix_digests(tokens)) <= set(last.summary)


@pytest.mark.parametrize("batch", ["one_at_a_time", "continuous"])
def test_a_cancelled_task_and_a_bad_request_fail_alone(tiny: Loaded, batch: str) -> None:
    def cancel_a_once_it_writes(node: Node, message: FromRunner) -> None:
        if isinstance(message, TaskText) and message.task_id == "a":
            node.put(Cancel(task_id=TaskId("a")))

    long = GenerationParams(max_tokens=200, temperature=0)
    bad = GenerationParams(max_tokens=4, temperature=0, constraint=BROKEN)
    make = one_at_a_time(tiny) if batch == "one_at_a_time" else continuous(tiny)
    messages = serve_until(
        make,
        [task("a", prompt(10, 1), long), task("b", prompt(10, 2), bad), task("c", prompt(10, 3))],
        3,
        cancel_a_once_it_writes,
    )
    assert of_task(messages, "a")[-1] == TaskFailed(task_id=TaskId("a"), error="cancelled")
    [failed_b] = of_task(messages, "b")[-1:]
    assert isinstance(failed_b, TaskFailed)
    assert failed_b.error.startswith("invalid constraint: ")
    assert isinstance(of_task(messages, "c")[-1], TaskFinished)
    assert statuses(messages)[-1] == "ready"


def test_a_stop_during_a_long_prefill_is_read_between_its_chunks(tiny: Loaded) -> None:
    def stop_once_prefill_starts(node: Node, message: FromRunner) -> None:
        if isinstance(message, PrefillProgress) and message.done > 0:
            node.put(Shutdown())

    messages = serve_until(
        one_at_a_time(tiny, chunk=16), [task("a", prompt(100, 1))], 1, stop_once_prefill_starts
    )
    progress = [m.done for m in messages if isinstance(m, PrefillProgress)]
    assert progress == [0, 16]  # stopped before the next chunk
    assert not [m for m in messages if isinstance(m, TaskText | TaskFinished | TaskFailed)]


class LostRing:
    """A pipeline rank's batch whose ring is gone at the first step."""

    max_batch = 1
    idle = False
    prefix_cache = None

    def add(
        self,
        task_id: str,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        images: Sequence[PromptImage] = (),
    ) -> PromptProgress | None:
        return None

    def cancel(self, task_id: str) -> bool:
        return False

    def step(self) -> list[tuple[str, BatchOutput]]:
        raise PeerLost("rank 1 closed its connection")


def test_a_lost_pipeline_fails_every_task_as_runner_lost_and_ends_the_loop() -> None:
    node: Node = queue.Queue()
    for name in ("a", "b"):
        node.put(task(name, [1, 2, 3]))
    out = ProtocolOut()
    with pytest.raises(PeerLost):
        Runner(out, Inbox(node)).serve(LostRing(), keep_alive=lambda: None)
    failed = [m for m in out.messages if isinstance(m, TaskFailed)]
    assert [(m.task_id, m.runner_lost) for m in failed] == [("a", True), ("b", True)]
    assert failed[0].error == "rank 1 closed its connection"


def test_a_rank_that_takes_no_tasks_fails_them_at_once() -> None:
    node: Node = queue.Queue()
    node.put(task("a", [1, 2, 3]))
    out = ProtocolOut()
    runner = Runner(out, Inbox(node))
    runner.refuse_tasks()
    assert out.messages == [
        TaskFailed(task_id=TaskId("a"), error="only rank 0 of a pipeline takes tasks")
    ]
    node.put(None)  # the end of stdin
    with pytest.raises(StopRequested):
        runner.refuse_tasks()
