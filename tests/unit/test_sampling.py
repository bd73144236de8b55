"""The per-request sampling step: filters, penalties, logit bias, logprobs, seeds."""

from collections import Counter
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_top_k, apply_top_p
from pydantic import ValidationError

from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.sampling import (
    TOP_P_CANDIDATES,
    SampledToken,
    SamplingStep,
    greedy_rows,
    top_p_filter,
)
from exo.shared.types.tasks import GenerationParams

FORCE = 1000.0  # a logit that wins whatever penalty applies


def params(**values: Any) -> GenerationParams:
    return GenerationParams.model_validate({"max_tokens": 16, **values})


def random_logits(seed: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=3.0, size=vocab).astype(np.float32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def forcing(token: int, vocab: int) -> mx.array:
    logits = np.zeros(vocab, dtype=np.float32)
    logits[token] = FORCE
    return mx.array(logits)


def distribution(sampled: SampledToken, vocab: int) -> np.ndarray:
    """The full log-distribution, from `top_logprobs` that cover the vocabulary."""
    assert len(sampled.top_logprobs) == vocab
    result = np.empty(vocab, dtype=np.float32)
    for alternative in sampled.top_logprobs:
        result[alternative.token] = alternative.logprob
    return result


def draws(step: SamplingStep, logits: np.ndarray, count: int) -> Counter[int]:
    row = mx.array(logits)
    return Counter(step.sample(row).token for _ in range(count))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 2.0, "top_k": 1, "top_p": 0.5, "min_p": 0.01},
    ],
)
def test_top_k_one_and_temperature_zero_are_greedy(seed: int, sampling: dict[str, Any]) -> None:
    logits = random_logits(seed, vocab=64)
    step = SamplingStep(params(**sampling, seed=seed))
    assert draws(step, logits, 5) == Counter({int(np.argmax(logits)): 5})


PROBS = np.array([0.5, 0.3, 0.1, 0.06, 0.04])


@pytest.mark.parametrize(
    ("sampling", "kept"),
    [
        ({}, {0, 1, 2, 3, 4}),
        ({"min_p": 0.15}, {0, 1, 2}),  # threshold 0.075: 0.06 and 0.04 go
        ({"min_p": 0.5}, {0, 1}),  # threshold 0.25
        ({"min_p": 1.0}, {0}),
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 4}, {0, 1, 2, 3}),
        ({"top_p": 0.8}, {0, 1}),
        ({"top_p": 0.85}, {0, 1, 2}),
        # top-p applies to what top-k kept: 0.5 / 0.9 > 0.5, so only token 0.
        ({"top_k": 3, "top_p": 0.5}, {0}),
        ({"top_p": 0.95, "min_p": 0.15}, {0, 1, 2}),
    ],
)
def test_truncation_keeps_exactly_the_expected_tokens(
    sampling: dict[str, Any], kept: set[int]
) -> None:
    step = SamplingStep(params(temperature=1.0, seed=0, **sampling))
    assert set(draws(step, np.log(PROBS), 400)) == kept


