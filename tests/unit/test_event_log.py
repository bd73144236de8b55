"""EventLog: append/replay round trips, torn tails dropped, mid-file corruption refused."""

import errno
import os
import random
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from exo.shared.event_log import EventLog, EventLogCorrupted, LogCompacted
from tests.unit.small_tmpfs import fill, small_tmpfs

HEADER_SIZE = 10
FILE_HEADER_SIZE = 16


def file_header(base_idx: int) -> bytes:
    """The documented file header of a log whose first record is `base_idx`."""
    return b"EXOLOG" + struct.pack("<HQ", 2, base_idx)


def record_bytes(payload: bytes) -> bytes:
    """The documented on-disk form of one record, built independently of the module."""
    return bytes((0xE5, 0x01)) + struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def payloads(n: int) -> list[bytes]:
    return [f'{{"kind":"Event","n":{i}}}'.encode() for i in range(n)]


def read_all(path: Path) -> list[bytes]:
    with EventLog.open(path) as log:
        return [payload for _, payload in log.read_from(0)]


def write_records(path: Path, records: list[bytes]) -> list[int]:
    """Write `records` through EventLog; return each record's start offset plus the end."""
    with EventLog.open(path) as log:
        log.append(records)
    starts = [FILE_HEADER_SIZE]
    for payload in records:
        starts.append(starts[-1] + HEADER_SIZE + len(payload))
    assert path.stat().st_size == starts[-1]
    return starts


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING", format="{message}")
    yield messages
    logger.remove(sink)


