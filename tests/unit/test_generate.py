"""The generation loop on the local model: chunked prefill from the cached prefix,
with progress and cancellation; decode that computes ahead yet draws what a
step-by-step loop draws; constraints, logprobs and stop strings as a reply
reports them (the tiny random model, and the built-in one where text matters)."""

import json
import random
from pathlib import Path

import jsonschema
import mlx.nn as nn
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.constraint_grammar import ConstraintError
from exo.engine.mlx.generate import (
    Finished,
    GenerationCancelled,
    GenerationOutput,
    LocalModel,
    TextDelta,
    TextGenerator,
)
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.shared.types.constraints import JsonSchema
from exo.shared.types.tasks import GenerationParams, SampledLogprob
from tests.constraint_examples import PERSON, WEATHER_ARGUMENTS, WEATHER_CALL

GREEDY = GenerationParams(max_tokens=4, temperature=0)
CHUNK = 16


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    return load_for_inference(tiny_model_dir)


@pytest.fixture(scope="module")
def smollm(smollm_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    return load_for_inference(smollm_dir)


def chat(tokenizer: TokenizerWrapper, question: str) -> list[int]:
    tokens = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    assert isinstance(tokens, list)
    return tokens


def run(
    loaded: tuple[nn.Module, TokenizerWrapper], tokens: list[int], params: GenerationParams
) -> tuple[str, list[SampledLogprob], Finished]:
    """The reply's text, the logprobs of every delta in order, and how it ended."""
    model, tokenizer = loaded
    outputs: list[GenerationOutput] = list(
        TextGenerator(LocalModel(model, tokenizer), tokenizer, None).generate(tokens, params)
    )
    deltas = [o for o in outputs if isinstance(o, TextDelta)]
    done = outputs[-1]
    assert isinstance(done, Finished)
    logprobs = [entry for delta in deltas for entry in delta.logprobs]
    return "".join(d.text for d in deltas), logprobs, done


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40_000) for _ in range(n)]


@pytest.mark.parametrize(
    ("cached", "length", "reports"),
    [
        (None, 50, [(0, 49), (16, 49), (32, 49), (48, 49), (49, 49)]),
        (None, 1, [(0, 0)]),
        (40, 70, [(40, 69), (56, 69), (69, 69)]),
    ],
)
def test_prefill_reports_progress_chunk_by_chunk_from_the_cached_prefix(
    tiny: tuple[nn.Module, TokenizerWrapper],
    cached: int | None,
    length: int,
    reports: list[tuple[int, int]],
) -> None:
    model, tokenizer = tiny
    cache = KVPrefixCache(1 << 40)
    generator = TextGenerator(
        LocalModel(model, tokenizer), tokenizer, cache, prefill_step_tokens=CHUNK
    )
    tokens = prompt(length)
    if cached is not None:
        list(generator.generate(tokens[:cached], GREEDY))  # stores the KV of these tokens
    seen: list[tuple[int, int]] = []
    outputs = list(
        generator.generate(
            tokens, GREEDY, on_progress=lambda done, total: seen.append((done, total))
        )
    )
    assert seen == reports
    done = outputs[-1]
    assert isinstance(done, Finished)
    assert done.usage.cached_tokens == (cached or 0)


