"""KV prefix cache: reuse the KV of the longest cached prefix of a prompt.

*Where*: a radix tree over the entries' token ids (`TokenTrie`). *What*: an entry
is a token sequence whose attention KV lives in chunks shared with every entry
that has the same tokens up to the chunk's end (`kv_chunks.py`), plus its own
tail and, for layers that cannot be cut back (sliding window, SSM state), a
checkpoint of their state at the entry's end. *What goes first*: least recently
used entries (`choose_evictions`), bounded by a byte budget and memory pressure;
an evicted entry goes to the disk tier when there is one. A lookup that finds a
longer prefix on disk brings it into memory first (`DiskLoad`: by itself, or, on
pipeline ranks, agreed with the others).

Updates: an entry is replaced only by a sequence that extends it (the new
sequence starts with all of its tokens); a sequence that diverges inside an
entry becomes a new entry beside it, so one conversation never overwrites
another's history. Entries with checkpoints are never replaced: each is a
snapshot at a message boundary (the prompt's end, the reply's end) that a later
turn may still need when its template rewrites the previous reply.

A stored entry is never mutated by a request that reuses it: a restore builds
new cache objects, concatenating chunk copies (written into only after a
reallocation) and taking new handles on checkpoint buffers (MLX copies a
buffer on write when it is shared).
"""

import copy
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from loguru import logger

from exo.engine.cache_diagnostics import Decode, explain_lookup
from exo.engine.mlx.kv_chunks import (
    CHUNK_TOKENS,
    ChunkKey,
    ChunkStore,
    LayerKV,
    assemble,
    chunk_keys,
    is_chunked,
    kv_nbytes,
    slice_positions,
)
from exo.engine.mlx.prefix_cache_disk import DiskTier
from exo.engine.token_trie import TokenTrie, best_usable
from exo.shared.prefix_digests import Summarizer
from exo.shared.types.cache_stats import CacheMiss, CacheStats

LayerCache = Any  # an mlx_lm cache object (KVCache, RotatingKVCache, ArraysCache, ...)

EvictionAgreement = Callable[[list[int]], list[int]]
"""Entries this cache would evict -> entries every rank evicts (the union). Pipeline
ranks each cache their own layers of the same entries (same ids, same LRU order);
agreeing keeps one rank from holding an entry another dropped."""

DiskLoad = Callable[["KVPrefixCache", tuple[int, ...]], bool]
"""(cache, prompt) -> whether the best disk entry for the prompt was brought into
memory. Pipeline ranks load an entry only when all of them can (`pipeline.py`)."""

# Misses kept for the stats; sequences of evicted entries remembered to explain misses.
RECENT_MISSES = 20
EVICTED_REMEMBERED = 256


def _local_decision(victims: list[int]) -> list[int]:
    return victims


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


def cached_length(layers: Sequence[LayerCache]) -> int | None:
    """How many tokens the cache objects hold, when a layer keeps count."""
    for layer in layers:
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int):
            return offset
    return None


def needs_checkpoints(layers: Sequence[LayerCache]) -> bool:
    """Whether some layer cannot be cut back, so only stored positions restore."""
    return not all(is_chunked(layer) for layer in layers)


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]
    chunks: tuple[ChunkKey, ...]
    tail: list[LayerKV]  # chunked layers' positions after the last full chunk
    checkpoints: dict[int, LayerCache]  # the other layers, by index, at the entry's end
    n_layers: int
    own_nbytes: int  # tail and checkpoints; chunks are counted once, in the store
    last_used: int
    # Restorable at any length up to its end; else only at its end (checkpoints,
    # here or on another pipeline rank: `KVPrefixCache.ends_only`).
    trimmable: bool


@dataclass(frozen=True)
class EntryFootprint:
    """What eviction needs to know of an entry."""

    last_used: int
    chunks: tuple[ChunkKey, ...]
    own_nbytes: int


@dataclass(frozen=True)
class PrefixMatch:
    """`usable` prompt tokens can be restored from `entry_id` (None: a miss)."""

    entry_id: int | None
    usable: int
    prompt_length: int

    @property
    def is_hit(self) -> bool:
        return self.entry_id is not None and self.usable > 0