def test_on_disk_format_is_the_documented_one(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    with EventLog.open(path) as log:
        log.append([b"hello", b""])
    assert path.read_bytes() == file_header(0) + record_bytes(b"hello") + record_bytes(b"")


def test_empty_log_creates_parent_dirs_and_reads_nothing(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "events.log"
    with EventLog.open(path) as log:
        assert log.next_idx == 0
        assert list(log.read_from(0)) == []
        assert list(log.read_from(5)) == []
    assert path.read_bytes() == file_header(0)
    with EventLog.open(path) as log:
        assert log.next_idx == 0


@pytest.mark.parametrize(
    ("batches", "first_idxs"),
    [
        ([[b"a"]], [0]),
        ([[b"a"], [b"b", b"c"], [b"d"]], [0, 1, 3]),
        ([[], [b"a"], [], [b"b"]], [0, 0, 1, 1]),
        ([[b""], [b"", b"x"]], [0, 1]),
        ([[bytes(range(256))] * 3], [0]),
    ],
)
def test_append_returns_first_idx_and_survives_reopen(
    tmp_path: Path, batches: list[list[bytes]], first_idxs: list[int]
) -> None:
    path = tmp_path / "events.log"
    expected = [p for batch in batches for p in batch]
    with EventLog.open(path) as log:
        assert [log.append(batch) for batch in batches] == first_idxs
        assert log.next_idx == len(expected)
        assert [p for _, p in log.read_from(0)] == expected
    with EventLog.open(path) as log:
        assert log.next_idx == len(expected)
        assert list(log.read_from(0)) == list(enumerate(expected))
        # Appends after a reopen continue the same index sequence.
        assert log.append([b"next"]) == len(expected)
    assert read_all(path) == [*expected, b"next"]


@pytest.mark.parametrize("from_idx", [0, 1, 5, 9, 10, 11, 100])
def test_read_from_any_idx(tmp_path: Path, from_idx: int) -> None:
    records = payloads(10)
    with EventLog.open(tmp_path / "events.log") as log:
        log.append(records[:4])
        log.append(records[4:])
        assert list(log.read_from(from_idx)) == list(enumerate(records))[from_idx:]


def test_read_from_negative_idx_is_rejected(tmp_path: Path) -> None:
    with EventLog.open(tmp_path / "events.log") as log, pytest.raises(ValueError, match="-1"):
        log.read_from(-1)


def test_reader_sees_records_appended_while_iterating(tmp_path: Path) -> None:
    with EventLog.open(tmp_path / "events.log") as log:
        log.append([b"a", b"b"])
        reader = log.read_from(1)
        assert next(reader) == (1, b"b")
        log.append([b"c"])
        log.append([b"d"])
        assert list(reader) == [(2, b"c"), (3, b"d")]


def test_closed_log_refuses_use(tmp_path: Path) -> None:
    log = EventLog.open(tmp_path / "events.log")
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        log.append([b"a"])
    with pytest.raises(ValueError, match="closed"):
        log.read_from(0)


@pytest.mark.parametrize("last_size", [0, 1, 40, 120])
def test_torn_last_record_is_dropped_at_every_cut(
    tmp_path: Path, warnings: list[str], last_size: int
) -> None:
    path = tmp_path / "events.log"
    complete = payloads(3)
    records = [*complete, bytes(range(256))[:last_size]]
    starts = write_records(path, records)
    original = path.read_bytes()
    last_start = starts[3]
    for cut in range(last_start + 1, len(original)):
        path.write_bytes(original[:cut])
        warnings.clear()
        with EventLog.open(path) as log:
            assert log.next_idx == 3, cut
            assert list(log.read_from(0)) == list(enumerate(complete)), cut
            assert path.stat().st_size == last_start, cut
            assert log.append([b"after"]) == 3, cut
        assert len(warnings) == 1, cut
        assert f"byte offset {last_start}" in warnings[0]
        assert read_all(path) == [*complete, b"after"], cut


def test_torn_tail_inside_a_large_batch(tmp_path: Path, warnings: list[str]) -> None:
    path = tmp_path / "events.log"
    records = [random.Random(i).randbytes(1 << 20) for i in range(3)]
    starts = write_records(path, records)
    original = path.read_bytes()
    for cut, survivors in [
        (starts[1] + HEADER_SIZE + 12345, 1),
        (starts[2] + 3, 2),
        (starts[3] - 1, 2),
        (starts[2], 2),  # a clean cut between records: nothing to drop
    ]:
        path.write_bytes(original[:cut])
        assert read_all(path) == records[:survivors], cut
        assert path.stat().st_size == starts[survivors], cut


def test_zero_filled_tail_is_dropped(tmp_path: Path, warnings: list[str]) -> None:
    """A crash can leave the file extended with zeros where the data never landed."""
    path = tmp_path / "events.log"
    starts = write_records(path, payloads(2))
    with path.open("ab") as file:
        file.write(bytes(4096))
    assert read_all(path) == payloads(2)
    assert path.stat().st_size == starts[2]
    assert f"byte offset {starts[2]}" in warnings[0]


def corrupt(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


# Where to damage a record (relative to its start) and with what; each leaves it invalid.
DAMAGE = {
    "magic": (0, b"\x00"),
    "length grown": (2, struct.pack("<I", 0x7FFF_FFFF)),
    "length shrunk": (2, struct.pack("<I", 3)),
    "crc": (6, b"\x00\x00\x00\x00"),
    "payload byte": (HEADER_SIZE + 5, b"#"),
    "zeroed": (0, bytes(HEADER_SIZE + 8)),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_last_record_is_dropped(
    tmp_path: Path, warnings: list[str], damage: tuple[int, bytes]
) -> None:
    path = tmp_path / "events.log"
    records = payloads(3)
    starts = write_records(path, records)
    where, new = damage
    path.write_bytes(corrupt(path.read_bytes(), starts[2] + where, new))
    with EventLog.open(path) as log:
        assert list(log.read_from(0)) == list(enumerate(records[:2]))
        assert log.append([b"after"]) == 2
    assert path.stat().st_size == starts[2] + HEADER_SIZE + len(b"after")
    assert f"byte offset {starts[2]}" in warnings[0]
    assert read_all(path) == [*records[:2], b"after"]


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
@pytest.mark.parametrize("bad_idx", [0, 1])
def test_damaged_middle_record_raises(
    tmp_path: Path, damage: tuple[int, bytes], bad_idx: int
) -> None:
    path = tmp_path / "events.log"
    starts = write_records(path, payloads(3))
    where, new = damage
    damaged = corrupt(path.read_bytes(), starts[bad_idx] + where, new)
    path.write_bytes(damaged)
    with pytest.raises(EventLogCorrupted, match=f"byte offset {starts[bad_idx]}") as caught:
        EventLog.open(path)
    assert (caught.value.idx, caught.value.offset) == (bad_idx, starts[bad_idx])
    assert f"record {bad_idx}" in str(caught.value)
    assert path.read_bytes() == damaged, "a corrupt log must be left untouched"


def test_unknown_version_raises_even_at_the_tail(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    starts = write_records(path, payloads(2))
    path.write_bytes(corrupt(path.read_bytes(), starts[1] + 1, b"\x02"))
    with pytest.raises(EventLogCorrupted, match="version 2") as caught:
        EventLog.open(path)
    assert (caught.value.idx, caught.value.offset) == (1, starts[1])


def test_replay_detects_bytes_changed_after_open(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    starts = write_records(path, payloads(3))
    with EventLog.open(path) as log:
        path.write_bytes(corrupt(path.read_bytes(), starts[1] + HEADER_SIZE, b"#"))
        reader = log.read_from(0)
        with pytest.raises(EventLogCorrupted, match=f"byte offset {starts[1]}"):
            list(reader)


def test_large_payloads_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    records = [random.Random(i).randbytes((1 << 20) + i) for i in range(4)]
    with EventLog.open(path) as log:
        assert log.append(records[:1]) == 0
        assert log.append(records[1:]) == 1
        assert [p for _, p in log.read_from(2)] == records[2:]
    assert read_all(path) == records


def test_ten_thousand_small_records_replay_fast(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    records = payloads(10_000)
    with EventLog.open(path) as log:
        for i in range(0, len(records), 500):
            log.append(records[i : i + 500])
    started = time.perf_counter()
    with EventLog.open(path) as log:
        assert log.next_idx == 10_000
        replayed = list(log.read_from(0))
        tail = list(log.read_from(9_990))
    elapsed = time.perf_counter() - started
    assert replayed == list(enumerate(records))
    assert tail == list(enumerate(records))[9_990:]
    assert elapsed < 1.0, f"reopen + replay of 10k records took {elapsed:.2f}s"


# --- compaction: a log that starts at a base index ------------------------------


def test_rewrite_from_keeps_the_tail_and_its_indices(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    records = payloads(10)
    with EventLog.open(path) as log:
        log.append(records[:6])
        reader = log.read_from(7)  # a reader started before the compaction...
        log.append(records[6:])
        log.rewrite_from(7)
        assert (log.base_idx, log.next_idx, log.synced_idx) == (7, 10, 10)
        assert list(reader) == list(enumerate(records))[7:]  # ...reads on in the new file
        assert list(log.read_from(8)) == list(enumerate(records))[8:]
        with pytest.raises(LogCompacted) as compacted:
            log.read_from(6)
        assert compacted.value.base_idx == 7
        assert log.append([b"next"]) == 10
    assert path.read_bytes() == file_header(7) + b"".join(
        record_bytes(r) for r in [*records[7:], b"next"]
    )
    assert not path.with_name("events.log.tmp").exists()
    with EventLog.open(path) as log:
        assert (log.base_idx, log.next_idx) == (7, 11)


def test_a_reader_behind_a_compaction_is_told(tmp_path: Path) -> None:
    with EventLog.open(tmp_path / "events.log") as log:
        log.append(payloads(5))
        reader = log.read_from(1)  # not read yet when the records go
        log.rewrite_from(4)
        with pytest.raises(LogCompacted):
            next(reader)


def test_an_empty_log_can_start_at_any_index(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    with EventLog.open(path) as log:
        log.append(payloads(3))
    with EventLog.create_empty(path, 1234) as log:
        assert (log.base_idx, log.next_idx) == (1234, 1234)
        assert log.append([b"x"]) == 1234
    with EventLog.open(path) as log:
        assert list(log.read_from(1234)) == [(1234, b"x")]
        with pytest.raises(LogCompacted):
            log.read_from(0)


def test_a_log_without_a_file_header_is_read_from_index_0(tmp_path: Path) -> None:
    """Logs written before compaction existed start with a record."""
    path = tmp_path / "events.log"
    path.write_bytes(record_bytes(b"a") + record_bytes(b"b"))
    with EventLog.open(path) as log:
        assert list(log.read_from(0)) == [(0, b"a"), (1, b"b")]
        assert log.append([b"c"]) == 2
    assert read_all(path) == [b"a", b"b", b"c"]


@pytest.mark.parametrize("cut", range(FILE_HEADER_SIZE))
def test_a_new_log_torn_inside_its_file_header_opens_empty(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "events.log"
    path.write_bytes(file_header(0)[:cut])
    with EventLog.open(path) as log:
        assert (log.base_idx, log.next_idx) == (0, 0)
    assert path.read_bytes() == file_header(0)


def test_a_bad_file_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    path.write_bytes(b"EXOLOG" + struct.pack("<HQ", 9, 0))
    with pytest.raises(EventLogCorrupted, match="unsupported file format version 9"):
        EventLog.open(path)
    path.write_bytes(b"garbage-garbage-garbage")
    with pytest.raises(EventLogCorrupted, match="bad file header"):
        EventLog.open(path)


# --- durability: write, then sync (possibly in another thread) ------------------


def test_written_records_are_readable_at_once_and_durable_after_sync(tmp_path: Path) -> None:
    with EventLog.open(tmp_path / "events.log") as log:
        log.append([b"a"])
        assert log.write([b"b", b"c"]) == 1
        assert (log.next_idx, log.synced_idx) == (3, 1)
        assert [p for _, p in log.read_from(0)] == [b"a", b"b", b"c"]
        assert log.sync() == 3
        assert log.sync() == 3  # nothing new: no fsync needed


def test_a_failed_fsync_writes_the_records_again_and_a_later_sync_covers_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed fsync the kernel may have dropped the dirty pages; the
    records are written again so the next fsync makes them durable."""
    path = tmp_path / "events.log"
    with EventLog.open(path) as log:
        log.append([b"a"])
        log.write([b"b"])
        real_fsync = os.fsync

        def failing_fsync(fd: int) -> None:
            # What the kernel may do: the dirty pages are gone with the error.
            os.pwrite(fd, b"\0" * 11, FILE_HEADER_SIZE + 11)
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(OSError, match="Input/output error"):
            log.sync()
        assert log.synced_idx == 1
        monkeypatch.setattr(os, "fsync", real_fsync)
        log.write([b"c"])
        assert log.sync() == 3
    assert read_all(path) == [b"a", b"b", b"c"]


def test_a_full_disk_fails_the_write_and_leaves_the_log_as_it_was(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        path = disk / "events.log"
        with EventLog.open(path) as log:
            log.append([b"before"])
            filler = fill(disk)
            big = b"x" * 200_000
            with pytest.raises(OSError) as full:
                log.append([big])
            assert full.value.errno == errno.ENOSPC
            assert (log.next_idx, log.synced_idx) == (1, 1)
            assert path.stat().st_size == FILE_HEADER_SIZE + HEADER_SIZE + len(b"before")
            filler.unlink()  # space comes back: appends go on
            assert log.append([big]) == 1
        assert read_all(path) == [b"before", big]
