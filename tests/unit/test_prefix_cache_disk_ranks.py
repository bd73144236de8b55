"""What pipeline ranks need of the prefix cache's disk tier: entries named alike on
every rank, kept or removed by name, disk loads left to an agreement, and disk
hits counted where the entry was brought in before the lookup (a follower)."""

from pathlib import Path

from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.prefix_cache_disk import DiskTier, entry_key
from exo.engine.mlx.ring import Op, keys_message, keys_of
from tests.unit.test_prefix_cache import BIG, A, B, positions, store_fresh


def persisted(root: Path, *sequences: tuple[int, ...]) -> None:
    cache = KVPrefixCache(BIG, disk=DiskTier(root, "ns", BIG))
    for tokens in sequences:
        store_fresh(cache, tokens)
    cache.persist()


def test_key_lists_cross_the_ring_intact() -> None:
    keys = {entry_key(A[:10]), entry_key(B[:20]), entry_key((1,))}
    header, payload = keys_message(Op.DISK_KEYS, keys)
    assert header.count == 16 * len(keys)
    assert keys_of(payload) == keys
    empty_header, empty_payload = keys_message(Op.DISK_KEYS, set())
    assert (empty_header.count, empty_payload) == (0, None)
    assert keys_of(empty_payload) == set()


def test_files_are_named_by_their_tokens_and_kept_or_removed_by_name(tmp_path: Path) -> None:
    persisted(tmp_path, A[:100], B[:50])
    tier = DiskTier(tmp_path, "ns", BIG)
    assert tier.keys() == {entry_key(A[:100]), entry_key(B[:50])}
    found = tier.find(entry_key(A[:100]))
    assert found is not None and tier.key(found) == entry_key(A[:100])
    assert tier.find(entry_key(A[:99])) is None
    tier.retain({entry_key(B[:50]), entry_key(A[:3])})
    assert tier.keys() == {entry_key(B[:50])}
    tier.discard(entry_key(B[:50]))
    tier.discard(entry_key(B[:50]))  # gone already: nothing to do
    assert tier.keys() == set() and list((tmp_path / "ns").glob("*.safetensors")) == []


def test_a_declined_disk_load_is_a_miss_and_reads_nothing(tmp_path: Path) -> None:
    persisted(tmp_path, A[:100])
    asked: list[tuple[int, ...]] = []

    def decline(cache: KVPrefixCache, key: tuple[int, ...]) -> bool:
        asked.append(key)
        return False

    cache = KVPrefixCache(BIG, disk=DiskTier(tmp_path, "ns", BIG), disk_load=decline)
    assert cache.lookup((*A[:100], 1)).usable == 0
    assert asked == [(*A[:100], 1)]
    assert (cache.stats().entries, cache.stats().disk_entries) == (0, 1)


def test_an_entry_adopted_before_the_lookup_counts_a_disk_hit(tmp_path: Path) -> None:
    persisted(tmp_path, A[:100])
    cache = KVPrefixCache(
        BIG, disk=DiskTier(tmp_path, "ns", BIG), disk_load=lambda cache, key: False
    )
    key, usable = cache.disk_best((*A[:100], 1))
    assert (key, usable) == (entry_key(A[:100]), 100)
    loaded = cache.read_disk(entry_key(A[:100]))
    assert loaded is not None
    cache.adopt(*loaded)  # as a follower does when rank 0's LOAD is agreed
    match = cache.lookup((*A[:100], 1))
    restored = cache.restore(match)
    assert match.usable == 100 and restored is not None
    assert positions(restored[0]) == [float(p) for p in range(100)]
    assert (cache.stats().disk_hits, cache.stats().memory_hits) == (1, 0)
    cache.lookup((*A[:100], 2))
    assert (cache.stats().disk_hits, cache.stats().memory_hits) == (1, 1)
    assert cache.read_disk(entry_key(B[:5])) is None  # not on disk
