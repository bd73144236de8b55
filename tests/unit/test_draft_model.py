"""A draft model (`engine/mlx/draft_model.py`) drafts what prompt lookup cannot,
inside the continuous batch, and never changes a reply: greedy replies are the
same with it, whether its drafts are all right (the served model drafting for
itself) or mostly wrong (a random model of the same tokenizer). A row reads a
long prompt a chunk per step, cuts its cache back after a refused draft, and a
draft model of other tokens is refused, on the node and in the runner."""

import json
import shutil
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx import draft_model
from exo.engine.mlx.batch import BatchOutput, ContinuousBatcher
from exo.engine.mlx.draft_model import DraftModel, DraftModelRefused, DraftRow
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.models.chat_tokenizer import load_chat_tokenizer
from exo.models.draft_models import draft_refusal
from exo.shared.types.tasks import GenerationParams
from tests.batch_drain import drain
from tests.model_factory import make_tiny_llama, make_tiny_model

Loaded = tuple[nn.Module, TokenizerWrapper]
PROSE = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def smollm(smollm_dir: Path) -> Loaded:
    return load_for_inference(smollm_dir)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A random model of the built-in model's tokenizer: its drafts are mostly wrong."""
    return make_tiny_llama(tmp_path_factory.mktemp("draft") / "tiny-draft", smollm_dir)


def _prompt(tokenizer: TokenizerWrapper) -> list[int]:
    tokens = tokenizer.apply_chat_template(PROSE, add_generation_prompt=True, tokenize=True)
    assert isinstance(tokens, list)
    return tokens


def _replies(
    served: Loaded, draft: DraftModel | None, rows: int, speculate: bool = True
) -> list[Finished | str]:
    model, tokenizer = served
    generator = TextGenerator(LocalModel(model, tokenizer), tokenizer, None)
    batch = ContinuousBatcher(generator, speculate=speculate, draft_model=draft)
    prompt = _prompt(tokenizer)
    for n in range(rows):  # replies of different lengths: the batch shrinks as they end
        batch.add(f"r{n}", prompt, GenerationParams(max_tokens=32 + 6 * n, temperature=0))
    outputs = drain(batch)
    replies: list[Finished | str] = []
    for n in range(rows):
        got: list[BatchOutput] = outputs[f"r{n}"]
        finished = got[-1]
        assert isinstance(finished, Finished), got
        replies += ["".join(o.text for o in got if isinstance(o, TextDelta)), finished]
    return replies


def _texts(replies: list[Finished | str]) -> list[str]:
    return [reply for reply in replies if isinstance(reply, str)]


def _usages(replies: list[Finished | str]) -> list[Finished]:
    return [reply for reply in replies if isinstance(reply, Finished)]


def test_the_served_model_drafting_for_itself_has_its_drafts_taken(smollm: Loaded) -> None:
    """Alone and beside another request (replies of different lengths)."""
    plain = _replies(smollm, None, 2, speculate=False)
    drafted = _replies(smollm, DraftModel(smollm[0], "itself"), 2)
    assert _texts(drafted) == _texts(plain)
    for finished in _usages(drafted):
        usage = finished.usage
        assert usage.drafted_tokens >= 16
        # Its greedy tokens are the served model's (up to float rounding).
        assert usage.accepted_draft_tokens >= 0.9 * usage.drafted_tokens


def test_a_draft_model_that_drafts_wrong_changes_no_reply(
    smollm: Loaded, random_draft: Path
) -> None:
    draft = DraftModel.load(random_draft, smollm[1])
    plain = _replies(smollm, None, 2, speculate=False)
    drafted = _replies(smollm, draft, 2)
    assert _texts(drafted) == _texts(plain)
    assert all(finished.usage.drafted_tokens > 0 for finished in _usages(drafted))


def _greedy(model: nn.Module, tokens: list[int], count: int) -> tuple[int, ...]:
    """`model`'s next `count` greedy tokens after `tokens`, read in one pass."""
    cache = make_prompt_cache(model)
    out: list[int] = []
    inputs = mx.array([tokens])
    for _ in range(count):
        token = cast(int, mx.argmax(model(inputs, cache=cache)[0, -1]).item())
        out.append(token)
        inputs = mx.array([[token]])
    return tuple(out)


def test_a_row_reads_a_long_prompt_a_chunk_per_step_then_drafts_greedily(
    smollm: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_model, "CATCH_UP_TOKENS", 8)
    row = DraftRow(DraftModel(smollm[0]))
    sequence = _prompt(smollm[1])[:30]
    steps_reading = 0
    while not (draft := row(sequence, 4)):
        steps_reading += 1
        assert steps_reading < 10
    assert steps_reading == 3  # 29 tokens before the last: 8 + 8 + 8, then 5 with the draft
    assert draft == _greedy(smollm[0], sequence, 4)


def test_after_a_refused_draft_a_row_drafts_as_a_fresh_one(smollm: Loaded) -> None:
    model = DraftModel(smollm[0])
    sequence = _prompt(smollm[1])
    row = DraftRow(model)
    first = row(sequence, 5)
    assert len(first) == 5
    # The reply took two of the drafted tokens, then wrote another.
    other = next(token for token in range(100, 200) if token != first[2])
    later = [*sequence, first[0], first[1], other]
    assert row(later, 4) == DraftRow(model)(later, 4) == _greedy(smollm[0], later, 4)


def _other_tokenizer(source: Path, target: Path) -> Path:
    """A copy of the model in `source` whose tokenizer has one token more."""
    shutil.copytree(source, target)
    path = target / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    tokenizer["added_tokens"].append(
        {
            "id": max(ids) + 1,
            "content": "<|extra|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    path.write_text(json.dumps(tokenizer))
    return target


def test_a_draft_model_of_other_tokens_is_refused(
    smollm: Loaded, smollm_dir: Path, random_draft: Path, tmp_path: Path
) -> None:
    other = _other_tokenizer(random_draft, tmp_path / "other-tokens")
    with pytest.raises(DraftModelRefused, match="vocabularies differ"):
        DraftModel.load(other, smollm[1])
    served = load_chat_tokenizer(smollm_dir)
    refusal = draft_refusal("other-tokens", other, served, ranks=1)
    assert refusal is not None and "tokenizer differs" in refusal
    assert draft_refusal("tiny-draft", random_draft, served, ranks=1) is None
    split = draft_refusal("tiny-draft", random_draft, served, ranks=2)
    assert split is not None and "whole on one node" in split
    missing = draft_refusal("gone", None, served, ranks=1)
    assert missing is not None and "not in this node's models directory" in missing


def test_a_draft_model_whose_caches_cannot_be_cut_back_is_refused(
    smollm: Loaded, smollm_dir: Path, tmp_path: Path
) -> None:
    hybrid = make_tiny_model("qwen3_next", tmp_path / "hybrid", smollm_dir, n_layers=4)
    with pytest.raises(DraftModelRefused, match="cannot be cut back"):
        DraftModel.load(hybrid, smollm[1])
