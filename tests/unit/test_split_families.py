"""Every family the tests build (dense, MoE, MLA, sliding windows, attention sinks,
linear attention) split into pipeline ranks replies exactly as the whole model,
and a conversation's second turn hits the prefix cache on every rank. The ranks
run the real protocol in threads of this process (`tests/in_process_ring.py`);
tiny random-weight models with the SmolLM2 tokenizer, float32 on the CPU."""

from collections.abc import Sequence
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model

from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_model_tokenizer, prepare_for_backend
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.shared.architectures import pipeline_refusal
from exo.shared.types.tasks import GenerationParams, Usage
from tests.in_process_ring import run_pipeline
from tests.model_factory import TINY_FAMILIES, make_tiny_model

# Longer than the tiny models' sliding windows (16 tokens): windows wrap.
FIRST_TURN = (
    "You are a coding agent. Read the file src/app.py, find the function that parses "
    "the configuration, and explain in two sentences what it does with missing keys."
)
SECOND_TURN = " Now rewrite it so that a missing key raises a clear error."
# Requests in flight at once on a split instance.
CONCURRENT = 4


def greedy(tokenizer: TokenizerWrapper) -> GenerationParams:
    # No EOS: every reply runs its full length, so the texts compare in full.
    no_eos = {token: -100.0 for token in tokenizer.eos_token_ids}
    return GenerationParams(max_tokens=10, temperature=0, logit_bias=no_eos)


def turns(tokenizer: TokenizerWrapper) -> list[list[int]]:
    first = tokenizer.encode(FIRST_TURN)
    return [first, first + tokenizer.encode(SECOND_TURN, add_special_tokens=False)]


def whole_replies(
    model_dir: Path, prompts: Sequence[Sequence[int]], params: GenerationParams
) -> list[tuple[str, Usage]]:
    model, config = load_model(model_dir)
    tokenizer = load_model_tokenizer(model_dir)
    generator = TextGenerator(
        LocalModel(prepare_for_backend(model, config), tokenizer), tokenizer, KVPrefixCache(1 << 30)
    )
    replies: list[tuple[str, Usage]] = []
    for prompt in prompts:
        outputs = list(generator.generate(prompt, params))
        text = "".join(o.text for o in outputs if isinstance(o, TextDelta))
        usage = next(o.usage for o in outputs if isinstance(o, Finished))
        replies.append((text, usage))
    return replies


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_splits_into_ranks_that_reply_as_the_whole_model(
    family: str, smollm_dir: Path, tmp_path: Path
) -> None:
    assert pipeline_refusal(family) is None
    model_dir = make_tiny_model(family, tmp_path / family, smollm_dir, n_layers=6)
    tokenizer = load_model_tokenizer(model_dir)
    prompts, params = turns(tokenizer), greedy(tokenizer)
    whole = whole_replies(model_dir, prompts, params)
    assert whole[1][1].cached_tokens >= len(prompts[0]) - 1  # the whole model hits too
    for bounds in ([0, 3, 6], [0, 1, 4, 6]):
        run = run_pipeline(model_dir, bounds, [(prompt, params) for prompt in prompts])
        assert [text for text, _ in run.replies] == [text for text, _ in whole], bounds
        assert run.replies[0][1].cached_tokens == 0
        assert run.replies[1][1].cached_tokens == whole[1][1].cached_tokens, bounds
        # The hit is every rank's: each restored its own layers of the entry.
        assert [(s.misses, s.memory_hits) for s in run.stats] == [(1, 1)] * (len(bounds) - 1)
    # Concurrent requests decode together on the ranks, each exactly as alone.
    first = prompts[0]
    requests = [
        (first[: len(first) - 3 * n], params.model_copy(update={"max_tokens": 6 + 2 * n}))
        for n in range(CONCURRENT)
    ]
    alone = run_pipeline(model_dir, [0, 3, 6], requests, cache_bytes=0)
    together = run_pipeline(model_dir, [0, 3, 6], requests, cache_bytes=0, together=True)
    assert [text for text, _ in together.replies] == [text for text, _ in alone.replies]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_pipeline_ranks_verify_drafts_in_one_forward_around_the_ring(
    family: str, smollm_dir: Path, tmp_path: Path
) -> None:
    """A predicted output drafts tokens; each verify step travels the ring as one
    forward, the last rank sends the accepted tokens round, and the reply is the
    whole model's."""
    model_dir = make_tiny_model(family, tmp_path / family, smollm_dir, n_layers=6)
    tokenizer = load_model_tokenizer(model_dir)
    prompt = turns(tokenizer)[0]
    params = greedy(tokenizer).model_copy(update={"max_tokens": 24})
    ((text, _),) = whole_replies(model_dir, [prompt], params)
    predicted = params.model_copy(
        update={"prediction": tuple(tokenizer.encode(text, add_special_tokens=False))}
    )
    run = run_pipeline(model_dir, [0, 3, 6], [(prompt, predicted)] * 2, together=True)
    for reply, usage in run.replies:
        assert reply == text
        assert usage.accepted_draft_tokens > 0
        assert usage.accepted_prediction_tokens == usage.accepted_draft_tokens
