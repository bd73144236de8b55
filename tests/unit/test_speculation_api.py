"""Speculative decoding's plumbing around the engine: the node's switch down to
the runner, each API's `speculation` and chat's `prediction` into the runner's
params, and the drafts' counts back out in usage and metrics."""

import io
import json
import queue
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai.types
import pytest

from exo.api import anthropic, openai_translate, responses
from exo.api.admission import Admission, AdmissionLimits
from exo.api.anthropic_types import MessagesRequest
from exo.api.errors import APIError
from exo.api.generation import generation_params
from exo.api.metrics import ServingMetrics
from exo.api.openai_chat import completion_usage
from exo.api.openai_types import ChatCompletionRequest, CompletionRequest
from exo.api.reply_stream import ReplyFinished
from exo.api.responses_types import ResponsesRequest
from exo.engine.mlx.batch import BatchOutput, PromptProgress
from exo.engine.mlx.generate import Finished
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.models.chat_tokenizer import ChatTokenizer, load_chat_tokenizer
from exo.shared.prompt_images import PromptImage
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import InstanceId, ModelId, NodeId, TaskId
from exo.shared.types.state import Instance, InstanceRank
from exo.shared.types.tasks import GenerationParams, Usage
from exo.worker.runner.inbox import Inbox, StopRequested
from exo.worker.runner.protocol import (
    Generate,
    Shutdown,
    TaskFinished,
    ToRunner,
    from_runner_adapter,
)
from exo.worker.runner.runner_main import runner_command
from exo.worker.runner.serving import Runner
from exo.worker.runner.standby import Assignment, assignment
from exo.worker.runner.supervisor import RunnerSupervisor
from exo.worker.served_model import ServedModel
from tests.unit.test_instance_routes import LocalCluster

MODEL = ModelId("org/model")
PREDICTION = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> ChatTokenizer:
    return load_chat_tokenizer(smollm_dir)


def served(
    tokenizer: ChatTokenizer, tmp_path: Path, context_length: int = 2048, max_token_bytes: int = 64
) -> ServedModel:
    instance = Instance(
        instance_id=InstanceId("i"),
        model_id=MODEL,
        ranks=(InstanceRank(node_id=NodeId("n"), start_layer=0, end_layer=1),),
    )
    return ServedModel(
        model_id=MODEL,
        tokenizer=tokenizer,
        context_length=context_length,
        runner=RunnerSupervisor(instance, 0, tmp_path, 0, tmp_path),
        created=0,
        max_token_bytes=max_token_bytes,
    )


def chat(**fields: Any) -> ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return openai_translate.to_chat_request(ChatCompletionRequest.model_validate(body))


def test_a_prediction_reaches_the_runner_as_its_tokens(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    model = served(tokenizer, tmp_path)
    request = chat(prediction={"type": "content", "content": PREDICTION})
    params = generation_params(model, request, 10, None)
    assert params.prediction == tuple(tokenizer.encode(PREDICTION, add_special_tokens=False))
    assert params.speculation
    assert generation_params(model, chat(), 10, None).prediction == ()


@pytest.mark.parametrize(
    "max_token_bytes",
    [1, 1000],  # too long by its size alone, before tokenizing; by its tokens
)
def test_a_prediction_longer_than_the_context_is_a_400(
    tokenizer: ChatTokenizer, tmp_path: Path, max_token_bytes: int
) -> None:
    model = served(tokenizer, tmp_path, context_length=64, max_token_bytes=max_token_bytes)
    request = chat(prediction={"type": "content", "content": PREDICTION * 20})
    with pytest.raises(APIError) as caught:
        generation_params(model, request, 10, None)
    assert (caught.value.status, caught.value.param) == (400, "prediction")
    assert "context length (64 tokens)" in caught.value.message


MESSAGE = {"role": "user", "content": "Hi"}


def each_api(speculation: dict[str, bool]) -> list[ChatRequest]:
    """The same request with `speculation` through each API's translation."""
    return [
        chat(**speculation),
        openai_translate.completion_to_chat_request(
            CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **speculation})
        ),
        responses.to_chat_request(
            ResponsesRequest.model_validate({"model": "m", "input": "Hi", **speculation})
        ),
        anthropic.to_chat_request(
            MessagesRequest.model_validate(
                {"model": "m", "max_tokens": 8, "messages": [MESSAGE], **speculation}
            )
        ),
    ]


@pytest.mark.parametrize(
    ("speculation", "on"),
    [({}, True), ({"speculation": True}, True), ({"speculation": False}, False)],
)
def test_speculation_reaches_the_params_from_every_api(
    tokenizer: ChatTokenizer, tmp_path: Path, speculation: dict[str, bool], on: bool
) -> None:
    model = served(tokenizer, tmp_path)
    for request in each_api(speculation):
        assert generation_params(model, request, 10, None).speculation is on


