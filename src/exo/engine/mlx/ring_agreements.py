"""What the ranks of a split instance (pipeline or tensor) agree on around their
ring (messages and link: `ring.py`), before and between the forward passes.

Start: `HELLO` goes around with each rank's layers (pipeline ranks must cover
the model in order; tensor ranks each hold every layer's slice), whether it
caches prefixes (all or none), whether every rank so far keeps a disk tier and
whether any rank's layers cannot be cut back (sliding window, SSM state), then
`START`, which tells all whether every rank keeps a disk tier (else none uses
its own) and whether every rank's prefix cache must restore entries only at
their ends (a rank holding only layers that can be cut back would otherwise
decide other hits than one that cannot).

Prefix cache: every rank caches its own part (layers, or heads) of the same
entries, deciding alike as it sees the same requests in the same order
(`lockstep.py`). Evictions are agreed in rounds of `EVICT` (the union of every
rank's victims, gathered around the ring) and `EVICTED` (handed around again),
so no rank keeps an entry another dropped.

Disk tier: each rank keeps its part of an entry in its own folder (the
namespace names its part), the file named by the entry's key (a digest of its
tokens). After `START` the ranks gather the keys every one of them holds
(`DISK_KEYS`, intersected around the ring) and hand the result around
(`DISK_AGREED`); each removes the rest. Only rank 0 looks on disk, before the
ranks look a request up: when a longer prefix is there it sends `LOAD` with the
key, each rank reads its file and passes on whether all so far could, and
`LOADED` hands the verdict around: all store the entry, or all remove the file
(a corrupt or missing share) and rank 0 tries the next best, down to a miss.
Evicted entries are written by each rank as it drops them (evictions are
agreed); while idle rank 0 names the entry to write (`PERSIST`, passed on by
each rank once written, so the ack says all did); on a clean stop every rank
writes the rest. Whatever the ranks did not write alike is dropped at the next
start's key agreement.

Between requests rank 0 sends a heartbeat around every second (`RingLead`);
`SHUTDOWN` around the ring stops every rank. Failure: a rank that loses a
neighbour, or hears nothing within a bound, raises `PeerLost` and its runner
exits, which closes its own sockets, so a failure spreads around the ring.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.prefix_cache_disk import DiskTier
from exo.engine.mlx.ring import (
    Header,
    Link,
    Op,
    PipelineError,
    ids_message,
    ids_of,
    keys_message,
    keys_of,
)
from exo.shared.types.shard import LayerRange

HEARTBEAT_SECONDS = 1.0
# A follower that hears nothing this long while idle (heartbeats come every
# second) concludes rank 0 is gone.
IDLE_SILENCE_SECONDS = 10.0
# Within a task a rank waits for its neighbour's work: a prefill chunk on each
# rank before it, or a whole round of the ring.
STEP_SECONDS = 120.0
# The handshake waits for every rank to load its weights.
LOAD_SECONDS = 600.0


@dataclass(frozen=True)
class RingAgreement:
    """What the handshake settled for every rank."""

    disk: bool  # every rank keeps a disk tier (else none uses its own)
    # Some rank's layers cannot be cut back (sliding window, SSM state): every
    # rank's prefix cache restores entries only at their ends, so all decide alike.
    ends_only: bool


def handshake(
    link: Link,
    layers: LayerRange,
    cache_on: bool,
    timeout: float = LOAD_SECONDS,
    interrupt: Callable[[], None] = lambda: None,
    disk_on: bool = False,
    checkpoints: bool = False,
    every_layer: bool = False,
) -> RingAgreement:
    """Check that the ranks' layers cover the model in order (`every_layer`:
    tensor ranks, each holding a slice of every layer) and that all of them
    cache prefixes or none does; returns once every rank has loaded its shard,
    with what all agreed: whether every rank keeps a disk tier, whether any
    rank's layers need checkpoints (`checkpoints`: this rank's do)."""
    cache_bit = int(cache_on)
    disk_bit = int(cache_on and disk_on) << 1
    checkpoint_bit = int(checkpoints) << 2
    mine = Header(
        Op.HELLO, flag=cache_bit | disk_bit | checkpoint_bit, value=layers.end, total=layers.total
    )
    if every_layer and not (layers.is_first and layers.is_last):
        raise PipelineError(f"a tensor rank holds every layer, not {layers}")
    if link.rank == 0:
        if not layers.is_first:
            raise PipelineError(f"rank 0 must start at layer 0, not {layers.start}")
        link.send(mine)
        hello, _ = link.expect(Op.HELLO, timeout, interrupt)
        if hello.value != layers.total:
            raise PipelineError(f"the last rank ends at layer {hello.value} of {layers.total}")
        agreed = RingAgreement(disk=bool(hello.flag & 2), ends_only=bool(hello.flag & 4))
        link.send(Header(Op.START, flag=int(agreed.disk) | int(agreed.ends_only) << 1))
        return agreed
    hello, _ = link.recv(timeout, interrupt)
    expected = (Op.HELLO, layers.end if every_layer else layers.start, layers.total, cache_bit)
    if (hello.op, hello.value, hello.total, hello.flag & 1) != expected:
        raise PipelineError(
            f"rank {link.rank} holds {layers} (prefix cache {'on' if cache_on else 'off'}), "
            f"but rank {link.left} sent {hello.op.name} for layer {hello.value} of "
            f"{hello.total} (prefix cache {'on' if hello.flag & 1 else 'off'})"
        )
    if link.is_last and not layers.is_last:
        raise PipelineError(f"the last rank ends at layer {layers.end} of {layers.total}")
    # Disk: all so far (and); checkpoints: any so far (or).
    link.send(
        replace(mine, flag=cache_bit | (hello.flag & disk_bit) | ((hello.flag | mine.flag) & 4))
    )
    start, _ = link.expect(Op.START, timeout, interrupt)
    if not link.is_last:
        link.send(start)
    return RingAgreement(disk=bool(start.flag & 1), ends_only=bool(start.flag & 2))


def agree_disk_entries(
    link: Link, cache: KVPrefixCache, interrupt: Callable[[], None] = lambda: None
) -> None:
    """Right after the handshake, on ranks with a disk tier: every rank keeps only
    the disk entries all of them hold (their keys intersected around the ring)."""
    mine = cache.disk_keys()
    if link.rank == 0:
        link.send(*keys_message(Op.DISK_KEYS, mine))
        _, payload = link.expect(Op.DISK_KEYS, STEP_SECONDS, interrupt)
        agreed = keys_of(payload)
        link.send(*keys_message(Op.DISK_AGREED, agreed))
    else:
        _, payload = link.expect(Op.DISK_KEYS, STEP_SECONDS, interrupt)
        link.send(*keys_message(Op.DISK_KEYS, keys_of(payload) & mine))
        _, payload = link.expect(Op.DISK_AGREED, STEP_SECONDS, interrupt)
        agreed = keys_of(payload)
        if not link.is_last:
            link.send(*keys_message(Op.DISK_AGREED, agreed))
    cache.retain_disk(agreed)


class RingDiskLoad:
    """Rank 0's `DiskLoad`: the best disk entry for a prompt comes into every rank's
    memory only if every rank can read its share (`LOAD` gathers whether each can,
    `LOADED` hands the verdict around); otherwise every rank removes the file and
    the next best is tried. Followers answer in `answer_load`."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def __call__(self, cache: KVPrefixCache, key: tuple[int, ...]) -> bool:
        link = self.link
        while True:  # each failed round removes a file: bounded by the files kept
            file_key, _ = cache.disk_best(key)
            if file_key is None:
                return False
            loaded = cache.read_disk(file_key)
            header, payload = keys_message(Op.LOAD, {file_key})
            link.send(replace(header, flag=int(loaded is not None)), payload)
            everyone, _ = link.expect(Op.LOAD, STEP_SECONDS)
            link.send(replace(header, op=Op.LOADED, flag=everyone.flag), payload)
            if everyone.flag and loaded is not None:
                return cache.adopt(*loaded) is not None
            cache.discard_disk(file_key)