def choose_evictions(
    entries: Mapping[int, EntryFootprint],
    chunk_bytes: Mapping[ChunkKey, int],
    byte_budget: int,
    under_pressure: bool,
    keep: int | None,
) -> list[int]:
    """Least recently used first, until within budget (or, under memory pressure,
    everything but `keep`). Dropping an entry frees its own bytes and the chunks no
    other entry holds."""
    holders: dict[ChunkKey, int] = {}
    for entry in entries.values():
        for key in set(entry.chunks):
            holders[key] = holders.get(key, 0) + 1
    total = sum(chunk_bytes.values()) + sum(e.own_nbytes for e in entries.values())

    def drop(entry: EntryFootprint) -> int:
        freed = entry.own_nbytes
        for key in set(entry.chunks):
            holders[key] -= 1
            freed += chunk_bytes[key] if holders[key] == 0 else 0
        return freed

    # An entry that alone exceeds the budget is dropped, without evicting others for it.
    if keep is not None and keep in entries:
        kept = entries[keep]
        alone = kept.own_nbytes + sum(chunk_bytes[key] for key in set(kept.chunks))
        if alone > byte_budget:
            return [keep]
    victims: list[int] = []
    for entry_id in sorted(entries, key=lambda i: entries[i].last_used):
        if entry_id == keep:
            continue
        if total <= byte_budget and not under_pressure:
            break
        victims.append(entry_id)
        total -= drop(entries[entry_id])
    return victims