def test_a_request_cancelled_during_prefill_stops_and_stores_nothing(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    cache = KVPrefixCache(1 << 40)
    generator = TextGenerator(
        LocalModel(model, tokenizer), tokenizer, cache, prefill_step_tokens=CHUNK
    )
    seen: list[int] = []
    with pytest.raises(GenerationCancelled):
        list(
            generator.generate(
                prompt(60),
                GREEDY,
                is_cancelled=lambda: len(seen) > 2,
                on_progress=lambda done, total: seen.append(done),
            )
        )
    assert seen == [0, 16, 32]
    assert cache.entry_ids() == []


@pytest.mark.parametrize("params", [GREEDY, GenerationParams(max_tokens=4, temperature=1, seed=3)])
@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_decode_ahead_draws_what_one_step_at_a_time_draws(
    tiny: tuple[nn.Module, TokenizerWrapper], params: GenerationParams, max_tokens: int
) -> None:
    model, tokenizer = tiny
    forward = LocalModel(model, tokenizer)
    tokens = prompt(20)
    drawn: list[list[int]] = []
    for ahead in (True, False):
        layers = forward.make_cache()
        with forward.request(tokens, params):
            forward.prefill(tokens[:-1], layers)
            first = forward.next_token(tokens[-1], layers)
            if ahead:
                rest = [s.token for s in forward.decode(first.token, layers, max_tokens)]
            else:
                rest, token = [], first.token
                for _ in range(max_tokens):
                    token = forward.next_token(token, layers).token
                    rest.append(token)
        drawn.append([first.token, *rest])
    assert len(drawn[0]) == max_tokens + 1
    assert drawn[0] == drawn[1]


def test_a_json_schema_constraint_yields_valid_json_ended_by_eos(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    tokens = chat(smollm[1], "Describe a person as JSON.")
    params = GenerationParams(
        max_tokens=40, temperature=0, constraint=JsonSchema(json_schema=PERSON), logprobs=True
    )
    text, logprobs, done = run(smollm, tokens, params)
    jsonschema.validate(json.loads(text), PERSON)
    assert done.finish_reason == "stop" and done.stop_sequence is None
    # The grammar completes, then only EOS may follow: it ends the reply, unreported.
    assert len(logprobs) == done.usage.completion_tokens - 1
    assert smollm[1].decode([entry.token for entry in logprobs]) == text


def test_a_named_tool_constraint_yields_prefix_call_suffix(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    tokens = chat(smollm[1], "What is the weather in Paris?")
    text, _, done = run(
        smollm, tokens, GenerationParams(max_tokens=40, temperature=0, constraint=WEATHER_CALL)
    )
    assert text.startswith(WEATHER_CALL.prefix) and text.endswith(WEATHER_CALL.suffix)
    call = json.loads(text.removeprefix(WEATHER_CALL.prefix).removesuffix(WEATHER_CALL.suffix))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER_ARGUMENTS)
    assert done.finish_reason == "stop"


def test_an_uncompilable_constraint_fails_before_generating(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    broken = JsonSchema(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(ConstraintError):
        run(tiny, prompt(8), GenerationParams(max_tokens=4, temperature=0, constraint=broken))


@pytest.mark.parametrize("top_logprobs", [0, 3])
def test_every_generated_token_is_reported_once_with_its_logprob(
    tiny: tuple[nn.Module, TokenizerWrapper], top_logprobs: int
) -> None:
    params = GenerationParams(
        max_tokens=12, temperature=0, logprobs=True, top_logprobs=top_logprobs
    )
    text, logprobs, done = run(tiny, prompt(20), params)
    assert done.finish_reason == "length"
    assert len(logprobs) == done.usage.completion_tokens == 12
    assert tiny[1].decode([entry.token for entry in logprobs]) == text
    for entry in logprobs:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == top_logprobs
        if top_logprobs:  # greedy: the drawn token is the most likely one
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == entry.logprob


def test_a_stop_string_ends_the_reply_and_is_reported(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    tokens = prompt(20)
    free, _, _ = run(tiny, tokens, GenerationParams(max_tokens=12, temperature=0))
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    params = GenerationParams(
        max_tokens=12, temperature=0, stop=("never here", stop), logprobs=True
    )
    text, logprobs, done = run(tiny, tokens, params)
    assert text == free[: free.index(stop)]
    assert (done.finish_reason, done.stop_sequence) == ("stop", stop)
    # The tokens that spelled the stop string were generated, so they are reported.
    assert len(logprobs) == done.usage.completion_tokens < 12
    assert stop in tiny[1].decode([entry.token for entry in logprobs])


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_one_is_greedy(tiny: tuple[nn.Module, TokenizerWrapper], seed: int) -> None:
    tokens = prompt(20)
    greedy = run(tiny, tokens, GenerationParams(max_tokens=10, temperature=0))[0]
    top_one = GenerationParams(max_tokens=10, temperature=1.5, top_k=1, top_p=0.9, seed=seed)
    assert run(tiny, tokens, top_one)[0] == greedy


@pytest.mark.parametrize("eager", [True, False])
def test_decode_hands_out_a_token_before_computing_the_next_when_the_forward_is_eager(
    tiny: tuple[nn.Module, TokenizerWrapper], eager: bool
) -> None:
    """On the CPU one row's forward runs as it is built (`cpu_few_rows`): the loop hands
    each token out before it feeds it to the model; else it feeds it first, so the
    next step computes while the token goes out."""
    model, tokenizer = tiny
    forward = LocalModel(model, tokenizer)
    forward.eager_rows = 1 if eager else 0
    tokens = prompt(20)
    layers = forward.make_cache()
    with forward.request(tokens, GREEDY):
        forward.prefill(tokens[:-1], layers)
        first = forward.next_token(tokens[-1], layers)
        fed: list[int] = []
        for _ in forward.decode(first.token, layers, 5):
            fed.append(layers[0].offset - len(tokens))
    # The n-th token out (after `first`) came from feeding the one before it.
    assert fed == ([1, 2, 3, 4, 5] if eager else [2, 3, 4, 5, 5])
