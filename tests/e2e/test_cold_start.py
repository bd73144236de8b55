"""End to end: a fresh install's first chat is not slower than the next one. The
runner warms up (`engine/mlx/warm_up.py`: MLX's kernel compiles, the CPU decode
kernel's) before it reports ready, so none of it lands on a user's first request."""

import time
from pathlib import Path

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion

from exo.engine.mlx.load import load_model_tokenizer
from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, running_node

pytestmark = [pytest.mark.slow, pytest.mark.serial]

# Two questions of the same token length (checked below), greedy, the same number
# of tokens generated (EOS banned): the same work for the model.
QUESTIONS = ("What is the capital of France?", "What is the capital of Spain?")
MAX_TOKENS = 8
SLOWER_AT_MOST = 1.5


def timed_chat(node: NodeProcess, question: str, eos: int) -> tuple[float, ChatCompletion]:
    client = OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", timeout=120)
    started = time.monotonic()
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        logit_bias={str(eos): -100},
    )
    return time.monotonic() - started, reply


def test_the_first_chat_after_ready_is_as_fast_as_the_second(
    tmp_path: Path, models_dir: Path, smollm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh install: the on-disk caches of compiled kernels are empty, numba's
    # (the CPU decode kernel) and MLX's (under the temp folder). Runners inherit
    # the node's environment.
    kernel_cache, temp = tmp_path / "numba-cache", tmp_path / "temp"
    kernel_cache.mkdir()
    temp.mkdir()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(kernel_cache))
    monkeypatch.setenv("TMPDIR", str(temp))
    eos = load_model_tokenizer(smollm_dir).eos_token_id
    # No prefix cache: the second chat shares the template's system prompt with the first.
    with running_node(tmp_path, models_dir, "--prefix-cache-bytes", "0") as node:
        first, first_reply = timed_chat(node, QUESTIONS[0], eos)
        second, second_reply = timed_chat(node, QUESTIONS[1], eos)
    assert any(kernel_cache.iterdir()), "the runner did not use the cold kernel cache"
    assert first_reply.usage is not None and second_reply.usage is not None
    assert first_reply.usage.prompt_tokens == second_reply.usage.prompt_tokens
    assert first_reply.usage.completion_tokens == second_reply.usage.completion_tokens == MAX_TOKENS
    assert first <= SLOWER_AT_MOST * second, f"first chat {first:.2f}s, second {second:.2f}s"
