"""The prefix cache's disk tier: entries survive a restart, evicted entries are served
from disk, and foreign, stale or corrupt files are removed, never loaded."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from loguru import logger

from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.prefix_cache_disk import DiskTier, cache_namespace
from exo.shared.types.shard import LayerRange
from tests.unit.test_prefix_cache import (
    BIG,
    A,
    B,
    kv_bytes,
    positions,
    rotating_layers,
    store_fresh,
)

NS = "model-a"


def disk_cache(
    root: Path, budget: int = BIG, disk_budget: int = BIG, ns: str = NS
) -> KVPrefixCache:
    return KVPrefixCache(budget, disk=DiskTier(root, ns, disk_budget))


def test_entries_persisted_at_shutdown_are_served_after_a_restart(tmp_path: Path) -> None:
    first = disk_cache(tmp_path)
    store_fresh(first, A[:100])
    store_fresh(first, (*A[:40], *B[:30]))
    first.persist()
    assert first.stats().disk_entries == 2

    restarted = disk_cache(tmp_path)
    assert restarted.stats().entries == 0
    match = restarted.lookup((*A[:100], 7))
    assert match.usable == 100
    restored = restarted.restore(match)
    assert restored is not None
    assert positions(restored[1]) == [1000.0 + p for p in range(100)]
    stats = restarted.stats()
    assert (stats.disk_hits, stats.memory_hits, stats.entries) == (1, 0, 1)
    # Now in memory: the next hit is a memory hit.
    assert restarted.lookup((*A[:100], 8)).usable == 100
    assert restarted.stats().memory_hits == 1
    # The branch sharing 40 tokens is on disk too.
    assert restarted.lookup((*A[:40], *B[:30], 1)).usable == 70


def test_evicted_entries_go_to_disk_and_come_back(tmp_path: Path) -> None:
    cache = disk_cache(tmp_path, budget=kv_bytes(50))
    store_fresh(cache, A[:50])
    store_fresh(cache, B[:50])  # evicts A's entry: written to disk
    assert cache.stats().evictions == 1
    assert cache.stats().disk_entries == 1
    match = cache.lookup((*A[:50], 1))
    assert match.usable == 50
    assert cache.stats().disk_hits == 1
    restored = cache.restore(match)
    assert restored is not None and positions(restored[0]) == [float(p) for p in range(50)]


def test_only_the_longest_trimmable_file_of_a_conversation_is_kept(tmp_path: Path) -> None:
    cache = disk_cache(tmp_path)
    for n in (20, 40, 60):
        store_fresh(cache, A[:n])
        cache.persist()
    assert cache.stats().disk_entries == 1
    assert len(list((tmp_path / NS).glob("*.safetensors"))) == 1


def test_non_trimmable_entries_round_trip_and_restore_only_at_their_end(tmp_path: Path) -> None:
    cache = disk_cache(tmp_path)
    store_fresh(cache, A[:20], rotating_layers(20, max_size=8))
    cache.persist()
    restarted = disk_cache(tmp_path)
    assert restarted.lookup((*A[:15], 7)).usable == 0
    match = restarted.lookup((*A[:20], 7))
    assert match.usable == 20
    restored = restarted.restore(match)
    assert restored is not None
    original = rotating_layers(20, max_size=8)
    for got, want in zip(restored, original, strict=True):
        assert np.array_equal(np.array(got.keys), np.array(want.keys))
        assert got.offset == want.offset == 20


def test_disk_budget_keeps_the_most_recently_used_files(tmp_path: Path) -> None:
    one_file = _file_size(tmp_path)
    cache = disk_cache(tmp_path / "c", disk_budget=int(2.5 * one_file))
    for start in (0, 100_000, 200_000):
        store_fresh(cache, tuple(range(start, start + 30)))
        cache.persist()
    assert cache.stats().disk_entries == 2
    assert cache.stats().disk_bytes <= int(2.5 * one_file)
    restarted = disk_cache(tmp_path / "c")
    assert restarted.lookup(tuple(range(0, 31))).usable == 0  # the oldest went
    assert restarted.lookup(tuple(range(200_000, 200_031))).usable == 30


def test_the_budget_is_the_nodes_for_every_folder_together(tmp_path: Path) -> None:
    """Folders left by models or layer ranges served before count against the
    budget, oldest files first: the total stays within it."""
    one_file = _file_size(tmp_path)
    root = tmp_path / "c"
    before = disk_cache(root, ns="old-layers")
    for start in (0, 100_000):
        store_fresh(before, tuple(range(start, start + 30)))
        before.persist()
    assert len(list((root / "old-layers").glob("*.safetensors"))) == 2
    budget = int(2.5 * one_file)
    cache = disk_cache(root, ns="new-layers", disk_budget=budget)
    assert _folder_files(root) == {"old-layers": 2}  # within the budget
    store_fresh(cache, tuple(range(200_000, 200_030)))
    cache.persist()  # one file too many: the oldest goes, from the old folder
    assert _folder_files(root) == {"old-layers": 1, "new-layers": 1}
    store_fresh(cache, tuple(range(300_000, 300_030)))
    cache.persist()
    assert _folder_files(root) == {"new-layers": 2}  # the old folder went with its last file
    assert not (root / "old-layers").exists()
    assert sum(p.stat().st_size for p in root.rglob("*.safetensors")) <= budget
    assert cache.stats().disk_entries == 2
    restarted = disk_cache(root, ns="new-layers", disk_budget=budget)
    assert restarted.lookup(tuple(range(300_000, 300_031))).usable == 30


def test_a_file_another_runner_removed_for_the_budget_is_a_quiet_miss(tmp_path: Path) -> None:
    """Runners of one node share its disk budget: one may remove another's
    oldest file. The other finds it gone when it would load it: a miss, and
    no warning about a damaged file."""
    one_file = _file_size(tmp_path)
    root = tmp_path / "c"
    before = disk_cache(root, ns="first")
    store_fresh(before, tuple(range(0, 30)))
    before.persist()
    first = disk_cache(root, ns="first")  # restarted: the entry is on disk only
    assert first.stats().disk_entries == 1
    second = disk_cache(root, ns="second", disk_budget=int(1.5 * one_file))
    store_fresh(second, tuple(range(100_000, 100_030)))
    second.persist()  # over the node's budget: the first runner's older file goes
    assert _folder_files(root) == {"second": 1}
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING", format="{message}")
    try:
        assert first.lookup(tuple(range(0, 31))).usable == 0
    finally:
        logger.remove(sink)
    assert warnings == []
    assert first.stats().disk_entries == 0


def test_a_runner_whose_file_another_removed_still_writes_within_the_budget(
    tmp_path: Path,
) -> None:
    """Two runners of one model on a node (an instance moving, say) share its
    folder: one removes a file for the budget that the other indexed. The other
    drops it from its index when it next writes, and keeps writing; the files
    the other wrote count against the budget."""
    one_file = _file_size(tmp_path)
    root = tmp_path / "c"
    before = disk_cache(root, disk_budget=int(2.5 * one_file))
    for start in (0, 100_000):
        store_fresh(before, tuple(range(start, start + 30)))
        before.persist()
    first = disk_cache(root, disk_budget=int(2.5 * one_file))  # indexes both files
    second = disk_cache(root, disk_budget=int(2.5 * one_file))
    store_fresh(second, tuple(range(200_000, 200_030)))
    second.persist()
    store_fresh(second, tuple(range(300_000, 300_030)))
    second.persist()  # removes the two files `first` indexed
    store_fresh(first, tuple(range(400_000, 400_030)))
    assert first.persist() == 1  # no error: the files it lost are dropped
    assert first.stats().disk_entries == 1
    assert first.lookup(tuple(range(0, 31))).usable == 0
    assert sum(p.stat().st_size for p in root.rglob("*.safetensors")) <= int(2.5 * one_file)
    assert disk_cache(root).lookup(tuple(range(400_000, 400_031))).usable == 30


def _folder_files(root: Path) -> dict[str, int]:
    return {
        folder.name: count
        for folder in root.iterdir()
        if (count := len(list(folder.glob("*.safetensors"))))
    }


def _file_size(tmp_path: Path) -> int:
    probe = disk_cache(tmp_path / "probe")
    store_fresh(probe, tuple(range(900_000, 900_030)))
    probe.persist()
    (path,) = (tmp_path / "probe" / NS).glob("*.safetensors")
    return path.stat().st_size


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "partial write"])
def test_corrupt_files_are_removed_and_never_served(tmp_path: Path, damage: str) -> None:
    cache = disk_cache(tmp_path)
    store_fresh(cache, A[:100])
    cache.persist()
    (path,) = (tmp_path / NS).glob("*.safetensors")
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"\x07" * 64)
    elif damage == "truncated":  # a valid header, arrays cut short
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a write interrupted before its rename
        path.rename(tmp_path / NS / "partial" / path.name)

    restarted = disk_cache(tmp_path)
    match = restarted.lookup((*A[:100], 1))
    assert match.usable == 0
    assert restarted.restore(match) is None
    assert list((tmp_path / NS).rglob("*.safetensors")) == []
    assert restarted.stats().disk_entries == 0


def test_files_of_another_model_or_format_are_removed(tmp_path: Path) -> None:
    cache = disk_cache(tmp_path, ns="model-b")
    store_fresh(cache, A[:60])
    cache.persist()
    # Moved into this model's folder (a copied data dir, a renamed folder): foreign.
    (tmp_path / NS).mkdir()
    for path in (tmp_path / "model-b").glob("*.safetensors"):
        shutil.move(path, tmp_path / NS / path.name)
    restarted = disk_cache(tmp_path)
    assert restarted.lookup((*A[:60], 1)).usable == 0
    assert list((tmp_path / NS).rglob("*.safetensors")) == []


def test_namespace_names_model_files_tokenizer_template_and_layers(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "tokenizer.json").write_text("{}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "a"}))
    (model / "model.safetensors").write_bytes(b"0" * 10)
    (model / "README.md").write_text("irrelevant")
    whole = cache_namespace(model, None)
    assert whole == cache_namespace(model, None)
    assert whole != cache_namespace(model, LayerRange(start=0, end=1, total=2))
    (model / "README.md").write_text("still irrelevant")
    assert cache_namespace(model, None) == whole
    changes = [
        ("tokenizer_config.json", json.dumps({"chat_template": "b"})),
        ("tokenizer.json", '{"x": 1}'),
        ("config.json", json.dumps({"model_type": "qwen3"})),
    ]
    seen = {whole}
    for name, text in changes:
        (model / name).write_text(text)
        seen.add(cache_namespace(model, None))
    (model / "model.safetensors").write_bytes(b"0" * 11)
    seen.add(cache_namespace(model, None))
    assert len(seen) == 5