def test_the_runner_command_turns_speculation_off_only_when_asked() -> None:
    on = runner_command(Path("/models/m"), 0, None)
    off = runner_command(Path("/models/m"), 0, None, speculation=False)
    assert "--no-speculation" not in on
    assert off == [*on, "--no-speculation"]
    # a standby process given the command runs it with the same arguments
    assert Assignment.model_validate(json.loads(assignment(off, {}))).argv[-1] == "--no-speculation"
    shown = subprocess.run(
        [sys.executable, "-m", "exo.worker.runner.runner_main", "--help"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert "--no-speculation draft no tokens" in " ".join(shown.split())


class RecordingBatch:
    """Finishes each task at the next step; keeps the params each was added with."""

    max_batch = 4
    prefix_cache: KVPrefixCache | None = None

    def __init__(self) -> None:
        self.params: list[GenerationParams] = []
        self._waiting: list[str] = []

    @property
    def idle(self) -> bool:
        return not self._waiting

    def add(
        self,
        task_id: str,
        tokens: Sequence[int],
        params: GenerationParams,
        system_prompt_length: int = 0,
        images: Sequence[PromptImage] = (),
    ) -> PromptProgress | None:
        self.params.append(params)
        self._waiting.append(task_id)
        return None

    def cancel(self, task_id: str) -> bool:
        return False

    def step(self) -> list[tuple[str, BatchOutput]]:
        usage = Usage(prompt_tokens=1, completion_tokens=1, cached_tokens=0)
        done: list[tuple[str, BatchOutput]] = [
            (task_id, Finished(finish_reason="stop", usage=usage)) for task_id in self._waiting
        ]
        self._waiting = []
        return done


@pytest.mark.parametrize("speculation", [True, False])
def test_a_runner_without_speculation_adds_every_task_without_it(speculation: bool) -> None:
    node: queue.Queue[ToRunner | None] = queue.Queue()
    params = GenerationParams(max_tokens=4, prediction=(1, 2, 3))
    node.put(Generate(task_id=TaskId("t"), tokens=[1, 2], params=params))
    out = io.StringIO()
    runner = Runner(out, Inbox(node), speculation=speculation)
    batch = RecordingBatch()

    def keep_alive() -> None:
        messages = [from_runner_adapter.validate_json(line) for line in out.getvalue().splitlines()]
        if any(isinstance(message, TaskFinished) for message in messages):
            node.put(Shutdown())

    with pytest.raises(StopRequested):
        runner.serve(batch, keep_alive)
    assert batch.params == [
        params if speculation else params.model_copy(update={"speculation": False})
    ]


DRAFTED = Usage(
    prompt_tokens=10,
    completion_tokens=20,
    cached_tokens=0,
    drafted_tokens=16,
    accepted_draft_tokens=12,
    accepted_prediction_tokens=9,
    rejected_prediction_tokens=4,
)


def test_chat_usage_reports_the_prediction_and_drafts() -> None:
    usage = completion_usage(ReplyFinished(finish_reason="stop", usage=DRAFTED))
    parsed = openai.types.CompletionUsage.model_validate(usage.model_dump())
    details = parsed.completion_tokens_details
    assert details is not None
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (9, 4)
    assert usage.model_dump()["completion_tokens_details"] == {
        "reasoning_tokens": 0,
        "accepted_prediction_tokens": 9,
        "rejected_prediction_tokens": 4,
        "drafted_tokens": 16,
        "accepted_draft_tokens": 12,
    }
    # present when nothing was predicted or drafted, as OpenAI sends them
    plain = Usage(prompt_tokens=10, completion_tokens=20, cached_tokens=0)
    details_dump = completion_usage(ReplyFinished(finish_reason="stop", usage=plain)).model_dump()
    assert details_dump["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    assert details_dump["completion_tokens_details"]["rejected_prediction_tokens"] == 0


def test_metrics_count_the_drafts_per_model() -> None:
    metrics = ServingMetrics({}, LocalCluster(), Admission(AdmissionLimits()))
    metrics.observer(MODEL).finished("stop", DRAFTED)
    metrics.observer(MODEL).finished("stop", DRAFTED)
    labels: dict[str, str] = {"model": MODEL}
    assert metrics.registry.get_sample_value("exo_drafted_tokens_total", labels) == 32
    assert metrics.registry.get_sample_value("exo_accepted_draft_tokens_total", labels) == 24
