"""KVPrefixCache: matching, extend-vs-branch, shared chunks, LRU/byte budget, aliasing,
non-trimmable caches (checkpoints), generated tokens, miss diagnostics.

Unit tests use real mlx_lm cache objects filled with synthetic keys/values (position
encoded in the values, so a restore can be checked element by element); the aliasing
and exactness tests run a tiny random-weight llama on the CPU.
"""

import random
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.kv_chunks import CHUNK_TOKENS
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.prefix_cache import (
    EntryFootprint,
    KVPrefixCache,
    LayerCache,
    PrefixMatch,
    choose_evictions,
    layers_nbytes,
)
from exo.engine.token_trie import common_prefix_length
from exo.shared.types.cache_stats import CacheStats
from exo.shared.types.tasks import GenerationParams

HEADS, DIM = 2, 4
BIG = 1 << 40  # a byte budget nothing reaches

Tokens = tuple[int, ...]


def seq(n: int, start: int = 0) -> Tokens:
    return tuple(range(start, start + n))


A = seq(5000, 10_000)  # one "conversation"
B = seq(5000, 20_000)  # an unrelated one


def _kv(n: int, layer: int) -> tuple[mx.array, mx.array]:
    """Keys/values for positions 0..n-1 whose value is the position (plus a layer tag)."""
    pos = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1) + 1000.0 * layer
    keys = mx.broadcast_to(pos, (1, HEADS, n, DIM))
    return keys, -keys


def kv_layers(n: int, n_layers: int = 2) -> list[LayerCache]:
    layers: list[LayerCache] = []
    for i in range(n_layers):
        layer = KVCache()
        if n:
            layer.update_and_fetch(*_kv(n, i))
        layers.append(layer)
    mx.eval([layer.state for layer in layers])
    return layers


def rotating_layers(n: int, max_size: int = 8, n_layers: int = 2) -> list[LayerCache]:
    layers: list[LayerCache] = []
    for i in range(n_layers):
        layer = RotatingKVCache(max_size=max_size)
        layer.update_and_fetch(*_kv(n, i))
        layers.append(layer)
    mx.eval([layer.state for layer in layers])
    return layers


def arrays_layers(n: int) -> list[LayerCache]:
    layer = ArraysCache(2)
    layer[0] = mx.full((1, 3, 4), float(n))
    layer[1] = mx.full((1, 5), float(-n))
    mx.eval(layer.state)
    return [layer]


def kv_bytes(n: int, n_layers: int = 2) -> int:
    """Bytes the cache holds for `n` distinct positions of `kv_layers`: exact copies."""
    return n_layers * 2 * n * HEADS * DIM * 4


def positions(layer: LayerCache) -> list[float]:
    keys, values = layer.state[0], layer.state[1]
    k = np.array(keys[..., : layer.offset, :] if isinstance(layer, KVCache) else keys)
    v = np.array(values[..., : layer.offset, :] if isinstance(layer, KVCache) else values)
    assert np.array_equal(v, -k)
    return [float(x) for x in k[0, 0, :, 0]]


def store_fresh(
    cache: KVPrefixCache, tokens: Tokens, layers: list[LayerCache] | None = None
) -> int:
    """Store `tokens` the way the generator does: after a lookup."""
    cache.lookup((*tokens, -1))
    entry_id = cache.store(tokens, layers if layers is not None else kv_layers(len(tokens)))
    assert entry_id is not None
    return entry_id


def stats_dict(cache: KVPrefixCache) -> dict[str, int]:
    return cache.stats().model_dump()


