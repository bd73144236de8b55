"""KV prefix cache: reuse the KV of the longest cached prefix of a prompt.

Entries hold per-layer mlx_lm cache objects. A stored entry is never mutated by
a request that reuses it: a restore gives the request fresh cache objects whose
arrays are new handles on the entry's buffers, and MLX copies a buffer on write
when it is shared (the same Python `mx.array` object would be written in place,
which is why `copy.deepcopy`/sharing the objects is wrong).
"""

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from loguru import logger
from pydantic import BaseModel

from exo.engine.token_trie import TokenTrie

LayerCache = Any  # an mlx_lm cache object (KVCache, RotatingKVCache, ArraysCache, ...)

EvictionAgreement = Callable[[list[int]], list[int]]
"""Entries this cache would evict -> entries every rank evicts (the union). Pipeline
ranks each cache their own layers of the same entries (same ids, same LRU order);
agreeing keeps one rank from holding an entry another dropped."""


def _local_decision(victims: list[int]) -> list[int]:
    return victims


# A hit good enough to update the entry in place instead of adding a new one.
MIN_UPDATE_TOKENS = 1000
MIN_UPDATE_FRACTION = 0.5


def _fresh_handles(value: Any) -> Any:
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list):
        return [_fresh_handles(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh_handles(v) for v in value)
    return value


def snapshot_layers(layers: Sequence[LayerCache]) -> list[LayerCache]:
    """New cache objects sharing buffers (copy-on-write) with `layers`."""
    copies = []
    for layer in layers:
        clone = copy.copy(layer)
        for name, value in vars(layer).items():
            setattr(clone, name, _fresh_handles(value))
        copies.append(clone)
    return copies


def layers_nbytes(layers: Sequence[LayerCache]) -> int:
    return sum(int(layer.nbytes) for layer in layers)


def is_trimmable(layers: Sequence[LayerCache]) -> bool:
    return all(layer.is_trimmable() for layer in layers)


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]
    layers: list[LayerCache]
    nbytes: int
    trimmable: bool
    last_used: int


@dataclass(frozen=True)
class PrefixMatch:
    """`usable` prompt tokens can be restored from `entry_id` (None: a miss)."""

    entry_id: int | None
    usable: int
    prompt_length: int

    @property
    def is_hit(self) -> bool:
        return self.entry_id is not None and self.usable > 0


class CacheStats(BaseModel):
    lookups: int = 0
    hits_exact: int = 0
    hits_partial: int = 0
    misses: int = 0
    tokens_reused: int = 0
    entries: int = 0
    bytes: int = 0
    evictions: int = 0
    byte_budget: int = 0


def choose_evictions(
    entries: dict[int, CacheEntry], byte_budget: int, under_pressure: bool, keep: int | None
) -> list[int]:
    """Least recently used first, until within budget (or, under memory pressure,
    everything but `keep`)."""
    total = sum(e.nbytes for e in entries.values())
    # An entry that alone exceeds the budget is dropped, without evicting others for it.
    oversized = keep if keep in entries and entries[keep].nbytes > byte_budget else None
    if oversized is not None:
        total -= entries[oversized].nbytes
    victims: list[int] = []
    for entry_id in sorted(entries, key=lambda i: entries[i].last_used):
        if entry_id == keep:
            continue
        if total <= byte_budget and not under_pressure:
            break
        victims.append(entry_id)
        total -= entries[entry_id].nbytes
    if oversized is not None:
        victims.append(oversized)
    return victims


def is_good_hit(usable: int, prompt_length: int, system_prompt_length: int) -> bool:
    """Long enough, a large enough share of the prompt, and past the system prompt
    (a hit on the system prompt alone is another conversation: add, don't overwrite)."""
    return (
        usable >= MIN_UPDATE_TOKENS
        and usable > system_prompt_length
        and usable >= MIN_UPDATE_FRACTION * prompt_length
    )


