"""One rank of a pipeline run on the engine directly (no runner protocol), for tests
that look inside every rank: `python -m tests.pipeline_rank`, with `MLX_HOSTFILE`
and `MLX_RANK` set.

Rank 0 runs the requests of a JSON file (`[{"tokens": [...], "params": {...}}]`) in
order. After each task every rank checks that each prefix-cache entry it held
before the task is still there, bitwise unchanged, unless its own eviction
decisions dropped it. Each rank prints one JSON report line on stdout.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from exo.engine.mlx.load import load_model_tokenizer
from exo.engine.mlx.lockstep import LockstepBatch, LockstepFollower
from exo.engine.mlx.prefix_cache import KVPrefixCache, needs_checkpoints
from exo.engine.mlx.ring import join_ring
from exo.engine.mlx.ring_agreements import RingLead, handshake, ring_prefix_cache
from exo.engine.mlx.shard import load_shard, model_layer_count
from exo.shared.types.shard import LayerRange
from exo.shared.types.tasks import GenerationParams
from tests.in_process_ring import pipeline_rank_batch, serve_wave

EntryArrays = dict[int, list[np.ndarray]]


def entry_arrays(cache: KVPrefixCache) -> EntryArrays:
    return {
        entry_id: [np.array(a) for layer in cache.entry_layers(entry_id) for a in layer.state]
        for entry_id in cache.entry_ids()
    }


class CacheWatch:
    """Entries after each task, and whether the entries held before it were kept intact."""

    def __init__(self, cache: KVPrefixCache) -> None:
        self.cache = cache
        self.before: EntryArrays = {}
        self.entries: list[dict[int, int]] = []
        self.unchanged: list[bool] = []
        self.tokens: dict[int, tuple[int, ...]] = {}

    def task_ended(self) -> None:
        after = entry_arrays(self.cache)
        # An entry extended in place holds other tokens now: only same-token entries compare.
        kept = [i for i in self.before if i in after and self.tokens.get(i) == self._tokens(i)]
        self.unchanged.append(
            all(
                len(self.before[i]) == len(after[i])
                and all(np.array_equal(a, b) for a, b in zip(self.before[i], after[i], strict=True))
                for i in kept
            )
        )
        self.entries.append({i: len(self.cache.entry_tokens(i)) for i in after})
        self.before = after
        self.tokens = {i: self._tokens(i) for i in after}

    def _tokens(self, entry_id: int) -> tuple[int, ...]:
        return self.cache.entry_tokens(entry_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--start-layer", type=int, required=True)
    parser.add_argument("--end-layer", type=int, required=True)
    parser.add_argument("--byte-budget", type=int, required=True)
    parser.add_argument("--requests", type=Path, required=True)
    args = parser.parse_args()

    link = join_ring(timeout=60)
    total = model_layer_count(args.model_dir)
    layers = LayerRange(start=args.start_layer, end=args.end_layer, total=total)
    shard = load_shard(args.model_dir, layers)
    cache = ring_prefix_cache(link, args.byte_budget, lambda: False, lockstep=True)
    assert cache is not None
    agreed = handshake(
        link, layers, True, timeout=60, checkpoints=needs_checkpoints(shard.make_cache())
    )
    cache.ends_only = agreed.ends_only
    watch = CacheWatch(cache)
    report: dict[str, object] = {"rank": link.rank}
    batch = pipeline_rank_batch(link, shard, load_model_tokenizer(args.model_dir), cache)
    if link.rank == 0:
        lead = LockstepBatch(batch, link)
        results: list[dict[str, object]] = []
        for n, request in enumerate(json.loads(args.requests.read_text())):
            params = GenerationParams.model_validate(request["params"])
            ((text, usage),) = serve_wave(lead, [(n, (request["tokens"], params))])
            results.append({"text": text, "usage": usage.model_dump()})
            watch.task_ended()
        RingLead(link).shutdown()
        report["results"] = results
    else:
        LockstepFollower(link, batch).serve(on_task_end=watch.task_ended)
    report |= {
        "entries": watch.entries,
        "unchanged": watch.unchanged,
        "stats": cache.stats().model_dump(),
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
