"""Memory admission on split instances, with real runner processes on a
loopback ring: every rank judges a task by its own part of the KV, weights and
limit (`ADMIT` around the ring), the tightest decides, and the ring goes on
serving after a refusal."""

import random
import re
from fractions import Fraction
from pathlib import Path

import pytest

from exo.models.cards import card_from_folder
from exo.shared.types.ids import ModelId, TaskId
from exo.shared.types.tasks import GenerationParams
from exo.worker.runner.memory_admission import (
    MEMORY_LIMIT_ENV,
    largest_max_tokens,
    request_kv,
)
from exo.worker.runner.protocol import Generate, TaskFailed, TaskFinished
from tests.model_factory import make_tiny_llama
from tests.pipeline_harness import RunnerProcess, running_pipeline

pytestmark = pytest.mark.slow

LAYERS = 6
PROMPT = 20
# A limit that leaves each rank room for a few hundred tokens of its KV (the
# tiny model's float32 weights take ~13 MB: the embedding).
LIMIT = 16_000_000

_FIGURES = re.compile(
    r"memory admission: limit (\d+) bytes .*, weights (\d+) bytes .*, reserve (\d+) bytes"
)


def _task(name: str, max_tokens: int, seed: int) -> Generate:
    rng = random.Random(seed)
    return Generate(
        task_id=TaskId(name),
        tokens=[rng.randrange(10, 40_000) for _ in range(PROMPT)],
        params=GenerationParams(max_tokens=max_tokens, temperature=0, logit_bias={2: -100}),
    )


def _capacity(rank: RunnerProcess) -> int:
    """KV room the rank reported: limit - weights - reserve."""
    found = _FIGURES.search(rank.log_path.read_text())
    assert found is not None, f"no memory admission figures in {rank.log_path}"
    limit, weights, reserve = (int(n) for n in found.groups())
    assert limit == LIMIT
    return limit - weights - reserve


@pytest.mark.parametrize("split", ["pipeline", "tensor"])
def test_the_tightest_rank_decides_and_the_ring_goes_on(
    split: str, smollm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny", smollm_dir, n_layers=LAYERS)
    card = card_from_folder(ModelId("tiny"), model_dir)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(LIMIT))
    # Pipeline: rank 1 holds 5 of the 6 layers' KV; tensor: half of every layer's.
    bounds = [0, 1, LAYERS]
    parts = (
        [request_kv(card, "cpu", layers=(0, 1)), request_kv(card, "cpu", layers=(1, LAYERS))]
        if split == "pipeline"
        else [request_kv(card, "cpu", kv_share=Fraction(1, 2))] * 2  # 2 KV heads: 1 each
    )
    with running_pipeline(
        model_dir, tmp_path, bounds, tensor_ranks=2 if split == "tensor" else 0
    ) as pipeline:
        capacities = [_capacity(rank) for rank in pipeline.ranks]
        largest = min(
            largest_max_tokens(PROMPT, 100_000, capacity, kv_of)
            for capacity, kv_of in zip(capacities, parts, strict=True)
        )
        assert 0 < largest < 20_000
        entry = pipeline.entry
        for task in (_task("big", 100_000, 1), _task("small", 8, 2)):
            entry.send(task)
        big, small = entry.collect_all(["big", "small"], timeout=120)
        assert big.failed is not None and isinstance(big.failed, TaskFailed)
        refusal = big.failed.memory
        assert refusal is not None and refusal.never_fits
        assert refusal.largest_max_tokens == largest
        assert f"the largest max_tokens that fits is {largest}" in big.failed.error
        assert small.finished is not None and isinstance(small.finished, TaskFinished)
        assert small.finished.usage.completion_tokens == 8