@pytest.mark.parametrize(
    ("scale", "top_p", "top_k"),
    [
        # The nucleus among the candidates (seed 0: 1, 5 and ~900 tokens).
        (5.0, 0.5, 0),
        (5.0, 0.9, 0),
        (5.0, 0.999, 0),
        # Past them (~1500 and ~43000 tokens): the full sort decides.
        (3.0, 0.9, 0),
        (0.1, 0.9, 0),
        # Top-k bounds the nucleus: no check needed.
        (0.1, 0.95, 40),
        (0.1, 0.95, TOP_P_CANDIDATES),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_top_p_keeps_what_a_full_sort_keeps(
    scale: float, top_p: float, top_k: int, seed: int
) -> None:
    vocab = 49_152
    logits = np.random.default_rng(seed).normal(scale=scale, size=vocab).astype(np.float32)
    logits[:5] = logits[5]  # ties at the top
    scores = mx.array(logits - logits.max())[None]
    if top_k:
        scores = apply_top_k(scores, top_k)
    expected = ~np.isinf(np.array(apply_top_p(scores, top_p))[0])
    filtered = np.array(top_p_filter(scores, top_p, bounded=top_k > 0))[0]
    kept = ~np.isinf(filtered)
    np.testing.assert_array_equal(filtered[kept], np.array(scores)[0][kept])  # values untouched
    # The most likely tokens, all those tied with the least likely kept one included.
    assert filtered[kept].min() > np.array(scores)[0][~kept].max(initial=-np.inf)
    # As mlx-lm's full sort keeps, but where the two float32 sums of the mass above
    # a token round differently: there the exact mass is within rounding of top_p.
    probs = np.exp(np.array(scores)[0].astype(np.float64))
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass_above = np.empty_like(probs)
    mass_above[order] = np.cumsum(probs[order]) - probs[order]
    differ = kept != expected
    assert np.all(np.abs(mass_above[differ] - top_p) < 1e-3), mass_above[differ]
    assert differ.sum() <= max(1, kept.sum() // 20)


def test_temperature_sharpens_and_flattens_the_draws() -> None:
    logits = np.log(np.array([0.6, 0.4]))
    cold = draws(SamplingStep(params(temperature=0.1, seed=1)), logits, 400)
    hot = draws(SamplingStep(params(temperature=2.0, seed=1)), logits, 400)
    assert cold[0] > 390  # p(1) = 0.4^10 / (0.6^10 + 0.4^10) ≈ 0.017
    assert 150 < hot[1] < 250  # p(1) ≈ 0.45


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.9}]
)
def test_logit_bias_bans_and_forces(sampling: dict[str, Any]) -> None:
    logits = np.log(np.array([0.7, 0.2, 0.06, 0.04])) + 20.0
    banned = SamplingStep(params(**sampling, seed=2, logit_bias={0: -100}))
    assert 0 not in draws(banned, logits, 200)
    forced = SamplingStep(params(**sampling, seed=2, logit_bias={3: 100}, logprobs=True))
    assert draws(forced, logits, 200) == Counter({3: 200})
    assert forced.sample(mx.array(logits)).logprob == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    ("presence", "frequency", "reply"),
    [
        (0.5, 0.0, [1, 1, 3]),
        (0.0, 0.25, [1, 1, 3]),
        (1.0, 0.5, [1, 1, 1, 3, 5]),
        (-2.0, 2.0, [6, 6]),  # negative encourages repeating
        (1.0, 1.0, []),  # nothing generated yet: nothing to penalize
    ],
)
def test_presence_and_frequency_penalties_follow_openai(
    presence: float, frequency: float, reply: list[int]
) -> None:
    vocab = 8
    step = SamplingStep(
        params(
            temperature=0.0,
            presence_penalty=presence,
            frequency_penalty=frequency,
            logprobs=True,
            top_logprobs=vocab,
        ),
        prompt_tokens=[2, 2, 4],  # the prompt does not count
    )
    assert [step.sample(forcing(token, vocab)).token for token in reply] == reply
    logits = random_logits(3, vocab)
    counts = np.bincount(np.array(reply, dtype=np.int64), minlength=vocab)
    expected = logits - frequency * counts - presence * (counts > 0)
    got = distribution(step.sample(mx.array(logits)), vocab)
    np.testing.assert_allclose(got, log_softmax(expected), atol=1e-5)


@pytest.mark.parametrize(
    ("penalty", "window", "prompt", "reply", "penalized"),
    [
        (1.5, 20, [1, 2], [], {1, 2}),
        (2.0, 2, [1, 2, 3], [], {2, 3}),  # only the last `window` tokens
        (2.0, 2, [1, 2], [3], {2, 3}),  # the reply slides the window
        (1.3, 4, [], [5, 5], {5}),
        (0.5, 20, [0, 4], [], {0, 4}),  # below 1 favours repeating
        (1.0, 20, [0, 1, 2], [], set()),  # 1 is off
    ],
)
def test_repetition_penalty_scales_the_recent_tokens(
    penalty: float, window: int, prompt: list[int], reply: list[int], penalized: set[int]
) -> None:
    vocab = 8
    step = SamplingStep(
        params(
            temperature=0.0,
            repetition_penalty=penalty,
            repetition_context_size=window,
            logprobs=True,
            top_logprobs=vocab,
        ),
        prompt_tokens=prompt,
    )
    assert [step.sample(forcing(token, vocab)).token for token in reply] == reply
    logits = np.array([2.0, -1.0, 0.5, -3.0, 1.0, -0.5, 0.0, 3.0], dtype=np.float32)
    expected = logits.copy()
    for token in penalized:
        value = logits[token]
        expected[token] = value * penalty if value < 0 else value / penalty
    got = distribution(step.sample(mx.array(logits)), vocab)
    np.testing.assert_allclose(got, log_softmax(expected), atol=1e-5)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 0.7, "top_k": 3},
        {"temperature": 1.8, "top_p": 0.5, "min_p": 0.2},
    ],
)
def test_logprobs_are_of_the_untempered_untruncated_distribution(
    sampling: dict[str, Any],
) -> None:
    vocab = 16
    logits = random_logits(4, vocab)
    step = SamplingStep(params(**sampling, seed=5, logprobs=True, top_logprobs=vocab))
    for _ in range(10):
        sampled = step.sample(mx.array(logits))
        full = distribution(sampled, vocab)
        np.testing.assert_allclose(full, log_softmax(logits), atol=1e-5)
        assert np.exp(full).sum() == pytest.approx(1.0, abs=1e-5)
        assert sampled.logprob == pytest.approx(full[sampled.token], abs=1e-6)
        values = [alternative.logprob for alternative in sampled.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(value <= 0 for value in values)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9, "top_k": 30}]
)
def test_asking_for_logprobs_does_not_change_the_reply(sampling: dict[str, Any]) -> None:
    rows = [random_logits(i, vocab=50) for i in range(20)]
    plain_step = SamplingStep(params(**sampling, seed=4))
    plain = [plain_step.sample(mx.array(row)) for row in rows]
    assert all(sampled.logprob is None and not sampled.top_logprobs for sampled in plain)
    with_logprobs = SamplingStep(params(**sampling, seed=4, logprobs=True, top_logprobs=2))
    assert [with_logprobs.sample(mx.array(row)).token for row in rows] == [
        sampled.token for sampled in plain
    ]


