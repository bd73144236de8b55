"""A node started with `--draft-model` drafts with it for the model it serves
whole (`GET /v1/models` names it): the official `openai` client's reply is the
one a node without it gives (greedy), and its usage counts the drafted tokens;
a node given a draft model it has not got exits with a sentence."""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, running_node
from tests.model_factory import make_tiny_llama

pytestmark = pytest.mark.slow

DRAFT = "tiny-draft"  # a random model of the built-in model's tokenizer
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def drafting_node(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, smollm_dir: Path
) -> Iterator[NodeProcess]:
    if not (models_dir / DRAFT).exists():
        make_tiny_llama(models_dir / DRAFT, smollm_dir)
    with running_node(
        tmp_path_factory.mktemp("draft"), models_dir, "--draft-model", DRAFT
    ) as started:
        yield started


def _story(node: NodeProcess) -> tuple[str, dict[str, int]]:
    client = OpenAI(base_url=f"{node.base_url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=STORY,  # pyright: ignore[reportArgumentType]
        temperature=0,
        max_tokens=48,
    )
    usage = reply.usage
    assert usage is not None and usage.completion_tokens_details is not None
    content = reply.choices[0].message.content
    assert content
    return content, dict(usage.completion_tokens_details.model_extra or {})


def test_the_draft_model_drafts_and_the_reply_is_unchanged(
    drafting_node: NodeProcess, node: NodeProcess
) -> None:
    models = drafting_node.get("/v1/models")["data"]
    served = next(m for m in models if m["id"] == DEFAULT_MODEL_ID)
    assert served["draft_model"] == DRAFT and served["draft_model_refused"] is None
    assert f"{DRAFT} drafts text that copies nothing" in drafting_node.log()  # the runner's
    drafted, details = _story(drafting_node)
    plain, _ = _story(node)  # the shared node: no draft model
    assert drafted == plain
    assert details["drafted_tokens"] > 0
    assert details["accepted_draft_tokens"] <= details["drafted_tokens"]


def test_a_draft_model_not_in_the_models_dir_is_refused_at_start(
    tmp_path: Path, models_dir: Path
) -> None:
    command = [sys.executable, "-m", "exo.main", "--data-dir", str(tmp_path / "data")]
    command += ["--models-dir", str(models_dir), "--draft-model", "no-such-draft"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--draft-model no-such-draft: no such model in" in result.stderr