# --- lookup / restore --------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "expected_entry", "usable", "kind"),
    [
        # "exact": everything but the one token always recomputed is reused.
        # Exact repeat of a cached prompt: one token is left to prefill.
        (B[:5], "b5", 4, "exact"),
        # A[:10] is cached twice over (a10, and inside a30): the more recently used wins.
        (A[:10], "a30", 9, "exact"),
        # A prefix of a cached sequence: all but the last prompt token.
        (A[:6], "a30", 5, "exact"),
        (A[:2], "a30", 1, "exact"),
        # An extension of a cached entry: the whole entry is usable.
        (A[:31], "a30", 30, "exact"),
        (A[:200], "a30", 30, "partial"),
        # Diverges inside the cached sequence: up to the divergence point.
        ((*A[:17], 7), "a30", 17, "exact"),
        ((*A[:30], 7, 8), "a30", 30, "partial"),
        # The longer entry of two on the same path is preferred when it is usable.
        ((*A[:12], 7), "a30", 12, "exact"),
        # Only B's entry shares anything.
        ((*B[:3], *A[:5]), "b5", 3, "partial"),
        # Misses: nothing in common, a single token, an empty prompt, only the first token.
        (seq(20, 90_000), None, 0, "miss"),
        (A[:1], None, 0, "miss"),
        ((), None, 0, "miss"),
        ((A[0], 7, 7, 7), "a30", 1, "partial"),
        ((7, *A[:10]), None, 0, "miss"),
    ],
)
def test_lookup_table(query: Tokens, expected_entry: str | None, usable: int, kind: str) -> None:
    cache = KVPrefixCache(BIG)
    ids = {
        "a10": store_fresh(cache, A[:10]),
        "b5": store_fresh(cache, B[:5]),
    }
    # a30 is stored last and touched most recently, so it wins ties between a10/a30.
    ids["a30"] = store_fresh(cache, A[:30])
    before = stats_dict(cache)

    match = cache.lookup(query)

    assert match.prompt_length == len(query)
    assert match.usable == usable
    assert match.usable <= max(len(query) - 1, 0)
    assert match.entry_id == (ids[expected_entry] if expected_entry else None)
    assert match.is_hit == (expected_entry is not None)
    after = stats_dict(cache)
    assert after["lookups"] == before["lookups"] + 1
    assert after["hits_exact"] - before["hits_exact"] == (kind == "exact")
    assert after["hits_partial"] - before["hits_partial"] == (kind == "partial")
    assert after["misses"] - before["misses"] == (kind == "miss")
    assert after["tokens_reused"] - before["tokens_reused"] == usable

    restored = cache.restore(match)
    if expected_entry is None:
        assert restored is None
        return
    assert restored is not None
    for i, layer in enumerate(restored):
        assert layer.offset == usable
        assert positions(layer) == [1000.0 * i + p for p in range(usable)]


def test_restore_gives_new_objects_and_leaves_entry_intact() -> None:
    cache = KVPrefixCache(BIG)
    entry_id = store_fresh(cache, A[:40])
    entry_layers = cache.entry_layers(entry_id)
    match = cache.lookup((*A[:25], 1, 2))
    restored = cache.restore(match)
    assert restored is not None
    for fresh, stored in zip(restored, entry_layers, strict=True):
        assert fresh is not stored
        assert fresh.keys is not stored.keys and fresh.values is not stored.values
        assert fresh.offset == 25
        assert stored.offset == 40  # trimming the restore did not trim the entry
    assert cache.entry_tokens(entry_id) == A[:40]
    # A second restore of the full entry still sees all 40 positions.
    full = cache.restore(cache.lookup(A[:41]))
    assert full is not None
    assert [layer.offset for layer in full] == [40, 40]
    assert positions(full[1]) == [1000.0 + p for p in range(40)]


def test_restore_of_a_miss_or_evicted_entry_is_none() -> None:
    cache = KVPrefixCache(kv_bytes(10))  # room for one entry
    assert cache.restore(PrefixMatch(entry_id=None, usable=0, prompt_length=5)) is None
    entry_id = store_fresh(cache, A[:10])
    match = cache.lookup(A[:20])
    assert match.entry_id == entry_id
    store_fresh(cache, B[:10])  # evicts A's entry
    assert cache.restore(match) is None
    assert cache.lookup(A[:20]).entry_id is None
    assert cache.stats().entries == 1
    assert cache.stats().bytes == kv_bytes(10)


def test_lookup_prefers_most_recently_used_of_equivalent_entries() -> None:
    cache = KVPrefixCache(BIG)
    first = store_fresh(cache, (*A[:8], 1, 1))
    second = store_fresh(cache, (*A[:8], 2, 2))
    query = (*A[:8], 3)
    assert cache.lookup(query) == PrefixMatch(entry_id=second, usable=8, prompt_length=9)
    cache.lookup((*A[:8], 1, 1, 5))  # touches `first`
    assert cache.lookup(query) == PrefixMatch(entry_id=first, usable=8, prompt_length=9)


def test_stats_counters_over_a_session() -> None:
    cache = KVPrefixCache(BIG)
    assert cache.stats() == CacheStats(byte_budget=BIG)
    cache.lookup(A[:50])  # miss
    cache.store(A[:49], kv_layers(49))
    cache.lookup(A[:50])  # exact: 49 reused, the last token is always computed
    cache.lookup(A[:49])  # exact: 48 reused
    cache.lookup(A[:20])  # exact: 19 reused
    cache.lookup(B[:20])  # miss
    cache.store(B[:10], kv_layers(10))
    cache.lookup((*B[:10], *A[:3]))  # partial: 10 reused
    misses = cache.stats().recent_misses
    counters = cache.stats().model_dump(exclude={"recent_misses"})
    assert counters == {
        "lookups": 6,
        "hits_exact": 3,
        "hits_partial": 1,
        "misses": 2,
        "tokens_reused": 49 + 48 + 19 + 10,
        "memory_hits": 4,
        "disk_hits": 0,
        "entries": 2,
        "chunks": 0,
        "bytes": kv_bytes(49) + kv_bytes(10),
        "evictions": 0,
        "byte_budget": BIG,
        "disk_entries": 0,
        "disk_bytes": 0,
        "disk_byte_budget": 0,
    }
    assert [m.reason for m in misses] == ["new", "new"]
    # A stats snapshot is a copy, not a live view.
    snapshot = cache.stats()
    cache.lookup(A[:50])
    assert snapshot.lookups == 6
    assert cache.stats().lookups == 7