def never_load(cache: KVPrefixCache, key: tuple[int, ...]) -> bool:
    """Followers load from disk only when rank 0 asks (`LOAD`)."""
    return False


class RingEvictionAgreement:
    """The union of every rank's eviction victims, gathered around the ring and then
    handed around again, so each rank drops the same entries (an `EvictionAgreement`)."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def __call__(self, victims: list[int]) -> list[int]:
        link = self.link
        if link.rank == 0:
            link.send(*ids_message(Op.EVICT, victims))
            _, payload = link.expect(Op.EVICT, STEP_SECONDS)
            agreed = ids_of(payload)
            link.send(*ids_message(Op.EVICTED, agreed))
            return agreed
        _, payload = link.expect(Op.EVICT, STEP_SECONDS)
        link.send(*ids_message(Op.EVICT, sorted(set(ids_of(payload)) | set(victims))))
        _, payload = link.expect(Op.EVICTED, STEP_SECONDS)
        agreed = ids_of(payload)
        if not link.is_last:
            link.send(*ids_message(Op.EVICTED, agreed))
        return agreed


def ring_prefix_cache(
    link: Link,
    byte_budget: int,
    memory_pressure: Callable[[], bool],
    disk: DiskTier | None = None,
    lockstep: bool = False,
) -> KVPrefixCache | None:
    """This rank's prefix cache (None when off), deciding evictions and what comes
    from disk with the others. With `lockstep` (tensor ranks, which look up
    together) no lookup reads the disk: rank 0 brings entries in before.
    """
    if byte_budget <= 0:
        return None
    return KVPrefixCache(
        byte_budget,
        memory_pressure,
        agree=RingEvictionAgreement(link),
        disk=disk,
        disk_load=RingDiskLoad(link) if link.rank == 0 and not lockstep else never_load,
    )


class RingLead:
    """What rank 0 sends around the ring between requests: heartbeats, disk writes
    and the stop."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def keep_alive(self) -> None:
        """Heartbeat around the ring unless it carried something within the last second."""
        if time.monotonic() - self.link.last_activity >= HEARTBEAT_SECONDS:
            self.link.send(Header(Op.HEARTBEAT))
            self.link.expect(Op.HEARTBEAT, IDLE_SILENCE_SECONDS)

    def persist_idle(self, cache: KVPrefixCache) -> bool:
        """Write the newest entry not on disk yet on every rank (`PERSIST`, acked
        once every rank wrote its share); False when there is none."""
        entry_id = cache.next_unsaved()
        if entry_id is None:
            return False
        self.link.send(*ids_message(Op.PERSIST, [entry_id]))
        cache.persist_entry(entry_id)
        self.link.expect(Op.PERSIST, STEP_SECONDS)
        return True

    def shutdown(self) -> None:
        """Stop every rank; returns once the last one has it (bounded)."""
        if self.link.broken:
            return
        self.link.send(Header(Op.SHUTDOWN))
        self.link.expect(Op.SHUTDOWN, IDLE_SILENCE_SECONDS)


def answer_load(link: Link, header: Header, payload: mx.array | None, cache: KVPrefixCache) -> None:
    """A follower's answer to rank 0's `LOAD` (see `RingDiskLoad`): pass on whether
    every rank so far, this one included, can read its share; then do what
    `LOADED` says."""
    (file_key,) = keys_of(payload)
    loaded = cache.read_disk(file_key) if header.flag else None
    link.send(replace(header, flag=int(loaded is not None)), payload)
    verdict, verdict_payload = link.expect(Op.LOADED, STEP_SECONDS)
    if not link.is_last:
        link.send(verdict, verdict_payload)
    if verdict.flag and loaded is not None:
        cache.adopt(*loaded)
    else:
        cache.discard_disk(file_key)
