"""Speculative decoding: drafts from the prompt and a predicted output
(`engine/speculation.py`), verified by the request's own sampling step
(`SamplingStep.verify`) inside the continuous batch (`ContinuousBatcher`).

Speculation must never change a reply: greedy replies are the same token for
token, seeded ones reproduce, stops and limits end at the same token, a grammar
is never broken, and the prefix cache keeps what a plain reply leaves."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.batch import BatchOutput, ContinuousBatcher, can_speculate
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.sampling import SamplingStep
from exo.engine.speculation import (
    DRAFT_MAX,
    DRAFT_MIN,
    PAUSE_STEPS,
    Draft,
    Drafter,
    verify_width,
)
from exo.shared.types.constraints import JsonSchema
from exo.shared.types.tasks import GenerationParams
from tests.batch_drain import drain
from tests.constraint_examples import PERSON

SOURCE = '''def parse_range(text: str) -> tuple[int, int]:
    """Parse "a-b" into (a, b)."""
    start, _, end = text.partition("-")
    if not end:
        raise ValueError(f"not a range: {text!r}")
    low, high = int(start), int(end)
    if low > high:
        raise ValueError(f"empty range: {text!r}")
    return low, high


def expand(ranges: list[str]) -> list[int]:
    """Every number the ranges cover, in order."""
    numbers: list[int] = []
    for text in ranges:
        low, high = parse_range(text)
        numbers.extend(range(low, high + 1))
    return numbers
'''
COPY = [
    {"role": "user", "content": "Show me ranges.py."},
    {"role": "assistant", "content": f"```python\n{SOURCE}```"},
    {"role": "user", "content": "Rename `expand` to `expand_ranges`; show the whole file again."},
]
PROSE = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


# ---- drafts ----


def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 7, 8]
    drafter = Drafter(prompt)
    draft = drafter.draft([2, 3, 4], limit=3)
    assert draft == Draft((7, 8, 2), predicted=False)  # the latest "2 3 4" ran on to 7 8
    assert drafter.draft([2, 3, 4, 50], limit=3) is None  # "4 50" is nowhere earlier


def test_a_draft_never_matches_the_suffix_itself() -> None:
    drafter = Drafter([10, 11, 12])
    assert drafter.draft([], limit=4) is None  # "11 12" occurs only at the end


def test_a_prediction_is_followed_and_found_again_after_an_edit() -> None:
    prediction = list(range(100, 120))
    drafter = Drafter([1, 2, 3], prediction)
    assert drafter.draft([], 4) == Draft((100, 101, 102, 103), predicted=True)
    drafter.record(Draft((100, 101, 102, 103), True), 4)
    for _ in range(4):
        drafter.stats.took(Draft((100, 101, 102, 103), True))
    # The reply took 100..103, then wrote 7 instead of 104 and went on from 105.
    assert drafter.draft([100, 101, 102, 103, 7], 4) is None  # lost its place
    found = drafter.draft([100, 101, 102, 103, 7, 105, 106], 3)
    assert found == Draft((107, 108, 109), predicted=True)
    assert drafter.stats.prediction_accepted == 4
    assert drafter.stats.prediction_rejected == len(prediction) - 4


def test_draft_length_grows_on_full_acceptance_and_shrinks_on_refusal() -> None:
    drafter = Drafter(list(range(50)) * 2)
    start = drafter.length
    drafter.record(Draft(tuple(range(start)), False), start)
    assert drafter.length == min(DRAFT_MAX, start + 2)
    drafter.record(Draft(tuple(range(drafter.length)), False), 0)
    assert drafter.length == DRAFT_MIN


def test_low_acceptance_pauses_drafting_for_a_while() -> None:
    drafter = Drafter([1, 2, 3, 1, 2, 3])
    for _ in range(3):
        drafter.record(Draft((1, 2, 3, 4), False), 0)
    paused = [drafter.wants_draft() for _ in range(PAUSE_STEPS + 1)]
    assert paused == [False] * PAUSE_STEPS + [True]


@pytest.mark.parametrize(
    ("drafts", "width"),
    [
        ([(0, 0.0)], 1),  # nothing drafted: a plain step
        ([(8, 1.0)], 9),  # a copy the model takes whole: all of it
        ([(8, 0.05)], 1),  # hopeless drafts cost more than they gain
        ([(4, 0.5)], 3),  # a middling one: part of it
        ([(8, 1.0), (0, 0.0), (0, 0.0), (0, 0.0)], 1),  # the other rows would pad
        ([(8, 1.0)] * 4, 9),  # every row copying
    ],
)
def test_verify_width_weighs_expected_tokens_against_cost(
    drafts: list[tuple[int, float]], width: int
) -> None:
    assert verify_width(drafts) == width


# ---- verification by the sampling step ----


def _logits(rows: list[list[float]]) -> mx.array:
    return mx.array(rows, dtype=mx.float32)


def test_greedy_verify_accepts_the_argmax_prefix_then_corrects() -> None:
    step = SamplingStep(GenerationParams(max_tokens=10, temperature=0))
    rows = _logits([[0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0], [0, 0, 0, 5]])
    tokens = step.verify(rows, [1, 2, 3])
    assert [t.token for t in tokens] == [1, 2, 0]  # 3 refused: the argmax 0 instead
    tokens = SamplingStep(GenerationParams(max_tokens=10, temperature=0)).verify(rows, [1, 2, 0])
    assert [t.token for t in tokens] == [1, 2, 0, 3]  # all accepted, and one more


def test_verify_reports_the_logprobs_a_draw_would() -> None:
    params = GenerationParams(max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    rows = _logits([[0.0, 2.0, 1.0, -1.0], [1.5, 0.2, 0.1, 3.0]])
    verified = SamplingStep(params).verify(rows, [1])
    drawn = [SamplingStep(params).sample(rows[0:1])]
    second = SamplingStep(params)
    second.sample(rows[0:1])
    drawn.append(second.sample(rows[1:2]))
    assert [t.token for t in verified] == [t.token for t in drawn] == [1, 3]
    for got, want in zip(verified, drawn, strict=True):
        assert got.logprob == pytest.approx(want.logprob)
        assert got.top_logprobs == want.top_logprobs


def test_sampled_verification_keeps_the_sampling_distribution() -> None:
    """A drafted token is accepted with its probability and otherwise replaced by
    a draw without it: the first token's frequencies are the distribution's."""
    logits = [0.0, 1.0, 2.0, 0.5]
    expected = np.exp(logits) / np.exp(logits).sum()
    counts = np.zeros(4)
    trials = 4000
    for seed in range(trials):
        step = SamplingStep(GenerationParams(max_tokens=10, temperature=1.0, seed=seed))
        first = step.verify(_logits([logits, logits]), [1])[0]
        counts[first.token] += 1
    assert np.abs(counts / trials - expected).max() < 0.035


def test_a_seed_reproduces_a_verified_draw() -> None:
    params = GenerationParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11)
    rows = mx.random.normal((5, 64), key=mx.random.key(3))
    first = [t.token for t in SamplingStep(params).verify(rows, [1, 2, 3, 4])]
    again = [t.token for t in SamplingStep(params).verify(rows, [1, 2, 3, 4])]
    assert first == again


# ---- in the batch, on the built-in model ----


@pytest.fixture(scope="module")
def smollm(smollm_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    return load_for_inference(smollm_dir)


def _chat(tokenizer: TokenizerWrapper, messages: list[dict[str, str]]) -> list[int]:
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert isinstance(tokens, list)
    return tokens


def _batcher(
    loaded: tuple[nn.Module, TokenizerWrapper], speculate: bool, cache: KVPrefixCache | None = None
) -> ContinuousBatcher:
    model, tokenizer = loaded
    generator = TextGenerator(LocalModel(model, tokenizer), tokenizer, cache)
    return ContinuousBatcher(generator, speculate=speculate)


Reply = tuple[str, Finished, list[BatchOutput]]


def _replies(
    loaded: tuple[nn.Module, TokenizerWrapper],
    requests: list[tuple[list[int], GenerationParams]],
    speculate: bool,
    cache: KVPrefixCache | None = None,
) -> list[Reply]:
    batch = _batcher(loaded, speculate, cache)
    for n, (tokens, params) in enumerate(requests):
        batch.add(f"r{n}", tokens, params)
    outputs = drain(batch)
    replies: list[Reply] = []
    for n in range(len(requests)):
        got = outputs[f"r{n}"]
        done = got[-1]
        assert isinstance(done, Finished), got
        replies.append(("".join(o.text for o in got if isinstance(o, TextDelta)), done, got))
    return replies


def _same(plain: Reply, speculative: Reply) -> None:
    assert speculative[0] == plain[0]
    assert speculative[1].finish_reason == plain[1].finish_reason
    assert speculative[1].stop_sequence == plain[1].stop_sequence
    assert speculative[1].usage.completion_tokens == plain[1].usage.completion_tokens


def test_the_built_in_model_speculates(smollm: tuple[nn.Module, TokenizerWrapper]) -> None:
    model, tokenizer = smollm
    assert can_speculate(LocalModel(model, tokenizer).make_cache())


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("messages", [COPY, PROSE], ids=["copying", "prose"])
def test_greedy_replies_are_the_same_with_and_without_speculation(
    smollm: tuple[nn.Module, TokenizerWrapper], messages: list[dict[str, str]], rows: int
) -> None:
    tokens = _chat(smollm[1], messages)
    # Rows of different lengths, so that the batch changes as they end.
    requests = [
        (tokens, GenerationParams(max_tokens=60 + 7 * n, temperature=0)) for n in range(rows)
    ]
    plain = _replies(smollm, requests, speculate=False)
    speculative = _replies(smollm, requests, speculate=True)
    for want, got in zip(plain, speculative, strict=True):
        _same(want, got)
    assert plain[0][1].usage.drafted_tokens == 0
    if messages is COPY:
        assert speculative[0][1].usage.accepted_draft_tokens > 0


def _oracle(
    smollm: tuple[nn.Module, TokenizerWrapper], tokens: list[int], params: GenerationParams
) -> tuple[int, ...]:
    """The plain reply's tokens, as a prediction every draft of which is right."""
    plain = _replies(smollm, [(tokens, params)], speculate=False)[0]
    return tuple(smollm[1].encode(plain[0], add_special_tokens=False))