def test_store_of_an_existing_sequence_keeps_one_entry() -> None:
    cache = KVPrefixCache(BIG)
    entry_id = store_fresh(cache, A[:20])
    before = cache.stats().bytes
    assert cache.store(A[:20], kv_layers(20)) == entry_id
    # A prefix of a stored sequence is held already.
    assert cache.store(A[:12], kv_layers(12)) == entry_id
    assert (cache.stats().entries, cache.stats().bytes) == (1, before)


def test_store_of_no_tokens_keeps_nothing() -> None:
    cache = KVPrefixCache(BIG)
    assert cache.store((), kv_layers(0)) is None
    assert cache.stats().entries == 0


def test_bytes_are_counted_from_the_arrays_held() -> None:
    cache = KVPrefixCache(BIG)
    for n in (1, 63, 64, 65, 257):
        store_fresh(cache, A[:n])  # each extends the one before: one entry
        assert cache.stats().bytes == kv_bytes(n)
    store_fresh(cache, B[:700])
    assert cache.stats().entries == 2
    assert cache.stats().bytes == kv_bytes(257) + kv_bytes(700)
    assert cache.stats().chunks == 257 // CHUNK_TOKENS + 700 // CHUNK_TOKENS


# --- extend, never overwrite --------------------------------------------------------

SYSTEM = seq(300, 70_000)


@pytest.mark.parametrize(
    ("first", "second", "extends"),
    [
        # The next turn of one conversation: the entry is extended in place.
        ((*SYSTEM, *A[:50]), (*SYSTEM, *A[:120]), True),
        # Two sessions whose first user messages share words: a branch, both stay.
        ((*SYSTEM, *A[:50]), (*SYSTEM, *A[:20], *B[:60]), False),
        # Only the system prompt in common.
        ((*SYSTEM, *A[:50]), (*SYSTEM, *B[:50]), False),
        # An edit of an earlier message of the same conversation: a branch too.
        ((*SYSTEM, *A[:200]), (*SYSTEM, *A[:150], *B[:10]), False),
        # Nothing in common.
        (A[:80], B[:80], False),
        # A long shared prefix and a one-token difference at the end.
        ((*SYSTEM, *A[:50]), (*SYSTEM, *A[:49], 7), False),
    ],
)
def test_extend_or_branch(first: Tokens, second: Tokens, extends: bool) -> None:
    cache = KVPrefixCache(BIG)
    first_id = store_fresh(cache, first)
    second_id = store_fresh(cache, second)

    assert (second_id == first_id) is extends
    assert cache.stats().entries == (1 if extends else 2)
    # Both sequences are still served in full (all but a query's last token).
    for tokens in (first, second):
        match = cache.lookup((*tokens, 5))
        assert match.usable == len(tokens)
        restored = cache.restore(match)
        assert restored is not None and positions(restored[1]) == [
            1000.0 + p for p in range(len(tokens))
        ]
    # The shared prefix is held once: bytes are those of the distinct positions.
    shared = common_prefix_length(first, second)
    assert cache.stats().bytes <= kv_bytes(len(first) + len(second) - shared) + kv_bytes(
        CHUNK_TOKENS
    )


def test_twelve_sessions_round_robin_keep_their_history_in_shared_chunks() -> None:
    """12 sessions behind one system prompt, 3 turns each, served round-robin: every
    later turn reuses its whole history, and the cache holds little more than the
    bytes of the distinct tokens."""
    rng = random.Random(12)
    cache = KVPrefixCache(BIG)
    history = {s: list(SYSTEM) for s in range(12)}
    distinct = len(SYSTEM)
    next_token = 200_000
    for turn in range(3):
        for session in range(12):
            user = rng.randint(20, 120)
            prompt = [*history[session], *range(next_token, next_token + user)]
            next_token += user
            match = cache.lookup(prompt)
            # The whole history (the very first prompt finds nothing).
            assert match.usable == (len(history[session]) if turn or session else 0)
            reply = rng.randint(10, 60)
            history[session] = [*prompt, *range(next_token, next_token + reply)]
            next_token += reply
            distinct += user + reply
            cache.store(history[session], kv_layers(len(history[session])))
    assert cache.stats().entries == 12
    assert cache.stats().bytes <= 1.2 * kv_bytes(distinct)


# --- generated tokens: the reply is kept -------------------------------------------


