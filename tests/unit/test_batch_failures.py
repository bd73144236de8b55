"""Continuous batching when something fails: a failure of one row's own work (its
sampling, its text, storing its KV) fails that row only, and the others reply as
each does alone; a failure of the shared forward pass fails every row in the
batch, and the batcher serves the requests after it as if nothing had happened."""

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx import batch as batch_module
from exo.engine.mlx.batch import BatchOutput, ContinuousBatcher, GenerationFailed
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator, TextStream
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.prefix_cache import KVPrefixCache, LayerCache
from exo.engine.mlx.sampling import SampledToken
from exo.engine.speculation import SpeculationStats
from exo.shared.types.tasks import GenerationParams
from tests.batch_drain import drain

PROMPTS = [[1, 17, 290, 11, 402], [1, 9, 5000, 31], [1, 44, 45, 46, 47, 48], [1, 700, 8]]
Loaded = tuple[nn.Module, TokenizerWrapper]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Loaded:
    return load_for_inference(tiny_model_dir)


def params(
    tokenizer: TokenizerWrapper,
    sampled: bool = False,
    bias: dict[int, float] | None = None,
    stop: tuple[str, ...] = (),
) -> GenerationParams:
    """12 tokens, EOS banned (a random model would end at random)."""
    return GenerationParams(
        max_tokens=12,
        temperature=0.8 if sampled else 0,
        seed=7 if sampled else None,
        logit_bias={tokenizer.eos_token_id: -100.0, **(bias or {})},
        stop=stop,
    )


def batcher(
    loaded: Loaded, cache: KVPrefixCache | None = None, prefill_step_tokens: int = 512
) -> ContinuousBatcher:
    model, tokenizer = loaded
    generator = TextGenerator(LocalModel(model, tokenizer), tokenizer, cache, prefill_step_tokens)
    return ContinuousBatcher(generator)


def text(outputs: list[BatchOutput]) -> str:
    """A finished reply's text (no failure in it)."""
    assert not [o for o in outputs if isinstance(o, GenerationFailed)], outputs
    assert isinstance(outputs[-1], Finished)
    return "".join(o.text for o in outputs if isinstance(o, TextDelta))


def failure(outputs: list[BatchOutput]) -> Exception:
    """A failed reply's error: its last output, and it never finished."""
    assert isinstance(outputs[-1], GenerationFailed), outputs
    assert not [o for o in outputs if isinstance(o, Finished)]
    return outputs[-1].error


def alone(loaded: Loaded, tokens: list[int], request: GenerationParams) -> str:
    batch = batcher(loaded)
    batch.add("alone", tokens, request)
    return text(drain(batch)["alone"])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_row_whose_sampling_raises_fails_alone(tiny: Loaded, sampled: bool) -> None:
    """A `logit_bias` naming a token past the vocabulary raises when the row's
    first token is drawn (in the batch's shared argmax, or on its own)."""
    tokenizer = tiny[1]
    good = params(tokenizer, sampled)
    bad = params(tokenizer, sampled, bias={10**6: 1.0})
    batch = batcher(tiny)
    for n, tokens in enumerate(PROMPTS[:3]):
        batch.add(f"r{n}", tokens, bad if n == 1 else good)
    together = drain(batch)
    assert "logit_bias" in str(failure(together["r1"]))
    for n in (0, 2):
        assert text(together[f"r{n}"]) == alone(tiny, PROMPTS[n], good)


class FailingStream(TextStream):
    """A text stream that raises at its `FAIL_AT`-th token when its request's stop
    strings name `MARKER` (the rest of the stream is the real one)."""

    MARKER = "<fail-here>"
    FAIL_AT = 4

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        params: GenerationParams,
        prompt_tokens: int,
        cached_tokens: int,
        speculation: SpeculationStats | None = None,
    ) -> None:
        super().__init__(tokenizer, params, prompt_tokens, cached_tokens, speculation)
        self._fails = self.MARKER in params.stop
        self._fed = 0

    def feed(self, sampled: SampledToken) -> list[batch_module.GenerationOutput]:
        self._fed += 1
        if self._fails and self._fed == self.FAIL_AT:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken detokenizer")
        return super().feed(sampled)


