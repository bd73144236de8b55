"""Continuous batching on the local model: requests that decode together reply
exactly as each does alone (greedy and seeded), with their own stop rules,
limits and constraints; a request's prompt is read between other requests'
decode steps; a finished request's KV lands in the prefix cache."""

import json
from pathlib import Path

import mlx.nn as nn
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.batch import (
    BatchOutput,
    ContinuousBatcher,
    GenerationFailed,
    PromptProgress,
    can_batch,
)
from exo.engine.mlx.cpu_few_rows import KERNEL_ROWS
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.shared.types.constraints import JsonSchema
from exo.shared.types.tasks import GenerationParams
from tests.batch_drain import drain
from tests.constraint_examples import PERSON
from tests.platforms import needs_cpu_backend, needs_numba

GREEDY = GenerationParams(max_tokens=40, temperature=0)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Why is the sky blue? Answer briefly.",
]


@pytest.fixture(scope="module")
def smollm(smollm_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    return load_for_inference(smollm_dir)


def chat(tokenizer: TokenizerWrapper, question: str) -> list[int]:
    tokens = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    assert isinstance(tokens, list)
    return tokens


def batcher(
    loaded: tuple[nn.Module, TokenizerWrapper],
    cache: KVPrefixCache | None = None,
    prefill_step_tokens: int = 512,
) -> ContinuousBatcher:
    model, tokenizer = loaded
    generator = TextGenerator(LocalModel(model, tokenizer), tokenizer, cache, prefill_step_tokens)
    return ContinuousBatcher(generator)


Reply = tuple[str, Finished]


def reply(outputs: list[BatchOutput]) -> Reply:
    failed = [o for o in outputs if isinstance(o, GenerationFailed)]
    assert not failed, failed
    done = outputs[-1]
    assert isinstance(done, Finished)
    return "".join(o.text for o in outputs if isinstance(o, TextDelta)), done


def alone(
    loaded: tuple[nn.Module, TokenizerWrapper], tokens: list[int], params: GenerationParams
) -> Reply:
    batch = batcher(loaded)
    batch.add("alone", tokens, params)
    return reply(drain(batch)["alone"])


def test_the_model_batches(smollm: tuple[nn.Module, TokenizerWrapper]) -> None:
    model, tokenizer = smollm
    assert can_batch(LocalModel(model, tokenizer).make_cache())


@pytest.mark.parametrize(
    "params",
    [GREEDY, GenerationParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7)],
    ids=["greedy", "seeded"],
)
def test_four_requests_together_reply_as_each_alone(
    smollm: tuple[nn.Module, TokenizerWrapper], params: GenerationParams
) -> None:
    _, tokenizer = smollm
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    expected = [alone(smollm, tokens, params) for tokens in prompts]
    batch = batcher(smollm)
    for n, tokens in enumerate(prompts):
        batch.add(f"r{n}", tokens, params)
    together = drain(batch)
    for n, want in enumerate(expected):
        got = reply(together[f"r{n}"])
        assert got[0] == want[0]
        assert got[1].usage == want[1].usage
        assert got[1].finish_reason == want[1].finish_reason
    assert len({text for text, _ in expected}) == len(prompts)  # distinct replies