def test_reply_tokens_are_reused_by_the_next_turn(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    cache = KVPrefixCache(BIG)
    warm = TextGenerator(LocalModel(model, tokenizer), tokenizer, cache, prefill_step_tokens=16)
    cold = TextGenerator(LocalModel(model, tokenizer), tokenizer, None, prefill_step_tokens=16)
    prompt = random_tokens(30, seed=11)
    warm_outputs = list(warm.generate(prompt, GenerationParams(max_tokens=8, temperature=0)))
    done = warm_outputs[-1]
    assert isinstance(done, Finished)
    reply = _greedy_ids(model, prompt, done.usage.completion_tokens)
    # One entry: the prompt's, extended by the reply the cache objects hold.
    (entry_id,) = cache.entry_ids()
    stored = cache.entry_tokens(entry_id)
    assert stored[: len(prompt)] == tuple(prompt)
    assert list(stored[len(prompt) :]) == reply[: len(stored) - len(prompt)]
    assert len(stored) >= len(prompt) + len(reply) - 1
    follow_up = [*prompt, *reply, *random_tokens(6, seed=12)]
    text, finished = _run(warm, follow_up)
    assert finished.usage.cached_tokens == len(stored)
    cold_text, cold_finished = _run(cold, follow_up)
    assert (text, finished.finish_reason) == (cold_text, cold_finished.finish_reason)


def _greedy_ids(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    tokens, _ = greedy(model, make_prompt_cache(model), prompt, n)
    return tokens[:n]


# --- LRU and byte budget -----------------------------------------------------------


def _footprints(spec: dict[int, tuple[int, int, tuple[str, ...]]]) -> dict[int, EntryFootprint]:
    """id -> (own bytes, last used, chunk names)."""
    return {
        i: EntryFootprint(last_used=used, chunks=tuple(c.encode() for c in chunks), own_nbytes=own)
        for i, (own, used, chunks) in spec.items()
    }


@pytest.mark.parametrize(
    ("spec", "chunks", "budget", "pressure", "keep", "victims"),
    [
        # Within budget: nothing.
        ({1: (10, 1, ()), 2: (10, 2, ())}, {}, 20, False, 2, []),
        ({}, {}, 0, False, None, []),
        # Over budget: least recently used first, until it fits.
        ({1: (10, 3, ()), 2: (10, 1, ()), 3: (10, 2, ())}, {}, 20, False, None, [2]),
        ({1: (10, 3, ()), 2: (10, 1, ()), 3: (10, 2, ())}, {}, 10, False, None, [2, 3]),
        # `keep` is never evicted to make room for older entries.
        ({1: (10, 9, ()), 2: (10, 1, ())}, {}, 10, False, 1, [2]),
        # An entry larger than the whole budget is dropped, without evicting others.
        ({1: (10, 1, ()), 2: (10, 2, ()), 3: (100, 3, ())}, {}, 50, False, 3, [3]),
        # ... counting the chunks it holds.
        ({1: (10, 1, ()), 2: (1, 2, ("s", "t"))}, {"s": 30, "t": 30}, 50, False, 2, [2]),
        # Shared chunks are freed only with their last holder: dropping the oldest
        # session frees its own bytes only, so the next one goes too.
        (
            {1: (10, 1, ("s",)), 2: (10, 2, ("s",)), 3: (10, 3, ("s",))},
            {"s": 100},
            115,
            False,
            3,
            [1, 2],
        ),
        # A chunk held by one entry goes with it.
        ({1: (10, 1, ("a",)), 2: (10, 2, ("b",))}, {"a": 50, "b": 50}, 60, False, 2, [1]),
        # Memory pressure: everything but the newest.
        ({1: (10, 1, ("s",)), 2: (10, 2, ("s",)), 3: (10, 3, ())}, {"s": 5}, BIG, True, 3, [1, 2]),
    ],
)
def test_choose_evictions(
    spec: dict[int, tuple[int, int, tuple[str, ...]]],
    chunks: dict[str, int],
    budget: int,
    pressure: bool,
    keep: int | None,
    victims: list[int],
) -> None:
    entries = _footprints(spec)
    chunk_bytes = {name.encode(): size for name, size in chunks.items()}
    chosen = choose_evictions(entries, chunk_bytes, budget, pressure, keep)
    assert chosen == victims
    left = [e for i, e in entries.items() if i not in chosen]
    held = {c for e in left for c in e.chunks}
    if not pressure:
        assert sum(e.own_nbytes for e in left) + sum(chunk_bytes[c] for c in held) <= budget


def test_lru_eviction_order_and_budget() -> None:
    size = kv_bytes(10)
    cache = KVPrefixCache(byte_budget=3 * size)
    ids = [store_fresh(cache, seq(10, 1000 * (k + 1))) for k in range(3)]
    assert cache.stats().bytes == 3 * size
    assert cache.stats().evictions == 0

    # Touch the oldest; the second becomes least recently used.
    assert cache.lookup(seq(11, 1000)).entry_id == ids[0]
    fourth = store_fresh(cache, seq(10, 4000))
    assert cache.stats().evictions == 1
    assert cache.lookup(seq(11, 2000)).entry_id is None  # evicted
    assert cache.lookup(seq(11, 3000)).entry_id == ids[2]
    assert cache.lookup(seq(11, 1000)).entry_id == ids[0]
    assert cache.lookup(seq(11, 4000)).entry_id == fourth
    assert cache.stats().bytes == 3 * size

    # Now ids[2] is the least recently used... then ids[0], then fourth.
    cache.lookup(seq(11, 1000))
    cache.lookup(seq(11, 4000))
    fifth = store_fresh(cache, seq(10, 5000))
    assert cache.lookup(seq(11, 3000)).entry_id is None
    assert {cache.lookup(seq(11, 1000 * k)).entry_id for k in (1, 4, 5)} == {ids[0], fourth, fifth}
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (3, 3 * size, 2)

    # A bigger entry pushes out as many old ones as it needs.
    big = store_fresh(cache, seq(25, 60_000))
    assert cache.stats().bytes <= cache.byte_budget
    assert cache.stats().entries == 1
    assert cache.lookup(seq(26, 60_000)).entry_id == big


@pytest.mark.parametrize("budget_entries", [1, 2, 5])
def test_byte_budget_always_respected(budget_entries: int) -> None:
    rng = random.Random(budget_entries)
    budget = budget_entries * kv_bytes(256)
    cache = KVPrefixCache(byte_budget=budget)
    stored: set[int] = set()
    for k in range(30):
        n = rng.randint(1, 600)
        entry_id = cache.store(seq(n, 10_000 * k), kv_layers(n))
        stats = cache.stats()
        assert stats.bytes <= budget
        alive = [i for i in (*stored, entry_id) if i is not None and _alive(cache, i)]
        assert stats.bytes == sum(layers_nbytes(cache.entry_layers(i)) for i in alive)
        if kv_bytes(n) <= budget:
            assert entry_id is not None  # the newest entry is kept whenever it fits
        else:
            assert entry_id is None
        if entry_id is not None:
            stored.add(entry_id)
    assert cache.stats().evictions > 0


def _alive(cache: KVPrefixCache, entry_id: int) -> bool:
    try:
        cache.entry_tokens(entry_id)
    except KeyError:
        return False
    return True


def test_entry_larger_than_budget_is_not_kept_and_evicts_nothing() -> None:
    cache = KVPrefixCache(byte_budget=2 * kv_bytes(10))
    small = store_fresh(cache, A[:10])
    before = cache.stats()
    cache.lookup(B[:1001])
    huge = cache.store(B[:1000], kv_layers(1000))
    assert huge is None
    assert cache.lookup(B[:1001]).entry_id is None
    assert cache.lookup(A[:11]).entry_id == small
    after = cache.stats()
    assert (after.entries, after.bytes) == (before.entries, before.bytes)
    assert after.evictions == before.evictions + 1


def test_memory_pressure_evicts_all_but_the_newest() -> None:
    pressure = False
    cache = KVPrefixCache(byte_budget=BIG, memory_pressure=lambda: pressure)
    ids = [store_fresh(cache, seq(20, 1000 * (k + 1))) for k in range(4)]
    assert cache.stats().entries == 4
    pressure = True
    newest = store_fresh(cache, seq(20, 9000))
    assert newest not in ids
    stats = cache.stats()
    assert (stats.entries, stats.evictions, stats.bytes) == (1, 4, kv_bytes(20))
    assert cache.lookup(seq(21, 9000)).entry_id == newest
    for k in range(4):
        assert cache.lookup(seq(21, 1000 * (k + 1))).entry_id is None
    pressure = False
    store_fresh(cache, seq(20, 8000))
    assert cache.stats().entries == 2


# --- non-trimmable caches -------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "usable"),
    [
        (A[:21], 20),  # the snapshot ends exactly one token before the prompt ends
        (A[:30], 20),
        ((*A[:22], 7, 7), 20),
        ((*A[:20], 7), 20),
        (A[:20], 0),  # would need trimming the snapshot to 19 tokens
        (A[:19], 0),
        ((*A[:15], 7, 7, 7, 7, 7, 7), 0),  # diverges inside the snapshot
        (B[:30], 0),
    ],
)
@pytest.mark.parametrize("kind", ["rotating", "arrays", "mixed"])
def test_non_trimmable_only_restored_at_or_below_match_point(
    query: Tokens, usable: int, kind: str
) -> None:
    if kind == "rotating":
        layers = rotating_layers(20, max_size=8)
    elif kind == "arrays":
        layers = arrays_layers(20)
    else:  # one trimmable and one non-trimmable layer: the entry is non-trimmable
        layers = [kv_layers(20, n_layers=1)[0], rotating_layers(20, max_size=8, n_layers=1)[0]]
    assert not all(layer.is_trimmable() for layer in layers)
    cache = KVPrefixCache(BIG)
    entry_id = store_fresh(cache, A[:20], layers)

    match = cache.lookup(query)

    assert match.usable == usable
    assert match.entry_id == (entry_id if usable else None)
    restored = cache.restore(match)
    if not usable:
        assert restored is None
        assert cache.stats().misses == 2  # the store's lookup and this one
        return
    assert restored is not None
    for fresh, stored in zip(restored, cache.entry_layers(entry_id), strict=True):
        assert fresh is not stored
        for got, want in zip(fresh.state, stored.state, strict=True):
            if isinstance(want, mx.array):
                assert np.array_equal(np.array(got), np.array(want))
            elif isinstance(want, list):
                assert all(
                    np.array_equal(np.array(g), np.array(w)) for g, w in zip(got, want, strict=True)
                )
            else:
                assert got == want


def test_rotating_cache_written_in_place_does_not_alias() -> None:
    """Single-token decode rotates a full window in place; neither the restore nor the
    source that was stored may write into the entry's buffers."""
    source = []
    for i in range(2):
        layer = RotatingKVCache(max_size=8)
        for p in range(8):
            keys, values = _kv(p + 1, i)
            layer.update_and_fetch(keys[..., p:, :], values[..., p:, :])
        source.append(layer)
    mx.eval([layer.state for layer in source])
    cache = KVPrefixCache(BIG)
    entry_id = store_fresh(cache, A[:8], source)
    before = [np.array(layer.keys) for layer in cache.entry_layers(entry_id)]
    assert [float(x) for x in before[0][0, 0, :, 0]] == [float(p) for p in range(8)]

    restored = cache.restore(cache.lookup(A[:9]))
    assert restored is not None
    marker = mx.full((1, HEADS, 1, DIM), 99.0)
    for layer in (*restored, *source):
        layer.update_and_fetch(marker, -marker)  # overwrites slot 0 of the window
    mx.eval([layer.state for layer in (*restored, *source)])
    assert float(np.array(restored[0].keys)[0, 0, 0, 0]) == 99.0
    assert float(np.array(source[0].keys)[0, 0, 0, 0]) == 99.0
    for layer, want in zip(cache.entry_layers(entry_id), before, strict=True):
        assert np.array_equal(np.array(layer.keys), want)
        assert layer.offset == 8


def test_snapshots_at_chunk_boundaries_serve_the_deepest_usable_one() -> None:
    cache = KVPrefixCache(BIG)
    snaps = {n: store_fresh(cache, A[:n], rotating_layers(n)) for n in (16, 32, 48)}
    table = {
        A[:16]: (None, 0),
        A[:17]: (snaps[16], 16),
        A[:33]: (snaps[32], 32),
        (*A[:40], 7): (snaps[32], 32),
        A[:48]: (snaps[32], 32),
        A[:100]: (snaps[48], 48),
    }
    for query, (entry_id, usable) in table.items():
        assert cache.lookup(query) == PrefixMatch(entry_id, usable, len(query)), len(query)


def test_shorter_trimmable_entry_is_used_when_deeper_ones_are_not_trimmable() -> None:
    """A KVCache entry ending before the match point serves the hit even though the
    deeper entry on the same path cannot be cut back."""
    cache = KVPrefixCache(BIG)
    short = store_fresh(cache, A[:10])
    store_fresh(cache, A[:40], rotating_layers(40))
    match = cache.lookup((*A[:25], 7))
    assert match == PrefixMatch(short, 10, 26)
    restored = cache.restore(match)
    assert restored is not None
    assert [layer.offset for layer in restored] == [10, 10]
    assert positions(restored[0]) == [float(p) for p in range(10)]


def test_trimmable_and_snapshot_entries_together() -> None:
    cache = KVPrefixCache(BIG)
    snap = store_fresh(cache, A[:20], rotating_layers(20))
    full = store_fresh(cache, A[:30])
    # The trimmable entry covers any depth along its path.
    assert cache.lookup((*A[:25], 7)) == PrefixMatch(full, 25, 26)
    assert cache.lookup(A[:20]) == PrefixMatch(full, 19, 20)
    # Past the trimmable entry, the snapshot does not beat it.
    assert cache.lookup(A[:40]) == PrefixMatch(full, 30, 40)
    # Diverging before 20: only the trimmable entry can serve.
    assert cache.lookup((*A[:15], 7)) == PrefixMatch(full, 15, 16)
    assert snap != full


# --- real model: aliasing and exactness ----------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    return load_for_inference(tiny_model_dir)


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40_000) for _ in range(n)]