def test_a_row_whose_text_fails_mid_reply_fails_alone(
    tiny: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = tiny[1]
    good = params(tokenizer)
    bad = params(tokenizer, stop=(FailingStream.MARKER,))
    expected = [alone(tiny, tokens, good) for tokens in PROMPTS[:3]]
    monkeypatch.setattr(batch_module, "TextStream", FailingStream)
    batch = batcher(tiny)
    for n, tokens in enumerate(PROMPTS[:3]):
        batch.add(f"r{n}", tokens, bad if n == 1 else good)
    together = drain(batch)
    assert isinstance(failure(together["r1"]), UnicodeDecodeError)
    for n in (0, 2):
        assert text(together[f"r{n}"]) == expected[n]


class FailingStore(KVPrefixCache):
    """A prefix cache whose store of a sequence starting with `prompt` raises."""

    def __init__(self, prompt: Sequence[int]) -> None:
        super().__init__(1 << 30)
        self._prompt = list(prompt)

    def store(self, tokens: Sequence[int], layers: Sequence[LayerCache]) -> int | None:
        if list(tokens[: len(self._prompt)]) == self._prompt:
            raise MemoryError("no room for this entry")
        return super().store(tokens, layers)


def test_a_row_whose_cache_store_fails_fails_alone_and_the_others_are_stored(
    tiny: Loaded,
) -> None:
    tokenizer = tiny[1]
    good = params(tokenizer)
    expected = [alone(tiny, tokens, good) for tokens in PROMPTS[:3]]
    cache = FailingStore(PROMPTS[1])
    batch = batcher(tiny, cache)
    for n, tokens in enumerate(PROMPTS[:3]):
        batch.add(f"r{n}", tokens, good)
    together = drain(batch)
    assert isinstance(failure(together["r1"]), MemoryError)
    for n in (0, 2):
        assert text(together[f"r{n}"]) == expected[n]
        assert cache.lookup([*PROMPTS[n], 0]).usable >= len(PROMPTS[n])


class FailsWhenArmed(nn.Module):
    """A decoder layer that raises once, at its next decode step (one token a row)
    after `armed` is set; the real layer otherwise."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.use_sliding = layer.use_sliding  # the model reads it off its layers
        self.armed = False

    def __call__(self, x: mx.array, *args: object, **kwargs: object) -> mx.array:
        if self.armed and x.shape[1] == 1:
            self.armed = False
            raise RuntimeError("the forward pass failed")
        return self.layer(x, *args, **kwargs)


@pytest.fixture
def failing_layer(tiny: Loaded) -> Iterator[FailsWhenArmed]:
    layers = cast(list[nn.Module], tiny[0].layers)
    real = layers[1]
    failing = layers[1] = FailsWhenArmed(real)
    try:
        yield failing
    finally:
        layers[1] = real


def test_a_failed_forward_fails_the_batch_and_the_next_requests_reply_as_alone(
    tiny: Loaded, failing_layer: FailsWhenArmed
) -> None:
    """Two rows decode; a third request is still reading its prompt (a chunk a
    step) when a decode step's forward pass fails halfway through the model. Both
    rows fail; the reading request and one added afterwards reply as alone."""
    tokenizer = tiny[1]
    good = params(tokenizer)
    long_prompt = [1, *range(300, 340)]
    expected = {
        "late": alone(tiny, PROMPTS[3], good),
        "reading": alone(tiny, long_prompt, good),
    }
    batch = batcher(tiny, KVPrefixCache(1 << 30), prefill_step_tokens=8)
    batch.add("r0", PROMPTS[0], good)
    batch.add("r1", PROMPTS[1], good)
    outputs: dict[str, list[BatchOutput]] = {}
    while batch.batch_size < 2 or not any(isinstance(o, TextDelta) for o in outputs.get("r1", [])):
        for task_id, output in batch.step():
            outputs.setdefault(task_id, []).append(output)
    batch.add("reading", long_prompt, good)
    failing_layer.armed = True
    for task_id, output in batch.step():
        outputs.setdefault(task_id, []).append(output)
    assert not failing_layer.armed  # it did fail
    assert batch.batch_size == 0
    for task_id in ("r0", "r1"):
        assert "forward pass failed" in str(failure(outputs[task_id]))
    batch.add("late", PROMPTS[3], good)
    drain(batch, outputs)
    assert text(outputs["reading"]) == expected["reading"]
    assert text(outputs["late"]) == expected["late"]