@pytest.mark.parametrize("count", [0, 1, 5, 20])
def test_top_logprobs_are_the_most_likely_tokens(count: int) -> None:
    logits = random_logits(6, vocab=100)
    sampled = SamplingStep(params(temperature=0.0, logprobs=True, top_logprobs=count)).sample(
        mx.array(logits)
    )
    assert [alternative.token for alternative in sampled.top_logprobs] == list(
        np.argsort(-logits)[:count]
    )
    assert sampled.logprob == pytest.approx(log_softmax(logits).max(), abs=1e-5)


def test_top_logprobs_leave_out_tokens_a_processor_ruled_out() -> None:
    def only_two(_tokens: mx.array, logits: mx.array) -> mx.array:
        return mx.where(mx.arange(logits.shape[-1]) < 2, logits, -mx.inf)

    step = SamplingStep(
        params(temperature=1.0, logprobs=True, top_logprobs=5), processors=[only_two]
    )
    sampled = step.sample(mx.array(random_logits(7, vocab=10)))
    assert {alternative.token for alternative in sampled.top_logprobs} == {0, 1}
    assert sampled.token in {0, 1}


def test_processors_see_prompt_and_reply_and_have_the_last_word() -> None:
    """A grammar-like mask that allows only token `len(reply)`, beside a bias
    that would force another token."""
    vocab = 10
    prompt = [4, 4]
    seen: list[list[int]] = []

    def count_up(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(cast(list[int], tokens.tolist()))
        return mx.where(mx.arange(vocab) == tokens.size - len(prompt), logits, -mx.inf)

    step = SamplingStep(
        params(temperature=1.0, seed=8, logit_bias={9: 100}),
        prompt_tokens=prompt,
        processors=[count_up],
    )
    tokens = [step.sample(mx.array(random_logits(i, vocab))).token for i in range(4)]
    assert tokens == [0, 1, 2, 3]
    assert seen == [[4, 4], [4, 4, 0], [4, 4, 0, 1], [4, 4, 0, 1, 2]]


def sequence(step: SamplingStep, rows: list[np.ndarray]) -> list[int]:
    return [step.sample(mx.array(row)).token for row in rows]


def test_a_seed_reproduces_the_reply_whatever_runs_beside_it() -> None:
    rows = [random_logits(i, vocab=50) / 3 for i in range(30)]
    sampling = params(temperature=1.0, seed=42)
    alone = sequence(SamplingStep(sampling), rows)
    assert sequence(SamplingStep(sampling), rows) == alone
    # Interleaved with another request and with use of the global random state.
    first, other = SamplingStep(sampling), SamplingStep(params(temperature=1.0, seed=43))
    interleaved, others = [], []
    for row in rows:
        mx.random.seed(0)
        interleaved.append(first.sample(mx.array(row)).token)
        mx.random.uniform(shape=(3,))
        others.append(other.sample(mx.array(row)).token)
    assert interleaved == alone
    assert others != alone


@pytest.mark.parametrize(("seed", "same_as"), [(-1, 2**64 - 1), (2**64, 0)])
def test_any_integer_is_a_seed(seed: int, same_as: int) -> None:
    rows = [random_logits(i, vocab=50) / 3 for i in range(10)]
    assert sequence(SamplingStep(params(temperature=1.0, seed=seed)), rows) == sequence(
        SamplingStep(params(temperature=1.0, seed=same_as)), rows
    )


def test_lazy_draws_resolve_to_what_sample_returns() -> None:
    rows = [random_logits(i, vocab=50) for i in range(8)]
    sampling = params(temperature=0.9, seed=9, presence_penalty=1.0, logprobs=True, top_logprobs=3)
    lazy = SamplingStep(sampling)
    pending = [lazy.draw(mx.array(row)) for row in rows]  # nothing evaluated in between
    for draw in pending:
        draw.async_eval()
    eager = SamplingStep(sampling)
    assert [draw.resolve() for draw in pending] == [eager.sample(mx.array(row)) for row in rows]


def test_greedy_rows_share_one_argmax_with_their_own_biases() -> None:
    """A batch's greedy rows, some with a `logit_bias` (which may overturn the
    argmax), get what each row's own step draws."""
    logits = mx.array(np.stack([random_logits(i, vocab=50) for i in range(4)]))
    top = cast(list[int], mx.argmax(logits, axis=-1).tolist())
    biases: list[dict[int, float]] = [{}, {top[1]: -100.0}, {7: 100.0, 9: 50.0}, {top[3]: 1.0}]
    steps = [SamplingStep(params(temperature=0, logit_bias=bias)) for bias in biases]
    assert all(step.plain_greedy for step in steps)
    batched = [draw.resolve().token for draw in greedy_rows(logits, steps)]
    alone = [
        SamplingStep(params(temperature=0, logit_bias=bias)).sample(logits[i])
        for i, bias in enumerate(biases)
    ]
    assert batched == [sampled.token for sampled in alone]
    assert batched[0] == top[0] and batched[1] != top[1] and batched[2] == 7
    with pytest.raises(ValueError, match="logit_bias names a token id >= 50"):
        greedy_rows(logits[:1], [SamplingStep(params(temperature=0, logit_bias={50: 1.0}))])


@pytest.mark.parametrize(
    ("logits", "sampling", "error"),
    [
        (mx.zeros((2, 8)), {}, "one row of logits"),
        (mx.zeros((8,)), {"logit_bias": {8: 1.0}}, "logit_bias names a token id >= 8"),
    ],
)
def test_misfit_inputs_are_refused(logits: mx.array, sampling: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        SamplingStep(params(**sampling)).sample(logits)


@pytest.mark.parametrize(
    ("values", "valid"),
    [
        ({"logit_bias": {3: 100.0, 4: -100.0}}, True),
        ({"logit_bias": {3: 100.5}}, False),
        ({"logit_bias": {-1: 1.0}}, False),
        ({"logprobs": True, "top_logprobs": 20}, True),
        ({"logprobs": True, "top_logprobs": 21}, False),
        ({"top_logprobs": 2}, False),  # alternatives without logprobs
        ({"presence_penalty": -2.0, "frequency_penalty": 2.0}, True),
        ({"presence_penalty": 2.1}, False),
        ({"frequency_penalty": -2.1}, False),
        ({"top_k": -1}, False),
        ({"min_p": 1.5}, False),
        ({"repetition_penalty": 0.0}, False),
        ({"repetition_context_size": 0}, False),
        ({"logit_bias": {"17": 5}}, True),  # JSON keys are strings
    ],
)
def test_generation_params_follow_openai_limits(values: dict[str, Any], valid: bool) -> None:
    if valid:
        params(**values)
    else:
        with pytest.raises(ValidationError):
            params(**values)


def test_generation_params_round_trip_through_json() -> None:
    original = params(logit_bias={17: -100.0}, logprobs=True, top_logprobs=3, top_k=40, seed=1)
    assert GenerationParams.model_validate_json(original.model_dump_json()) == original


def decode(model: nn.Module, step: SamplingStep, prompt: list[int], count: int) -> list[int]:
    """As a generation loop uses the step: each drawn token, still unevaluated,
    is the next forward pass's input; it is resolved one step later."""
    cache = make_prompt_cache(model)
    current = step.draw(model(mx.array(prompt)[None], cache=cache)[:, -1, :])
    tokens: list[int] = []
    for n in range(count):
        upcoming = None
        if n + 1 < count:
            upcoming = step.draw(model(current.token[None], cache=cache)[:, -1, :])
            upcoming.async_eval()
        tokens.append(current.resolve().token)
        if upcoming is not None:
            current = upcoming
    return tokens


def test_on_a_real_model_greedy_matches_mlx_lm_and_seeds_reproduce(tiny_model_dir: Path) -> None:
    model, _ = load_for_inference(tiny_model_dir)
    prompt = [1, 400, 2000, 31, 7]
    reference = [
        int(token)
        for token, _ in generate_step(
            mx.array(prompt), model, max_tokens=8, sampler=lambda x: mx.argmax(x, axis=-1)
        )
    ]
    assert decode(model, SamplingStep(params(temperature=0.0), prompt), prompt, 8) == reference
    sampled = params(
        temperature=1.0, top_k=50, repetition_penalty=1.2, frequency_penalty=0.5, seed=3
    )
    first = decode(model, SamplingStep(sampled, prompt), prompt, 8)
    assert decode(model, SamplingStep(sampled, prompt), prompt, 8) == first