def prefill(model: nn.Module, layers: list[LayerCache], tokens: list[int]) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=layers)[:, -1, :]
    mx.eval(logits, [layer.state for layer in layers])
    return logits


def greedy(
    model: nn.Module, layers: list[LayerCache], tokens: list[int], n: int
) -> tuple[list[int], list[np.ndarray]]:
    """Feed `tokens`, then decode `n` tokens greedily; returns tokens and every logits row."""
    logits = prefill(model, layers, tokens)
    out: list[int] = []
    rows = [np.array(logits)]
    for _ in range(n):
        token = int(np.array(mx.argmax(logits, axis=-1))[0])
        out.append(token)
        logits = prefill(model, layers, [token])
        rows.append(np.array(logits))
    return out, rows


def numpy_state(layers: list[LayerCache]) -> list[list[np.ndarray | int]]:
    copies: list[list[np.ndarray | int]] = []
    for layer in layers:
        row: list[np.ndarray | int] = []
        for value in layer.state:
            row.append(np.array(value, copy=True) if isinstance(value, mx.array) else value)
        copies.append(row)
    return copies


def assert_same_state(layers: list[LayerCache], before: list[list[np.ndarray | int]]) -> None:
    after = numpy_state(layers)
    assert len(after) == len(before)
    for got_row, want_row in zip(after, before, strict=True):
        for got, want in zip(got_row, want_row, strict=True):
            if isinstance(want, np.ndarray):
                assert isinstance(got, np.ndarray)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert got.tobytes() == want.tobytes()  # bit-identical
            else:
                assert got == want