def test_each_request_keeps_its_own_limits_stops_and_constraint(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    _, tokenizer = smollm
    short = GenerationParams(max_tokens=3, temperature=0)
    stopped = GenerationParams(max_tokens=60, temperature=0, stop=(" ",))
    schema = GenerationParams(
        max_tokens=120, temperature=0, constraint=JsonSchema(json_schema=PERSON)
    )
    requests = {
        "short": (chat(tokenizer, QUESTIONS[0]), short),
        "stopped": (chat(tokenizer, QUESTIONS[1]), stopped),
        "json": (chat(tokenizer, "Describe a person as JSON."), schema),
        "long": (chat(tokenizer, QUESTIONS[3]), GREEDY),
    }
    expected = {name: alone(smollm, tokens, params) for name, (tokens, params) in requests.items()}
    batch = batcher(smollm)
    for name, (tokens, params) in requests.items():
        batch.add(name, tokens, params)
    together = {name: reply(outputs) for name, outputs in drain(batch).items()}
    assert together == expected
    assert together["short"][1].usage.completion_tokens == 3
    assert together["short"][1].finish_reason == "length"
    assert together["stopped"][1].stop_sequence == " "
    json.loads(together["json"][0])


def test_a_new_prompt_is_read_between_decode_steps(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    """A request added while two long replies decode gets its first token after a
    few steps (its prompt's chunks, then the token), long before they end."""
    _, tokenizer = smollm
    batch = batcher(smollm, prefill_step_tokens=16)
    no_eos = {token: -100.0 for token in tokenizer.eos_token_ids}
    long = GenerationParams(max_tokens=200, temperature=0, logit_bias=no_eos)
    batch.add("a", chat(tokenizer, QUESTIONS[1]), long)
    batch.add("b", chat(tokenizer, QUESTIONS[3]), long)
    for _ in range(20):
        batch.step()
    assert batch.batch_size == 2
    short_prompt = chat(tokenizer, QUESTIONS[2])
    batch.add("short", short_prompt, GenerationParams(max_tokens=1, temperature=0))
    steps = 0
    seen: list[BatchOutput] = []
    while not any(isinstance(o, Finished) for o in seen):
        steps += 1
        seen += [o for task_id, o in batch.step() if task_id == "short"]
    assert steps == -(
        -(len(short_prompt) - 1) // 16
    )  # its prompt's chunks, the last with the token
    assert [o for o in seen if isinstance(o, PromptProgress)][-1].done == len(short_prompt) - 1
    assert batch.batch_size == 2  # the long ones still run


def test_a_finished_request_stores_prompt_and_reply(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    _, tokenizer = smollm
    cache = KVPrefixCache(1 << 30)
    batch = batcher(smollm, cache)
    prompts = [chat(tokenizer, q) for q in QUESTIONS[:2]]
    for n, tokens in enumerate(prompts):
        batch.add(f"r{n}", tokens, GenerationParams(max_tokens=8, temperature=0))
    drain(batch)
    stored = [cache.entry_tokens(entry_id) for entry_id in cache.entry_ids()]
    for tokens in prompts:
        # The prompt and the reply's 8 tokens but the last (never fed back in).
        assert any(s[: len(tokens)] == tuple(tokens) and len(s) == len(tokens) + 7 for s in stored)
    batch.add("again", prompts[0], GenerationParams(max_tokens=8, temperature=0))
    assert reply(drain(batch)["again"])[1].usage.cached_tokens == len(prompts[0]) - 1


def test_a_cancelled_request_leaves_the_others_going(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    _, tokenizer = smollm
    prompts = [chat(tokenizer, q) for q in QUESTIONS[:3]]
    expected = alone(smollm, prompts[2], GREEDY)
    batch = batcher(smollm)
    for n, tokens in enumerate(prompts):
        batch.add(f"r{n}", tokens, GREEDY)
    early = [o for _ in range(6) for task_id, o in batch.step() if task_id == "r2"]
    assert batch.cancel("r1")
    assert batch.cancel("r0")
    assert not batch.cancel("unknown")
    assert reply(early + drain(batch)["r2"]) == expected


def test_a_burst_of_new_requests_is_read_together(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    """Prompts that arrive together are read in one forward pass and their first
    tokens drawn in one decode step: after one step each has its first text."""
    _, tokenizer = smollm
    batch = batcher(smollm)
    prompts = {f"r{n}": chat(tokenizer, q) for n, q in enumerate(QUESTIONS)}
    for task_id, tokens in prompts.items():
        batch.add(task_id, tokens, GREEDY)
    first_step: dict[str, list[BatchOutput]] = {}
    for task_id, output in batch.step():
        first_step.setdefault(task_id, []).append(output)
    assert batch.batch_size == len(prompts)
    for task_id, tokens in prompts.items():
        outputs = first_step[task_id]
        read = [o for o in outputs if isinstance(o, PromptProgress)]
        assert read[-1].done == read[-1].total == len(tokens) - 1
        assert any(isinstance(o, TextDelta) and o.text for o in outputs)


def test_cached_and_fresh_prompts_read_together_reply_as_each_alone(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    """Rows restored from the prefix cache and rows read from scratch, of
    different lengths, share one read (left- and right-padded): the replies of
    the one-at-a-time loop."""
    model, tokenizer = smollm
    short = GenerationParams(max_tokens=12, temperature=0)
    prompts = [chat(tokenizer, q) for q in QUESTIONS[:3]]
    one_at_a_time = TextGenerator(LocalModel(model, tokenizer), tokenizer, None)
    expected = [
        "".join(o.text for o in one_at_a_time.generate(tokens, short) if isinstance(o, TextDelta))
        for tokens in prompts
    ]
    cache = KVPrefixCache(1 << 30)
    batch = batcher(smollm, cache)
    batch.add("warm", prompts[0], GenerationParams(max_tokens=1, temperature=0))
    drain(batch)
    for n, tokens in enumerate(prompts):
        batch.add(f"r{n}", tokens, short)
    together = drain(batch)
    for n, want in enumerate(expected):
        assert reply(together[f"r{n}"])[0] == want
    assert reply(together["r0"])[1].usage.cached_tokens == len(prompts[0]) - 1
    assert reply(together["r1"])[1].usage.cached_tokens < len(prompts[1]) - 1


@needs_cpu_backend
@needs_numba
@pytest.mark.parametrize("rows", [1, 2, len(QUESTIONS)])
def test_a_small_batch_on_the_cpu_hands_out_each_token_in_the_step_that_drew_it(
    smollm: tuple[nn.Module, TokenizerWrapper], rows: int
) -> None:
    """Up to `KERNEL_ROWS` rows (more than these), a forward runs as it is built on the CPU
    (`cpu_few_rows`): every step hands out the token it computed for each row,
    none later, and the replies are those of the one-step-ahead loop."""
    tokenizer = smollm[1]
    prompts = [chat(tokenizer, q) for q in QUESTIONS[:rows]]
    params = GenerationParams(
        max_tokens=12, temperature=0, logit_bias={tokenizer.eos_token_id: -100.0}
    )
    batch = batcher(smollm)
    assert batch._model.eager_rows == KERNEL_ROWS  # pyright: ignore[reportPrivateUsage]
    for n, tokens in enumerate(prompts):
        batch.add(f"r{n}", tokens, params)
    outputs: dict[str, list[BatchOutput]] = {}
    handed_out = 0
    while not batch.idle:
        for task_id, output in batch.step():
            outputs.setdefault(task_id, []).append(output)
        if batch.idle:
            break
        in_batch = batch._rows  # pyright: ignore[reportPrivateUsage]
        # Every row has a token more after each step, none held for a later one...
        assert [len(row.generated) for row in in_batch] == [handed_out + 1] * rows
        handed_out += 1
        offsets = batch._cache[0].offset.tolist()  # pyright: ignore[reportPrivateUsage]
        for row, fed in zip(in_batch, offsets, strict=True):
            # ...and the token just handed out has not been fed to the model yet.
            assert fed == len(row.tokens) + len(row.generated) - 1
    lagging = batcher(smollm)
    lagging._model.eager_rows = 0  # pyright: ignore[reportPrivateUsage]
    for n, tokens in enumerate(prompts):
        lagging.add(f"r{n}", tokens, params)
    ahead = drain(lagging)
    assert [reply(outputs[f"r{n}"]) for n in range(rows)] == [
        reply(ahead[f"r{n}"]) for n in range(rows)
    ]


def test_a_batch_shrinking_to_the_kernel_s_size_ends_a_reply_its_queued_token_ends(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    """Five rows decode a step ahead; the first leaving by `max_tokens` leaves four,
    which read their tokens back in the step that draws them. A reply whose queued
    token completes its stop string in that very step ends there, once, and every
    reply is the one it gives alone."""
    tokenizer = smollm[1]
    prompts = [chat(tokenizer, q) for q in [*QUESTIONS, "Say hello to the sun."]]
    no_eos = {tokenizer.eos_token_id: -100.0}
    cut = 4
    params = [GenerationParams(max_tokens=12, temperature=0, logit_bias=no_eos)] * len(prompts)
    params[0] = GenerationParams(max_tokens=cut, temperature=0, logit_bias=no_eos)
    # The second reply's text up to its `cut`-th token, as its stop string.
    text, _ = alone(smollm, prompts[1], params[0])
    assert text
    params[1] = GenerationParams(max_tokens=12, temperature=0, logit_bias=no_eos, stop=(text,))
    batch = batcher(smollm)
    # The batcher switches modes at its model's `eager_rows` (`KERNEL_ROWS` as
    # loaded, more rows than this test's): here at four.
    batch._model.eager_rows = len(prompts) - 1  # pyright: ignore[reportPrivateUsage]
    for n, (tokens, p) in enumerate(zip(prompts, params, strict=True)):
        batch.add(f"r{n}", tokens, p)
    together = drain(batch)
    replies = [reply(together[f"r{n}"]) for n in range(len(prompts))]
    assert (replies[0][1].finish_reason, replies[0][1].usage.completion_tokens) == ("length", cut)
    assert (replies[1][1].finish_reason, replies[1][1].usage.completion_tokens) == ("stop", cut)
    assert [sum(isinstance(o, Finished) for o in together[f"r{n}"]) for n in range(5)] == [1] * 5
    for tokens, p, got in zip(prompts, params, replies, strict=True):
        assert got == alone(smollm, tokens, p)
