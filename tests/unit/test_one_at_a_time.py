"""A batch of one: `OneAtATime` serves what `TextGenerator.generate` does, one
output per step, with its progress and cancellation hooks and its cache stores
(the tiny random model)."""

import random
from pathlib import Path

import mlx.nn as nn
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.constraint_grammar import ConstraintError
from exo.engine.mlx.batch import BatchOutput, GenerationFailed
from exo.engine.mlx.generate import (
    Finished,
    GenerationCancelled,
    GenerationOutput,
    LocalModel,
    TextGenerator,
)
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.one_at_a_time import OneAtATime
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.shared.types.constraints import JsonSchema
from exo.shared.types.tasks import GenerationParams

CHUNK = 16
GREEDY = GenerationParams(max_tokens=12, temperature=0)
SEEDED = GenerationParams(max_tokens=12, temperature=1.0, seed=5, logprobs=True, top_logprobs=2)
BROKEN = JsonSchema(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    return load_for_inference(tiny_model_dir)


def generator(
    loaded: tuple[nn.Module, TokenizerWrapper], cache: KVPrefixCache | None = None
) -> TextGenerator:
    model, tokenizer = loaded
    return TextGenerator(LocalModel(model, tokenizer), tokenizer, cache, prefill_step_tokens=CHUNK)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40_000) for _ in range(n)]


def serve(batch: OneAtATime, max_steps: int = 500) -> list[tuple[str, BatchOutput]]:
    outputs: list[tuple[str, BatchOutput]] = []
    for _ in range(max_steps):
        if batch.idle:
            return outputs
        outputs += batch.step()
    raise AssertionError("the reply did not end")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cached", [False, True], ids=["cold", "cache-hit"])
def test_replies_as_generate_does_one_output_per_step(
    tiny: tuple[nn.Module, TokenizerWrapper], params: GenerationParams, cached: bool
) -> None:
    tokens = prompt(40)
    expected_cache, cache = (
        (KVPrefixCache(1 << 30), KVPrefixCache(1 << 30)) if cached else (None, None)
    )
    for warm in (expected_cache, cache):
        if warm is not None:  # both caches hold the same first turn
            list(generator(tiny, warm).generate(tokens[:30], GREEDY))
    expected: list[GenerationOutput] = list(
        generator(tiny, expected_cache).generate(tokens, params)
    )
    batch = OneAtATime(generator(tiny, cache))
    batch.add("a", tokens, params)
    steps: list[list[tuple[str, BatchOutput]]] = []
    while not batch.idle:
        steps.append(batch.step())
    assert [output for step in steps for _, output in step] == expected
    assert all(len(step) == 1 for step in steps)  # the last: `Finished`, stored first
    assert batch.step() == []
    if cache is not None and expected_cache is not None:
        assert cache.entry_ids() == expected_cache.entry_ids()


def test_reports_prefill_progress_and_asks_about_cancellation_between_chunks(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    seen: list[tuple[str, int, int]] = []
    asked: list[str] = []

    def is_cancelled(task_id: str) -> bool:
        asked.append(task_id)
        return False

    batch = OneAtATime(
        generator(tiny),
        on_progress=lambda task_id, done, total: seen.append((task_id, done, total)),
        is_cancelled=is_cancelled,
    )
    assert batch.add("a", prompt(50), GREEDY) is None  # progress comes as it is read
    assert seen == []
    batch.step()  # reads the prompt, draws the first token
    assert seen == [("a", 0, 49), ("a", 16, 49), ("a", 32, 49), ("a", 48, 49), ("a", 49, 49)]
    assert asked == ["a"] * 4  # before each chunk
    serve(batch)


def test_a_request_cancelled_during_prefill_fails_as_cancelled_and_stores_nothing(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    cache = KVPrefixCache(1 << 30)
    seen: list[int] = []
    batch = OneAtATime(
        generator(tiny, cache),
        on_progress=lambda task_id, done, total: seen.append(done),
        is_cancelled=lambda task_id: len(seen) > 2,
    )
    batch.add("a", prompt(60), GREEDY)
    [(task_id, failed)] = batch.step()
    assert task_id == "a"
    assert isinstance(failed, GenerationFailed)
    assert isinstance(failed.error, GenerationCancelled)
    assert batch.idle
    assert cache.entry_ids() == []


def test_a_cancelled_reply_ends_where_it_stands_and_the_next_is_served(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    cache = KVPrefixCache(1 << 30)
    batch = OneAtATime(generator(tiny, cache))
    assert not batch.cancel("a")
    batch.add("a", prompt(20), GREEDY)
    batch.step()
    with pytest.raises(RuntimeError):
        batch.add("b", prompt(20, seed=1), GREEDY)  # one at a time
    assert not batch.cancel("b")
    assert batch.cancel("a")
    assert batch.idle
    assert cache.entry_ids() == []  # the cancelled reply is not stored
    batch.add("b", prompt(20, seed=1), GREEDY)
    *_, (task_id, done) = serve(batch)
    assert task_id == "b"
    assert isinstance(done, Finished)
    assert len(cache.entry_ids()) == 1


def test_a_failed_request_fails_alone(tiny: tuple[nn.Module, TokenizerWrapper]) -> None:
    batch = OneAtATime(generator(tiny))
    batch.add("bad", prompt(8), GenerationParams(max_tokens=4, temperature=0, constraint=BROKEN))
    [(task_id, failed)] = batch.step()
    assert task_id == "bad"
    assert isinstance(failed, GenerationFailed)
    assert isinstance(failed.error, ConstraintError)
    batch.add("good", prompt(8), GREEDY)
    *_, (task_id, done) = serve(batch)
    assert (task_id, isinstance(done, Finished)) == ("good", True)