def test_stored_entry_is_never_mutated(tiny: tuple[nn.Module, TokenizerWrapper]) -> None:
    model, _ = tiny
    prompt = random_tokens(40, seed=1)
    cache = KVPrefixCache(BIG)
    source = make_prompt_cache(model)
    prefill(model, source, prompt)
    cache.lookup([*prompt, 5])
    entry_id = cache.store(prompt, source)
    assert entry_id is not None
    before = numpy_state(cache.entry_layers(entry_id))
    assert [row[2] for row in before] == [40, 40]  # KVCache offsets

    # The source cache that was stored keeps decoding (writes into its buffer).
    greedy(model, source, [7], 20)
    assert [layer.offset for layer in source] == [61, 61]
    assert_same_state(cache.entry_layers(entry_id), before)

    # A full hit: the restore decodes into positions 40.. of the shared buffer.
    full = cache.restore(cache.lookup([*prompt, 9, 9]))
    assert full is not None
    greedy(model, full, [9, 9], 10)
    assert_same_state(cache.entry_layers(entry_id), before)

    # A partial hit: the restore overwrites positions 25..39 the entry still holds.
    match = cache.lookup([*prompt[:25], *random_tokens(10, seed=2)])
    assert match.usable == 25
    partial = cache.restore(match)
    assert partial is not None
    greedy(model, partial, random_tokens(10, seed=2), 10)
    assert_same_state(cache.entry_layers(entry_id), before)

    # Two restores in flight at once do not see each other's writes either.
    r1 = cache.restore(cache.lookup([*prompt[:30], 1]))
    r2 = cache.restore(cache.lookup([*prompt[:30], 2]))
    assert r1 is not None and r2 is not None
    tokens1, _ = greedy(model, r1, [1], 5)
    tokens2, _ = greedy(model, r2, [2], 5)
    cold1, _ = greedy(model, make_prompt_cache(model), [*prompt[:30], 1], 5)
    cold2, _ = greedy(model, make_prompt_cache(model), [*prompt[:30], 2], 5)
    assert (tokens1, tokens2) == (cold1, cold2)
    assert_same_state(cache.entry_layers(entry_id), before)