class KVPrefixCache:
    def __init__(
        self,
        byte_budget: int,
        memory_pressure: Callable[[], bool] = lambda: False,
        agree: EvictionAgreement = _local_decision,
        disk: DiskTier | None = None,
        decode: Decode | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
        disk_load: DiskLoad | None = None,
    ) -> None:
        self.byte_budget = byte_budget
        self.chunk_tokens = chunk_tokens
        self._memory_pressure = memory_pressure
        self._agree = agree
        self._disk = disk
        self._disk_load: DiskLoad = disk_load or KVPrefixCache._load_from_disk
        self._from_disk: set[int] = set()  # entries loaded from disk since the last lookup
        self._decode = decode
        self._entries: dict[int, CacheEntry] = {}
        self._chunks = ChunkStore()
        self._trie = TokenTrie()
        self._evicted = TokenTrie()
        self._evicted_order: deque[tuple[int, tuple[int, ...]]] = deque()
        self._misses: deque[CacheMiss] = deque(maxlen=RECENT_MISSES)
        self._unsaved: set[int] = set()  # entries not yet written to the disk tier
        self._clock = 0
        self._next_id = 0
        self._stats = CacheStats(byte_budget=byte_budget)
        self._summarizer = Summarizer()
        # When a request last looked up or stored (monotonic): disk writes wait for a lull.
        self.last_active = time.monotonic()
        # Entries restore only at their end, even when all of this cache's layers
        # can be cut back: a pipeline rank whose layers can, when another's cannot
        # (all ranks must decide alike).
        self.ends_only = False

    def needs_checkpoints(self, layers: Sequence[LayerCache]) -> bool:
        """Whether only stored positions restore: some layer cannot be cut back,
        here or on another rank of the pipeline."""
        return self.ends_only or needs_checkpoints(layers)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _best(self, key: tuple[int, ...]) -> tuple[int | None, int]:
        return best_usable(
            self._trie.match(key),
            len(key) - 1,
            trimmable=lambda i: self._entries[i].trimmable,
            recency=lambda i: self._entries[i].last_used,
        )

    def lookup(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest usable cached prefix; at least one prompt token is left to prefill.
        A longer one on disk is brought into memory first."""
        key = tuple(tokens)
        self.last_active = time.monotonic()
        self.bring_from_disk(key, self._disk_load)
        best_id, best = self._best(key)
        from_disk = best_id in self._from_disk
        self._from_disk.clear()
        self._stats.lookups += 1
        self._explain(key, best)
        if best_id is None:
            self._stats.misses += 1
            return PrefixMatch(entry_id=None, usable=0, prompt_length=len(key))
        if best >= len(key) - 1:  # the whole prompt but the one token always recomputed
            self._stats.hits_exact += 1
        else:
            self._stats.hits_partial += 1
        if from_disk:
            self._stats.disk_hits += 1
        else:
            self._stats.memory_hits += 1
        self._stats.tokens_reused += best
        self._entries[best_id].last_used = self._tick()
        return PrefixMatch(entry_id=best_id, usable=best, prompt_length=len(key))

    def bring_from_disk(self, tokens: Sequence[int], disk_load: DiskLoad) -> None:
        """Bring a prefix of `tokens` longer than any in memory from disk (by
        `disk_load`), if the disk has one."""
        key = tuple(tokens)
        if self._disk is not None and self._disk.best(key)[1] > self._best(key)[1]:
            disk_load(self, key)

    def _explain(self, key: tuple[int, ...], reused: int) -> None:
        found = self._trie.match(key)
        nearest = max(found.below, key=lambda i: self._entries[i].last_used, default=None)
        miss = explain_lookup(
            key,
            reused,
            self._entries[nearest].tokens if nearest is not None else None,
            self._evicted.match(key).depth,
            self._decode or (lambda tokens: ""),
        )
        if miss is not None:
            self._misses.append(miss)
            logger.debug(
                f"prefix cache {miss.reason}: reused {miss.reused_tokens} of "
                f"{miss.prompt_tokens} tokens; best entry {miss.best_entry_tokens} tokens, "
                f"diverging at {miss.diverged_at}: cached {miss.cached_text!r}, "
                f"prompt {miss.prompt_text!r} (after {miss.context_text!r})"
            )

    def _load_from_disk(self, key: tuple[int, ...]) -> bool:
        while True:
            file_key, _ = self.disk_best(key)
            if file_key is None:
                return False
            loaded = self.read_disk(file_key)
            if loaded is not None:
                return self.adopt(*loaded) is not None

    def detach_disk(self) -> None:
        """Stop using the disk tier (its files stay): a pipeline rank whose peers
        keep none."""
        self._disk = None

    def disk_best(self, key: tuple[int, ...]) -> tuple[str | None, int]:
        """The key of the disk entry that serves the most of `key`, and how much."""
        if self._disk is None:
            return None, 0
        file_id, usable = self._disk.best(key)
        if file_id is None or usable == 0:
            return None, 0
        return self._disk.key(file_id), usable

    def read_disk(self, file_key: str) -> tuple[tuple[int, ...], list[LayerCache]] | None:
        """The tokens and layers of the disk entry `file_key`; None when it is not
        on disk or unreadable (then removed)."""
        file_id = self._disk.find(file_key) if self._disk is not None else None
        if self._disk is None or file_id is None:
            return None
        return self._disk.load(file_id)

    def adopt(self, tokens: tuple[int, ...], layers: list[LayerCache]) -> int | None:
        """Store an entry read from disk; the lookup that uses it counts a disk hit."""
        entry_id = self.store(tokens, layers)
        if entry_id is not None:
            self._from_disk.add(entry_id)
        return entry_id

    def disk_keys(self) -> set[str]:
        return self._disk.keys() if self._disk is not None else set()

    def retain_disk(self, keys: set[str]) -> None:
        """Remove every disk entry but `keys`."""
        if self._disk is not None:
            self._disk.retain(keys)

    def discard_disk(self, file_key: str) -> None:
        if self._disk is not None:
            self._disk.discard(file_key)

    def restore(self, match: PrefixMatch) -> list[LayerCache] | None:
        """Fresh cache objects holding the first `match.usable` tokens, or None on a miss."""
        if match.entry_id is None or match.entry_id not in self._entries:
            return None
        return self._materialize(self._entries[match.entry_id], match.usable)

    def _materialize(self, entry: CacheEntry, length: int) -> list[LayerCache]:
        if not entry.trimmable and length != len(entry.tokens):
            raise ValueError("an entry with checkpoints restores only at its end")
        chunks = [self._chunks.get(key) for key in entry.chunks[: -(-length // self.chunk_tokens)]]
        past_chunks = length > len(entry.chunks) * self.chunk_tokens
        layers: list[LayerCache] = []
        chunked = 0
        for index in range(entry.n_layers):
            if index in entry.checkpoints:
                layers.extend(snapshot_layers([entry.checkpoints[index]]))
                continue
            pieces = [chunk.kv[chunked] for chunk in chunks]
            if past_chunks:
                pieces.append(entry.tail[chunked])
            layers.append(assemble(pieces, length))
            chunked += 1
        return layers

    def store(self, tokens: Sequence[int], layers: Sequence[LayerCache]) -> int | None:
        """Keep the KV of exactly `tokens`, which `layers` hold (or hold more than).

        Extends the entry the sequence starts with (replacing it, and any shorter
        entry on its path) when both can be cut back; otherwise adds an entry.
        Returns the entry id, or None when it was too large to keep."""
        key = tuple(tokens)
        self.last_active = time.monotonic()
        if not key:
            return None
        found = self._trie.match(key)
        for length, entry_id in found.endings:
            if length == len(key):
                self._entries[entry_id].last_used = self._tick()
                return entry_id
        if found.depth == len(key) and not self.needs_checkpoints(layers):
            # Already held, inside a longer entry that can be cut back to it.
            covering = [i for i in found.below if self._entries[i].trimmable]
            if covering:
                entry_id = max(covering, key=lambda i: self._entries[i].last_used)
                self._entries[entry_id].last_used = self._tick()
                return entry_id
        entry = self._make_entry(key, layers)
        extended = (
            [i for _, i in found.endings if self._entries[i].trimmable] if entry.trimmable else []
        )
        if extended:
            entry_id = extended[-1]  # the longest keeps its id: the conversation's entry
            for replaced in extended:
                self._forget(replaced)
        else:
            entry_id = self._next_id
            self._next_id += 1
        self._entries[entry_id] = entry
        self._trie.insert(entry_id, key)
        self._unsaved.add(entry_id)
        self._evict(keep=entry_id)
        return entry_id if entry_id in self._entries else None

    def _make_entry(self, key: tuple[int, ...], layers: Sequence[LayerCache]) -> CacheEntry:
        chunked = [layer for layer in layers if is_chunked(layer)]
        for layer in chunked:
            if layer.offset < len(key):
                raise ValueError(f"the cache holds {layer.offset} tokens, not {len(key)}")
        size = self.chunk_tokens
        keys = chunk_keys(key, size) if chunked else []
        for i, chunk_key in enumerate(keys):
            self._chunks.acquire(
                chunk_key,
                lambda i=i: [slice_positions(layer, i * size, (i + 1) * size) for layer in chunked],
            )
        start = len(keys) * size
        tail = [slice_positions(layer, start, len(key)) for layer in chunked] if chunked else []
        checkpoints = {
            index: snapshot_layers([layer])[0]
            for index, layer in enumerate(layers)
            if not is_chunked(layer)
        }
        mx.eval(tail, [getattr(layer, "state", []) for layer in checkpoints.values()])
        return CacheEntry(
            tokens=key,
            chunks=tuple(keys),
            tail=tail if len(key) > start else [],
            checkpoints=checkpoints,
            n_layers=len(layers),
            own_nbytes=kv_nbytes(tail) + layers_nbytes(list(checkpoints.values())),
            last_used=self._tick(),
            trimmable=not checkpoints and not self.ends_only,
        )

    def _forget(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._unsaved.discard(entry_id)
        self._trie.remove(entry_id, entry.tokens)
        for key in entry.chunks:
            self._chunks.release(key)

    def _evict(self, keep: int | None) -> None:
        """Drop least recently used entries until within the byte budget, then, under
        memory pressure, one at a time while it lasts (at most every entry but `keep`).
        Each round is agreed with the other ranks, so all of them run the same rounds."""
        while True:
            footprints = {
                i: EntryFootprint(e.last_used, e.chunks, e.own_nbytes)
                for i, e in self._entries.items()
            }
            sizes = self._chunks.sizes()
            victims = choose_evictions(footprints, sizes, self.byte_budget, False, keep)
            if not victims and self._memory_pressure():
                victims = choose_evictions(footprints, sizes, self.byte_budget, True, keep)[:1]
            victims = self._agree(victims)
            if not victims:
                return
            for entry_id in victims:
                self._drop(entry_id)

    def _drop(self, entry_id: int) -> None:
        entry = self._entries[entry_id]
        self._save(entry_id)
        self._forget(entry_id)
        self._evicted.insert(entry_id, entry.tokens)
        self._evicted_order.append((entry_id, entry.tokens))
        if len(self._evicted_order) > EVICTED_REMEMBERED:
            self._evicted.remove(*self._evicted_order.popleft())
        self._stats.evictions += 1
        mx.clear_cache()  # give the memory back, so pressure readings see it
        logger.debug(f"prefix cache evicted an entry of {len(entry.tokens)} tokens")

    def _save(self, entry_id: int) -> None:
        self._unsaved.discard(entry_id)
        if self._disk is not None:
            entry = self._entries[entry_id]
            layers = self._materialize(entry, len(entry.tokens))
            self._disk.save(entry.tokens, layers, entry.trimmable)

    def persist(self, max_entries: int | None = None) -> int:
        """Write entries not on disk yet to the disk tier, most recently used first:
        all of them at shutdown, a few at a time while idle. Returns how many."""
        if self._disk is None:
            return 0
        newest = sorted(self._unsaved, key=lambda i: -self._entries[i].last_used)
        for entry_id in newest[:max_entries]:
            self._save(entry_id)
        return len(newest[:max_entries])

    def next_unsaved(self) -> int | None:
        """The most recently used entry not on disk yet (None: all are, or no disk)."""
        if self._disk is None or not self._unsaved:
            return None
        return max(self._unsaved, key=lambda i: self._entries[i].last_used)

    def persist_entry(self, entry_id: int) -> bool:
        """Write one entry to disk unless it is there already (or gone)."""
        if self._disk is None or entry_id not in self._unsaved:
            return False
        self._save(entry_id)
        return True

    def spill(self, nbytes: int) -> int:
        """Free at least `nbytes` of the memory tier (less when it holds less):
        least recently used entries go to the disk tier, when there is one, as
        evictions do. Returns the bytes freed."""
        return self.spill_entries(self.entries_to_free(nbytes))

    def entries_to_free(self, nbytes: int) -> int:
        """How many of the least recently used entries hold at least `nbytes`
        between them (all of them when they hold less): shared chunks count
        where their last holder goes."""
        footprints = {
            i: EntryFootprint(e.last_used, e.chunks, e.own_nbytes) for i, e in self._entries.items()
        }
        budget = max(0, self.nbytes - nbytes)
        return len(choose_evictions(footprints, self._chunks.sizes(), budget, False, None))

    def spill_entries(self, count: int) -> int:
        """Move the `count` least recently used entries out of memory (each agreed
        with the other ranks, who spill as many); returns the bytes freed."""
        before = self.nbytes
        for _ in range(count):
            if not self._entries:
                break
            oldest = min(self._entries, key=lambda i: self._entries[i].last_used)
            for entry_id in self._agree([oldest]):
                if entry_id in self._entries:
                    self._drop(entry_id)
        freed = before - self.nbytes
        if freed:
            logger.info(f"prefix cache: moved {freed} bytes out of memory to make room")
        return freed

    def entry_ids(self) -> list[int]:
        return sorted(self._entries)

    def entry_tokens(self, entry_id: int) -> tuple[int, ...]:
        return self._entries[entry_id].tokens

    def entry_layers(self, entry_id: int) -> list[LayerCache]:
        """The entry's whole KV as new cache objects (what a full restore gives)."""
        entry = self._entries[entry_id]
        return self._materialize(entry, len(entry.tokens))

    def summary(self, coming: Iterable[tuple[int, ...]] = ()) -> list[int]:
        """The digests of what this cache holds (`prefix_digests`): `coming`
        first (prompts being served, which it holds once they finish), then
        memory entries, then disk ones, most recently used first."""
        memory = sorted(self._entries.values(), key=lambda e: e.last_used, reverse=True)
        disk = self._disk.sequences() if self._disk else []
        return self._summarizer.summarize([*coming, *(e.tokens for e in memory), *disk])

    def stats(self) -> CacheStats:
        disk = self._disk
        return self._stats.model_copy(
            update={
                "entries": len(self._entries),
                "chunks": len(self._chunks),
                "bytes": self.nbytes,
                "byte_budget": self.byte_budget,
                "disk_entries": len(disk) if disk else 0,
                "disk_bytes": disk.nbytes if disk else 0,
                "disk_byte_budget": disk.byte_budget if disk else 0,
                "recent_misses": list(self._misses),
            }
        )

    @property
    def nbytes(self) -> int:
        return self._chunks.nbytes + sum(e.own_nbytes for e in self._entries.values())


def resume(
    cache: KVPrefixCache | None, tokens: Sequence[int], fresh: Callable[[], list[LayerCache]]
) -> tuple[PrefixMatch, list[LayerCache]]:
    """Where a prompt starts: the cache's decision (a miss without a cache) and the
    cache objects to prefill the rest into, holding the first `match.usable` tokens."""
    if cache is None:
        return PrefixMatch(entry_id=None, usable=0, prompt_length=len(tokens)), fresh()
    match = cache.lookup(tokens)
    restored = cache.restore(match)
    return match, fresh() if restored is None else restored