class KVPrefixCache:
    def __init__(
        self,
        byte_budget: int,
        memory_pressure: Callable[[], bool] = lambda: False,
        agree: EvictionAgreement = _local_decision,
    ) -> None:
        self.byte_budget = byte_budget
        self._memory_pressure = memory_pressure
        self._agree = agree
        self._entries: dict[int, CacheEntry] = {}
        self._trie = TokenTrie()
        self._clock = 0
        self._next_id = 0
        self._stats = CacheStats(byte_budget=byte_budget)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest usable cached prefix; at least one prompt token is left to prefill."""
        key = tuple(tokens)
        limit = len(key) - 1
        found = self._trie.match(key)
        best_id: int | None = None
        best = 0
        # Trimmable entries: any entry sharing the matched prefix can be cut to it.
        shared = min(found.depth, limit)
        trimmable = [i for i in found.below if self._entries[i].trimmable]
        if shared > 0 and trimmable:
            best_id = max(trimmable, key=lambda i: self._entries[i].last_used)
            best = shared
        # Any entry ending at or below the match point is usable whole (no trim needed);
        # the only option for non-trimmable entries.
        for length, entry_id in found.endings:
            if length <= limit and length > best:
                best_id, best = entry_id, length

        self._stats.lookups += 1
        if best_id is None:
            self._stats.misses += 1
            return PrefixMatch(entry_id=None, usable=0, prompt_length=len(key))
        if best >= limit:  # the whole prompt but the one token always recomputed
            self._stats.hits_exact += 1
        else:
            self._stats.hits_partial += 1
        self._stats.tokens_reused += best
        self._entries[best_id].last_used = self._tick()
        return PrefixMatch(entry_id=best_id, usable=best, prompt_length=len(key))

    def restore(self, match: PrefixMatch) -> list[LayerCache] | None:
        """Fresh cache objects holding the first `match.usable` tokens, or None on a miss."""
        if match.entry_id is None or match.entry_id not in self._entries:
            return None
        entry = self._entries[match.entry_id]
        layers = snapshot_layers(entry.layers)
        excess = len(entry.tokens) - match.usable
        if excess > 0:
            for layer in layers:
                layer.trim(excess)
        return layers

    def store(
        self,
        tokens: Sequence[int],
        layers: Sequence[LayerCache],
        match: PrefixMatch,
        system_prompt_length: int = 0,
    ) -> int | None:
        """Keep a copy-on-write snapshot of `layers` (the KV of exactly `tokens`).

        Updates the matched entry in place on a good hit; otherwise adds a new
        entry, so two conversations sharing only a system prompt both stay.
        Returns the entry id, or None when the entry was too large to keep.
        """
        key = tuple(tokens)
        if not key:
            return None
        existing = self._trie.match(key)
        for length, entry_id in existing.endings:
            if length == len(key):
                self._entries[entry_id].last_used = self._tick()
                return entry_id
        snapshot = snapshot_layers(layers)
        mx.eval([getattr(layer, "state", []) for layer in snapshot])
        entry = CacheEntry(
            tokens=key,
            layers=snapshot,
            nbytes=layers_nbytes(snapshot),
            trimmable=is_trimmable(snapshot),
            last_used=self._tick(),
        )
        target = match.entry_id
        if (
            target is not None
            and target in self._entries
            and is_good_hit(match.usable, len(key), system_prompt_length)
        ):
            self._trie.remove(target, self._entries[target].tokens)
            entry_id = target
        else:
            entry_id = self._next_id
            self._next_id += 1
        self._entries[entry_id] = entry
        self._trie.insert(entry_id, key)
        self._evict(keep=entry_id)
        return entry_id if entry_id in self._entries else None

    def _evict(self, keep: int | None) -> None:
        """Drop least recently used entries until within the byte budget, then, under
        memory pressure, one at a time while it lasts (at most every entry but `keep`).
        Each round is agreed with the other ranks, so all of them run the same rounds."""
        while True:
            victims = choose_evictions(self._entries, self.byte_budget, False, keep)
            if not victims and self._memory_pressure():
                victims = choose_evictions(self._entries, self.byte_budget, True, keep)[:1]
            victims = self._agree(victims)
            if not victims:
                return
            for entry_id in victims:
                self._drop(entry_id)

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._trie.remove(entry_id, entry.tokens)
        self._stats.evictions += 1
        mx.clear_cache()  # give the memory back, so pressure readings see it
        logger.debug(f"prefix cache evicted an entry of {len(entry.tokens)} tokens")

    def entry_ids(self) -> list[int]:
        return sorted(self._entries)

    def entry_tokens(self, entry_id: int) -> tuple[int, ...]:
        return self._entries[entry_id].tokens

    def entry_layers(self, entry_id: int) -> list[LayerCache]:
        return self._entries[entry_id].layers

    def stats(self) -> CacheStats:
        return self._stats.model_copy(
            update={
                "entries": len(self._entries),
                "bytes": sum(e.nbytes for e in self._entries.values()),
                "byte_budget": self.byte_budget,
            }
        )