@pytest.mark.parametrize("usable", [1, 17, 25, 40])
def test_partial_hit_restore_matches_cold_prefill_exactly(
    tiny: tuple[nn.Module, TokenizerWrapper], usable: int
) -> None:
    model, _ = tiny
    stored = random_tokens(40, seed=3)
    prompt = [*stored[:usable], *random_tokens(12, seed=4)]
    cache = KVPrefixCache(BIG)
    source = make_prompt_cache(model)
    prefill(model, source, stored)
    cache.lookup([*stored, 1])
    cache.store(stored, source)

    match = cache.lookup(prompt)
    assert match.usable == usable
    restored = cache.restore(match)
    assert restored is not None
    warm_tokens, warm_rows = greedy(model, restored, prompt[usable:], 8)

    cold_tokens, cold_rows = greedy(model, make_prompt_cache(model), prompt, 8)
    assert warm_tokens == cold_tokens
    # OpenBLAS's summation order depends on the row count, so a prompt read in
    # one pass and one read after a restore agree to rounding, not bit for bit.
    for warm, cold in zip(warm_rows, cold_rows, strict=True):
        np.testing.assert_allclose(warm, cold, rtol=1e-5, atol=1e-5)


def sliding_window_cache(model: nn.Module, window: int) -> list[LayerCache]:
    # (llama's own make_cache ignores max_kv_size, so build the rotating caches here)
    return [RotatingKVCache(max_size=window, keep=4) for _ in make_prompt_cache(model)]


