"""The lockstep protocol (`engine/mlx/lockstep.py`) between two ranks in threads of
this process over a queue link, each holding the whole tiny model (no `all_sum`:
the protocol alone is under test; real tensor ranks are tested with processes in
tests/integration/test_tensor_ranks.py): the follower's batch makes every call
rank 0's does, cancellations mid-reply included, for both kinds of batch."""

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from exo.engine.mlx.batch import Batch, ContinuousBatcher, GenerationFailed
from exo.engine.mlx.generate import (
    Finished,
    GenerationCancelled,
    LocalModel,
    TextDelta,
    TextGenerator,
)
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.lockstep import (
    LOCKSTEP_EAGER_ROWS,
    Decisions,
    LockstepBatch,
    LockstepFollower,
)
from exo.engine.mlx.one_at_a_time import OneAtATime
from exo.engine.mlx.ring import Message
from exo.engine.mlx.ring_agreements import RingLead, ring_prefix_cache
from exo.shared.types.tasks import GenerationParams
from tests.in_process_ring import QueueLink
from tests.model_factory import make_tiny_model
from tests.unit.test_split_families import greedy, turns

_SECONDS = 120.0


def _rank_batch(
    model_dir: Path, link: QueueLink, one_at_a_time: bool, is_cancelled: Callable[[str], bool]
) -> Batch:
    model, tokenizer = load_for_inference(model_dir)
    local = LocalModel(model, tokenizer)
    local.eager_rows = LOCKSTEP_EAGER_ROWS
    cache = ring_prefix_cache(link, 1 << 30, lambda: False, lockstep=True)
    generator = TextGenerator(local, tokenizer, cache)
    if one_at_a_time:
        return OneAtATime(generator, is_cancelled=is_cancelled)
    return ContinuousBatcher(generator)


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_a_follower_makes_every_call_rank_zero_makes(
    one_at_a_time: bool, smollm_dir: Path, tmp_path: Path
) -> None:
    model_dir = make_tiny_model("qwen3", tmp_path / "qwen3", smollm_dir, n_layers=2)
    inboxes: list[queue.Queue[Message]] = [queue.Queue(), queue.Queue()]
    links = [QueueLink(rank, inboxes) for rank in range(2)]
    decide = [Decisions(link) for link in links]
    checks: dict[str, int] = {}

    def rank_zero_cancelled(task_id: str) -> bool:
        """The node's word, as rank 0 reads it: "cancelled" from its 3rd check on."""
        checks[task_id] = checks.get(task_id, 0) + 1
        return task_id == "cancelled" and checks[task_id] >= 3

    batches = [
        _rank_batch(
            model_dir, links[0], one_at_a_time, lambda t: decide[0](lambda: rank_zero_cancelled(t))
        ),
        _rank_batch(model_dir, links[1], one_at_a_time, lambda t: decide[1](lambda: False)),
    ]
    follower_error: list[BaseException] = []

    def follow() -> None:
        try:
            LockstepFollower(links[1], batches[1]).serve()
        except BaseException as error:
            follower_error.append(error)

    thread = threading.Thread(target=follow)
    thread.start()
    tokenizer = load_for_inference(model_dir)[1]
    first, second = turns(tokenizer)
    params = greedy(tokenizer)
    lead = LockstepBatch(batches[0], links[0])
    # The node cancels "cancelled" mid-reply: a continuous batch is told so
    # (`cancel`), a batch of one learns it from its own checks (`DECIDE`).
    cancel_step = None if one_at_a_time else 2
    try:
        replies = {
            "first": _serve(lead, "first", first, params),
            "cancelled": _serve(lead, "cancelled", second, params, cancel_step),
            "second": _serve(lead, "second", second, params),
        }
    finally:
        RingLead(links[0]).shutdown()
        thread.join(_SECONDS)
    assert not follower_error and not thread.is_alive()
    assert replies["cancelled"] is None
    assert replies["second"]
    assert batches[1].idle
    # Both ranks' prefix caches decided alike: a miss, then hits of the first turn.
    stats = [batch.prefix_cache.stats() for batch in batches if batch.prefix_cache]
    assert len(stats) == 2 and stats[0] == stats[1]
    assert (stats[0].misses, stats[0].memory_hits) == (1, 2)


def _serve(
    lead: LockstepBatch,
    task_id: str,
    tokens: list[int],
    params: GenerationParams,
    cancel_step: int | None = None,
) -> str | None:
    """One request through rank 0's batch, as the runner's loop serves it: its
    text, or None once cancelled (by `cancel` at `cancel_step`, or by the batch's
    own check)."""
    lead.add(task_id, tokens, params)
    text = ""
    for step in range(1000):
        if step == cancel_step:
            assert lead.cancel(task_id)
            return None
        for _, output in lead.step():
            if isinstance(output, TextDelta):
                text += output.text
            elif isinstance(output, Finished):
                return text
            elif isinstance(output, GenerationFailed):
                if isinstance(output.error, GenerationCancelled):
                    return None
                raise output.error
    raise AssertionError("the reply did not end")