def test_a_prediction_the_reply_follows_is_accepted(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    tokens = _chat(smollm[1], PROSE)
    params = GenerationParams(max_tokens=40, temperature=0)
    prediction = _oracle(smollm, tokens, params)
    plain = _replies(smollm, [(tokens, params)], speculate=False)[0]
    predicted = params.model_copy(update={"prediction": prediction})
    got = _replies(smollm, [(tokens, predicted)], speculate=True)[0]
    _same(plain, got)
    usage = got[1].usage
    # Every draft is right: each step takes a whole draft and one more token.
    assert usage.drafted_tokens == usage.accepted_draft_tokens == usage.accepted_prediction_tokens
    assert usage.accepted_prediction_tokens >= 25
    assert usage.accepted_prediction_tokens + usage.rejected_prediction_tokens == len(prediction)


def test_a_request_can_turn_speculation_off(smollm: tuple[nn.Module, TokenizerWrapper]) -> None:
    tokens = _chat(smollm[1], PROSE)
    params = GenerationParams(max_tokens=20, temperature=0)
    off = params.model_copy(
        update={"speculation": False, "prediction": _oracle(smollm, tokens, params)}
    )
    got = _replies(smollm, [(tokens, off)], speculate=True)[0]
    assert got[1].usage.drafted_tokens == 0


def test_seeded_speculative_replies_reproduce(smollm: tuple[nn.Module, TokenizerWrapper]) -> None:
    tokens = _chat(smollm[1], COPY)
    params = GenerationParams(max_tokens=50, temperature=0.7, top_p=0.9, seed=5)
    alone = _replies(smollm, [(tokens, params)], speculate=True)[0]
    # Alone and in a batch beside others: the same reply.
    other = GenerationParams(max_tokens=30, temperature=0)
    together = _replies(smollm, [(tokens, other), (tokens, params)], speculate=True)[1]
    assert together[0] == alone[0]
    assert alone[1].usage.drafted_tokens > 0


def test_stops_and_limits_inside_an_accepted_draft_end_the_reply_alike(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    tokens = _chat(smollm[1], PROSE)
    full = GenerationParams(max_tokens=40, temperature=0)
    prediction = _oracle(smollm, tokens, full)
    text = _replies(smollm, [(tokens, full)], speculate=False)[0][0]
    words = text.split()
    stop = " " + words[len(words) // 2]  # a word in the middle of the reply
    for params in (
        GenerationParams(max_tokens=13, temperature=0),
        GenerationParams(max_tokens=40, temperature=0, stop=(stop,)),
    ):
        plain = _replies(smollm, [(tokens, params)], speculate=False)[0]
        predicted = params.model_copy(update={"prediction": prediction})
        got = _replies(smollm, [(tokens, predicted)], speculate=True)[0]
        _same(plain, got)
        assert got[1].usage.accepted_draft_tokens > 0


def test_a_constrained_reply_never_takes_a_refused_draft_token(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    tokenizer = smollm[1]
    tokens = _chat(tokenizer, [{"role": "user", "content": "Describe a person as JSON."}])
    schema = GenerationParams(
        max_tokens=80, temperature=0, constraint=JsonSchema(json_schema=PERSON)
    )
    plain = _replies(smollm, [(tokens, schema)], speculate=False)[0]
    # A prediction that breaks the grammar from its first token.
    wrong = tuple(tokenizer.encode("Sure! Here is a person: " + plain[0], add_special_tokens=False))
    got = _replies(
        smollm, [(tokens, schema.model_copy(update={"prediction": wrong}))], speculate=True
    )[0]
    _same(plain, got)


def test_the_prefix_cache_keeps_what_a_plain_reply_leaves(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    tokens = _chat(smollm[1], COPY)
    params = GenerationParams(max_tokens=50, temperature=0)
    caches = {speculate: KVPrefixCache(1 << 30) for speculate in (False, True)}
    for speculate, cache in caches.items():
        _replies(smollm, [(tokens, params)], speculate, cache)
    plain, speculative = caches[False], caches[True]
    assert speculative.stats().entries == plain.stats().entries == 1
    (plain_id,), (speculative_id,) = plain.entry_ids(), speculative.entry_ids()
    assert speculative.entry_tokens(speculative_id) == plain.entry_tokens(plain_id)
    for want, got in zip(
        plain.entry_layers(plain_id), speculative.entry_layers(speculative_id), strict=True
    ):
        for a, b in zip(want.state, got.state, strict=True):
            if isinstance(a, mx.array) and isinstance(b, mx.array):
                assert a.shape == b.shape
                assert mx.allclose(a, b, atol=1e-3).item()
            else:
                assert a == b


def test_logprobs_of_accepted_tokens_are_those_of_a_plain_reply(
    smollm: tuple[nn.Module, TokenizerWrapper],
) -> None:
    tokens = _chat(smollm[1], PROSE)
    params = GenerationParams(max_tokens=30, temperature=0, logprobs=True, top_logprobs=3)
    prediction = _oracle(smollm, tokens, params)
    plain = _replies(smollm, [(tokens, params)], speculate=False)[0]
    predicted = params.model_copy(update={"prediction": prediction})
    got = _replies(smollm, [(tokens, predicted)], speculate=True)[0]
    _same(plain, got)
    assert got[1].usage.accepted_draft_tokens > 0

    def logprobs(reply: Reply) -> list[tuple[int, float, list[int]]]:
        return [
            (entry.token, entry.logprob, [alt.token for alt in entry.top_logprobs])
            for output in reply[2]
            if isinstance(output, TextDelta)
            for entry in output.logprobs
        ]

    want, have = logprobs(plain), logprobs(got)
    assert [(t, alts) for t, _, alts in have] == [(t, alts) for t, _, alts in want]
    assert [lp for _, lp, _ in have] == pytest.approx([lp for _, lp, _ in want], abs=1e-3)