def test_rotating_snapshot_restore_matches_cold_prefill(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    """Sliding-window caches: snapshots at chunk boundaries serve a later prompt exactly,
    and a prompt diverging inside a snapshot misses rather than getting wrong state."""
    model, _ = tiny
    window, chunk = 16, 20
    stored = random_tokens(3 * chunk, seed=5)
    cache = KVPrefixCache(BIG)
    source = sliding_window_cache(model, window)
    for end in range(chunk, len(stored) + 1, chunk):
        prefill(model, source, stored[end - chunk : end])
        assert not all(layer.is_trimmable() for layer in source)
        cache.lookup([*stored[:end], 1])
        cache.store(stored[:end], source)
    assert cache.stats().entries == 3

    tail = random_tokens(10, seed=6)
    prompt = [*stored[:50], *tail]
    match = cache.lookup(prompt)
    assert match.usable == 2 * chunk
    frozen = {i: numpy_state(layers) for i, layers in _entry_states(cache)}
    restored = cache.restore(match)
    assert restored is not None
    warm_tokens, warm_rows = greedy(model, restored, prompt[2 * chunk :], 6)
    for entry_id, before in frozen.items():  # decoding rotates in place: no aliasing
        assert_same_state(cache.entry_layers(entry_id), before)

    cold = sliding_window_cache(model, window)
    prefill(model, cold, prompt[:chunk])
    prefill(model, cold, prompt[chunk : 2 * chunk])
    cold_tokens, cold_rows = greedy(model, cold, prompt[2 * chunk :], 6)
    assert warm_tokens == cold_tokens
    for warm, expected in zip(warm_rows, cold_rows, strict=True):
        assert np.array_equal(warm, expected)

    assert not cache.lookup([*stored[:15], *tail]).is_hit
    assert cache.restore(cache.lookup([*stored[:15], *tail])) is None


def _run(generator: TextGenerator, tokens: list[int], max_tokens: int = 12) -> tuple[str, Finished]:
    outputs = list(
        generator.generate(tokens, GenerationParams(max_tokens=max_tokens, temperature=0))
    )
    done = outputs[-1]
    assert isinstance(done, Finished)
    text = "".join(o.text for o in outputs[:-1] if isinstance(o, TextDelta))
    return text, done


def _entry_states(cache: KVPrefixCache) -> Iterator[tuple[int, list[LayerCache]]]:
    for entry_id in range(100):
        try:
            yield entry_id, cache.entry_layers(entry_id)
        except KeyError:
            continue


def test_text_generator_with_cache_matches_cold_generation(
    tiny: tuple[nn.Module, TokenizerWrapper],
) -> None:
    model, tokenizer = tiny
    cache = KVPrefixCache(BIG)
    warm = TextGenerator(LocalModel(model, tokenizer), tokenizer, cache, prefill_step_tokens=16)
    cold = TextGenerator(LocalModel(model, tokenizer), tokenizer, None, prefill_step_tokens=16)

    turn1 = random_tokens(50, seed=7)
    turn2 = [*turn1, *random_tokens(20, seed=8)]  # the conversation continues
    branch = [*turn1[:30], *random_tokens(15, seed=9)]  # an edited earlier message

    first = _run(warm, turn1)
    assert first == _run(cold, turn1)
    assert first[1].usage.cached_tokens == 0
    frozen = {i: numpy_state(layers) for i, layers in _entry_states(cache)}
    assert len(frozen) == 1

    # The whole prompt's KV is stored (after the first token), the last token recomputed.
    for prompt, cached in [(turn2, 50), (branch, 30), (turn1, 49), (turn2, 69)]:
        text, done = _run(warm, prompt)
        cold_text, cold_done = _run(cold, prompt)
        assert text == cold_text
        assert done.finish_reason == cold_done.finish_reason
        assert done.usage.completion_tokens == cold_done.usage.completion_tokens
        assert done.usage.prompt_tokens == len(prompt)
        assert done.usage.cached_tokens == cached
        for entry_id, before in frozen.items():
            assert_same_state(cache.entry_layers(entry_id), before)
        frozen = {i: numpy_state(layers) for i, layers in _entry_states(cache)}

    stats = cache.stats()
    assert stats.lookups == 5
    assert stats.misses == 1
    assert stats.hits_exact + stats.hits_partial == 4
    assert stats.tokens_reused == 50 + 30 + 49 + 69
    assert stats.entries == 3  # turn1/turn2 chain, branch
