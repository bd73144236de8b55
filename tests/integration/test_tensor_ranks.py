"""Tensor ranks: real runner processes (`runner_main --tensor`) on a loopback
`mx.distributed` ring, each holding a slice of every layer of a tiny
random-weight model (SmolLM2 tokenizer, float32 on the CPU), reply as the whole
model does, hit the prefix cache on the second turn on every rank, and serve
concurrent requests together exactly as each alone. The families exo slices
itself are split unevenly (sizes the rank count does not divide)."""

from pathlib import Path
from typing import Any

import pytest

from exo.engine.mlx.load import load_model_tokenizer
from exo.shared.architectures import EXO_TENSOR_STRATEGIES, tensor_refusal
from exo.shared.types.tasks import GenerationParams
from tests.model_factory import TINY_FAMILIES, make_tiny_model
from tests.pipeline_harness import RunnerProcess, TaskResult, running_pipeline, wait_until
from tests.unit.test_split_families import greedy, turns, whole_replies

TENSOR_FAMILIES = [family for family in TINY_FAMILIES if tensor_refusal(family) is None]
# Sizes 2 and 3 ranks split unevenly: 3 KV heads (6 query heads), odd widths.
UNEVEN = {
    "hidden_size": 96,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "intermediate_size": 131,
    "moe_intermediate_size": 35,
    "shared_expert_intermediate_size": 37,
    "moe_shared_expert_intermediate_size": 37,
}
# Every request in flight at once, then each alone.
CONCURRENT = 4


def test_the_tiny_families_all_split_by_tensors() -> None:
    assert list(TINY_FAMILIES) == TENSOR_FAMILIES


@pytest.mark.parametrize("family", TENSOR_FAMILIES)
def test_two_tensor_ranks_reply_as_the_whole_model(
    family: str, smollm_dir: Path, tmp_path: Path
) -> None:
    """Two ranks: 2 KV heads and 1 (and their query heads), the MLP in 66/65
    columns, where exo slices the family; as mlx-lm's `shard()` divides it
    (evenly) otherwise."""
    overrides = UNEVEN if family in EXO_TENSOR_STRATEGIES else None
    _reply_as_the_whole_model(family, 2, overrides, smollm_dir, tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_three_tensor_ranks_split_unevenly_reply_as_the_whole_model(
    family: str, smollm_dir: Path, tmp_path: Path
) -> None:
    """Three ranks: 1 KV head each, the MLP in 44/44/43 columns (the experts' 12/12/11)."""
    _reply_as_the_whole_model(family, 3, UNEVEN, smollm_dir, tmp_path)


def _reply_as_the_whole_model(
    family: str, n_ranks: int, overrides: dict[str, Any] | None, smollm_dir: Path, tmp_path: Path
) -> None:
    model_dir = make_tiny_model(
        family, tmp_path / family, smollm_dir, n_layers=4, overrides=overrides
    )
    tokenizer = load_model_tokenizer(model_dir)
    prompts, params = turns(tokenizer), greedy(tokenizer)
    whole = whole_replies(model_dir, prompts, params)
    with running_pipeline(model_dir, tmp_path, [0, 4], tensor_ranks=n_ranks) as ranks:
        entry = ranks.entry
        replies = [entry.generate(f"turn-{n}", prompt, params) for n, prompt in enumerate(prompts)]
        assert [text for text, _ in replies] == [text for text, _ in whole]
        assert replies[0][1].cached_tokens == 0
        assert replies[1][1].cached_tokens == whole[1][1].cached_tokens > 0
        # Every rank restored its own heads of the entry: each reports the hit.
        for rank in ranks.ranks:
            wait_until(
                lambda rank=rank: _misses_and_hits(rank) == (1, 1), 10, f"{rank.log_path}'s hit"
            )


def _misses_and_hits(rank: RunnerProcess) -> tuple[int, int]:
    stats = rank.latest_cache_stats()
    return stats.misses, stats.memory_hits


def _concurrent_prompts(prompt: list[int]) -> list[list[int]]:
    return [prompt[: len(prompt) - 3 * n] for n in range(CONCURRENT)]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_tensor_ranks_batch_concurrent_requests_as_each_alone(
    family: str, smollm_dir: Path, tmp_path: Path
) -> None:
    model_dir = make_tiny_model(family, tmp_path / family, smollm_dir, n_layers=4)
    tokenizer = load_model_tokenizer(model_dir)
    prompts = _concurrent_prompts(turns(tokenizer)[0])
    params = [
        greedy(tokenizer).model_copy(update={"max_tokens": 6 + 2 * n}) for n in range(CONCURRENT)
    ]
    sampled = GenerationParams(max_tokens=8, temperature=0.8, seed=7)
    with running_pipeline(
        model_dir, tmp_path, [0, 4], prefix_cache_bytes=0, tensor_ranks=2
    ) as ranks:
        entry = ranks.entry
        alone = [entry.generate(f"alone-{n}", p, params[n]) for n, p in enumerate(prompts)]
        alone_sampled = entry.generate("alone-sampled", prompts[0], sampled)
        together = _all_at_once(
            entry,
            [(f"together-{n}", p, params[n]) for n, p in enumerate(prompts)]
            + [("together-sampled", prompts[0], sampled)],
        )
    assert [r.text for r in together[:CONCURRENT]] == [text for text, _ in alone]
    assert together[CONCURRENT].text == alone_sampled[0]


def _all_at_once(
    entry: RunnerProcess, tasks: list[tuple[str, list[int], GenerationParams]]
) -> list[TaskResult]:
    """Submit every task before reading any reply; the results in task order."""
    for task_id, prompt, params in tasks:
        entry.submit(task_id, prompt, params)
    results = entry.collect_all([task_id for task_id, _, _ in tasks], 240)
    assert all(result.finished is not None for result in results), results
    return results


def test_tensor_ranks_verify_drafts_on_rank_zeros_logits(smollm_dir: Path, tmp_path: Path) -> None:
    """A predicted output drafts tokens; every rank verifies them on rank 0's
    logits of every drafted position, and the reply is the whole model's."""
    model_dir = make_tiny_model("llama", tmp_path / "llama", smollm_dir, n_layers=4)
    tokenizer = load_model_tokenizer(model_dir)
    prompt = turns(tokenizer)[0]
    params = greedy(tokenizer).model_copy(update={"max_tokens": 24})
    ((text, _),) = whole_replies(model_dir, [prompt], params)
    prediction = tuple(tokenizer.encode(text, add_special_tokens=False))
    predicted = params.model_copy(update={"prediction": prediction})
    with running_pipeline(
        model_dir, tmp_path, [0, 4], prefix_cache_bytes=0, tensor_ranks=2
    ) as ranks:
        reply, usage = ranks.entry.generate("predicted", prompt, predicted)
    assert reply == text
    assert usage.accepted_prediction_tokens > 0
