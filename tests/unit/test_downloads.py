"""Downloads from the hub protocol (a fake hub on loopback) and from ordered
sources: shard file sets, resume, verification, errors, progress, disk space."""

import hashlib
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from exo.models.cards import card_from_folder
from exo.models.file_source import (
    DownloadError,
    FileSource,
    RemoteFile,
    SourceUnavailable,
)
from exo.models.weight_files import shard_files
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import ModelCard
from exo.shared.units import human_bytes
from exo.worker.downloads.disk_space import DiskSpace, DiskUsage, default_floor
from exo.worker.downloads.hub import HubSource
from exo.worker.downloads.transfer import (
    ALREADY_HERE,
    ATTEMPTS,
    download_files,
    fetch_file,
)
from tests.hub_server import FakeHub, git_sha1
from tests.model_factory import make_tiny_llama
from tests.unit.small_tmpfs import resize, small_tmpfs

MODEL = ModelId("test-org/tiny-llama")
# Holds the norm and the untied lm_head: 6 MB.
LAST_WEIGHTS = "model-00003-of-00003.safetensors"
FAST_RETRY = 0.001


@pytest.fixture(autouse=True)
def no_hub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("repo") / "tiny-llama",
        smollm_dir,
        n_layers=4,
        hidden=32,  # the files stay a few MB: fast to send and hash
        weight_files=3,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def card(repo: Path) -> ModelCard:
    return card_from_folder(MODEL, repo)


@pytest.fixture
def hub(repo: Path) -> Iterator[FakeHub]:
    # Pages of 3 entries: every listing follows the Link header.
    with FakeHub({MODEL: repo}, page_size=3) as server:
        yield server


def all_files(repo: Path) -> set[str]:
    return {p.name for p in repo.iterdir() if p.is_file()}


def files_in(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def remote_file(repo: Path, path: str) -> RemoteFile:
    data = (repo / path).read_bytes()
    return RemoteFile(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest())


async def download(
    sources: list[FileSource],
    dest: Path,
    wanted: set[str] | None = None,
    model_id: ModelId = MODEL,
    throttle_seconds: float = 0.0,
    attempts: int = ATTEMPTS,
    disk: DiskSpace | None = None,
) -> list[DownloadProgress]:
    """Every progress report of one `download_files` call (unthrottled by default)."""
    reports: list[DownloadProgress] = []
    await download_files(
        sources,
        model_id,
        wanted,
        dest,
        reports.append,
        throttle_seconds,
        disk=disk,
        attempts=attempts,
        retry_delay=FAST_RETRY,
    )
    return reports


class Unavailable:
    """A source without the model (a peer that does not have it)."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def list_files(self, model_id: ModelId) -> list[RemoteFile]:
        raise SourceUnavailable("does not have it")

    async def read(self, model_id: ModelId, path: str, offset: int) -> AsyncIterator[bytes]:
        raise SourceUnavailable("does not have it")
        yield b""  # an async generator, like every source's read


class Folder:
    """A source holding some files of a model folder (a peer with its shard)."""

    def __init__(self, name: str, repo: Path, paths: set[str]) -> None:
        self.name = name
        self.repo = repo
        self.paths = paths
        self.served: list[tuple[str, int]] = []

    async def list_files(self, model_id: ModelId) -> list[RemoteFile]:
        return [remote_file(self.repo, path) for path in sorted(self.paths)]

    async def read(self, model_id: ModelId, path: str, offset: int) -> AsyncIterator[bytes]:
        if path not in self.paths:
            raise SourceUnavailable(f"has no {path}")
        self.served.append((path, offset))
        yield (self.repo / path).read_bytes()[offset:]


# --- shard file sets --------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "end", "weights"),
    [
        (0, 2, {"model-00001-of-00003.safetensors"}),
        (2, 4, {"model-00002-of-00003.safetensors", LAST_WEIGHTS}),
    ],
)
async def test_a_shard_downloads_exactly_its_files(
    tmp_path: Path,
    repo: Path,
    card: ModelCard,
    hub: FakeHub,
    start: int,
    end: int,
    weights: set[str],
) -> None:
    wanted = shard_files(card, start, end)
    assert wanted == weights | {
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    await download([HubSource(hub.url)], tmp_path, wanted)
    assert files_in(tmp_path) == wanted
    for name in wanted:
        assert (tmp_path / name).read_bytes() == (repo / name).read_bytes(), name
    # Nothing else crossed the wire, and every wanted byte once.
    assert dict(hub.bytes_sent) == {name: (repo / name).stat().st_size for name in wanted}


async def test_the_hub_listing_follows_pages_and_reports_hashes(repo: Path, hub: FakeHub) -> None:
    listed = await HubSource(hub.url).list_files(MODEL)
    assert [f.path for f in listed] == sorted(all_files(repo))  # 7 files over 3 pages
    for remote in listed:
        data = (repo / remote.path).read_bytes()
        assert remote.size == len(data)
        if remote.path.endswith(".safetensors"):
            assert (remote.sha256, remote.git_sha1) == (hashlib.sha256(data).hexdigest(), None)
        else:
            assert (remote.sha256, remote.git_sha1) == (None, git_sha1(data))


# --- resume ---------------------------------------------------------------


async def test_an_interrupted_download_resumes_from_the_partial_in_a_later_call(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    size = (repo / LAST_WEIGHTS).stat().st_size
    cut = 1_000_003
    hub.cut_after(LAST_WEIGHTS, cut)
    with pytest.raises(DownloadError) as failed:
        await download([HubSource(hub.url)], tmp_path, {LAST_WEIGHTS}, attempts=1)
    assert LAST_WEIGHTS in str(failed.value)
    assert "hub:" in str(failed.value)
    partial = tmp_path / f"{LAST_WEIGHTS}.partial"
    assert partial.stat().st_size == cut
    assert not (tmp_path / LAST_WEIGHTS).exists()

    reports = await download([HubSource(hub.url)], tmp_path, {LAST_WEIGHTS})
    assert reports[0].bytes_done == cut  # the partial counts as done
    assert hub.offsets(LAST_WEIGHTS) == [0, cut]
    assert hub.requests[-1].status == 206
    # The second request re-sent only what the partial lacked.
    assert hub.bytes_sent[LAST_WEIGHTS] == size
    assert (tmp_path / LAST_WEIGHTS).read_bytes() == (repo / LAST_WEIGHTS).read_bytes()
    assert not partial.exists()


async def test_a_dropped_connection_is_retried_from_the_partial(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    size = (repo / LAST_WEIGHTS).stat().st_size
    hub.cut_after(LAST_WEIGHTS, 500_000)
    await download([HubSource(hub.url)], tmp_path, {LAST_WEIGHTS})
    assert hub.offsets(LAST_WEIGHTS) == [0, 500_000]
    assert hub.bytes_sent[LAST_WEIGHTS] == size
    assert (tmp_path / LAST_WEIGHTS).read_bytes() == (repo / LAST_WEIGHTS).read_bytes()


async def test_a_cancelled_download_keeps_its_partial_for_the_next_call(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    written: list[int] = []
    remote = remote_file(repo, LAST_WEIGHTS)
    with anyio.CancelScope() as scope:

        def cancel_after_a_megabyte(n: int) -> None:
            written.append(n)
            if sum(written) >= 1_000_000:
                scope.cancel()

        await fetch_file([HubSource(hub.url)], MODEL, remote, tmp_path, cancel_after_a_megabyte)
    assert scope.cancelled_caught
    kept = (tmp_path / f"{LAST_WEIGHTS}.partial").stat().st_size
    assert kept == sum(written) >= 1_000_000
    assert not (tmp_path / LAST_WEIGHTS).exists()

    await fetch_file([HubSource(hub.url)], MODEL, remote, tmp_path, lambda n: None)
    assert hub.offsets(LAST_WEIGHTS) == [0, kept]
    assert (tmp_path / LAST_WEIGHTS).read_bytes() == (repo / LAST_WEIGHTS).read_bytes()


async def test_a_server_error_is_retried(tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    hub.fail_once("config.json", 503)
    await download([HubSource(hub.url)], tmp_path, {"config.json"})
    assert [(r.offset, r.status) for r in hub.requests] == [(0, 503), (0, 200)]
    assert (tmp_path / "config.json").read_bytes() == (repo / "config.json").read_bytes()


async def test_a_partial_larger_than_the_file_is_discarded(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    size = (repo / "config.json").stat().st_size
    (tmp_path / "config.json.partial").write_bytes(b"x" * (size + 1))
    await download([HubSource(hub.url)], tmp_path, {"config.json"})
    assert hub.offsets("config.json") == [0]
    assert (tmp_path / "config.json").read_bytes() == (repo / "config.json").read_bytes()


async def test_a_complete_file_is_not_fetched_again(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    (tmp_path / LAST_WEIGHTS).write_bytes((repo / LAST_WEIGHTS).read_bytes())
    written: list[int] = []
    remote = remote_file(repo, LAST_WEIGHTS)
    used = await fetch_file([HubSource(hub.url)], MODEL, remote, tmp_path, written.append)
    assert used == ALREADY_HERE
    assert written == []
    assert hub.requests == []


async def test_an_empty_file_in_a_subfolder_is_created(tmp_path: Path) -> None:
    (tmp_path / "repo" / "sub").mkdir(parents=True)
    (tmp_path / "repo" / "sub" / "empty.txt").write_bytes(b"")
    remote = RemoteFile(path="sub/empty.txt", size=0, git_sha1=git_sha1(b""))
    source = Folder("peer a", tmp_path / "repo", {"sub/empty.txt"})
    used = await fetch_file([source], MODEL, remote, tmp_path / "dest", lambda n: None)
    assert used == "peer a"
    assert (tmp_path / "dest" / "sub" / "empty.txt").read_bytes() == b""
    assert files_in(tmp_path / "dest") == {"sub/empty.txt"}


# --- verification ----------------------------------------------------------


@pytest.mark.parametrize("path", [LAST_WEIGHTS, "config.json"])  # sha256, git sha1
async def test_a_corrupted_transfer_is_detected_and_refetched(
    tmp_path: Path, repo: Path, hub: FakeHub, path: str
) -> None:
    size = (repo / path).stat().st_size
    hub.corrupt_once(path)
    reports = await download([HubSource(hub.url)], tmp_path, {path})
    assert hub.offsets(path) == [0, 0]  # the bad partial was dropped, not resumed
    assert hub.bytes_sent[path] == 2 * size
    assert (tmp_path / path).read_bytes() == (repo / path).read_bytes()
    assert reports[-1].bytes_done == size  # the dropped bytes were taken back


async def test_a_corrupted_transfer_without_retries_fails_and_leaves_nothing(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    hub.corrupt_once(LAST_WEIGHTS)
    remote = remote_file(repo, LAST_WEIGHTS)
    with pytest.raises(DownloadError, match="hash mismatch") as failed:
        await fetch_file([HubSource(hub.url)], MODEL, remote, tmp_path, lambda n: None, attempts=1)
    assert LAST_WEIGHTS in str(failed.value)
    assert files_in(tmp_path) == set()


# --- missing repo or file ----------------------------------------------------


async def test_a_missing_repo_is_a_clear_error(tmp_path: Path, hub: FakeHub) -> None:
    with pytest.raises(DownloadError) as failed:
        await download([HubSource(hub.url)], tmp_path, model_id=ModelId("test-org/nope"))
    message = str(failed.value)
    assert message.startswith("test-org/nope not found: hub: ")
    assert hub.url in message


async def test_a_wanted_file_no_source_has_is_named(tmp_path: Path, hub: FakeHub) -> None:
    with pytest.raises(DownloadError) as failed:
        await download([HubSource(hub.url)], tmp_path, {"config.json", "nope.safetensors"})
    assert str(failed.value) == f"{MODEL}: no source has nope.safetensors"
    assert hub.requests == []  # refused before fetching anything
    assert files_in(tmp_path) == set()


async def test_a_listed_path_outside_the_folder_is_refused(tmp_path: Path, repo: Path) -> None:
    remote = RemoteFile(path="../escape.json", size=3)
    with pytest.raises(DownloadError) as refused:
        await fetch_file([Folder("peer a", repo, set())], MODEL, remote, tmp_path, lambda n: None)
    assert str(refused.value) == "refusing file path '../escape.json': not a plain relative path"
    assert not (tmp_path.parent / "escape.json").exists()


# --- token ---------------------------------------------------------------------


async def test_the_token_is_sent_and_required(
    tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeHub({MODEL: repo}, token="sekrit") as hub:
        with pytest.raises(DownloadError) as refused:
            await download([HubSource(hub.url)], tmp_path / "none", {"config.json"})
        assert "HTTP 401" in str(refused.value)
        assert "set HF_TOKEN" in str(refused.value)

        with pytest.raises(DownloadError, match="HF_TOKEN's token has no access"):
            await download([HubSource(hub.url, token="wrong")], tmp_path / "bad", {"config.json"})

        await download([HubSource(hub.url, token="sekrit")], tmp_path / "arg", {"config.json"})
        assert files_in(tmp_path / "arg") == {"config.json"}

        monkeypatch.setenv("HF_TOKEN", "sekrit")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.authorizations.clear()
        await download([HubSource()], tmp_path / "env", {"config.json", LAST_WEIGHTS})
        assert files_in(tmp_path / "env") == {"config.json", LAST_WEIGHTS}
        # Listing, resolve and the redirected LFS download all carried it.
        assert len(hub.authorizations) >= 3
        assert set(hub.authorizations) == {"Bearer sekrit"}


# --- progress ------------------------------------------------------------------


async def test_progress_counts_up_to_complete(tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    reports = await download([HubSource(hub.url)], tmp_path)
    files = sorted(all_files(repo))
    total = sum((repo / name).stat().st_size for name in files)
    first, last = reports[0], reports[-1]
    assert (first.status, first.bytes_done, first.files_done, first.have_files) == (
        "downloading",
        0,
        0,
        (),
    )
    assert all(r.status == "downloading" for r in reports[:-1])
    assert all(r.files_total == len(files) and r.bytes_total == total for r in reports)
    done = [r.bytes_done for r in reports]
    assert done == sorted(done)
    assert [r.files_done for r in reports] == sorted(r.files_done for r in reports)
    assert any(r.speed_bytes_per_s > 0 and r.eta_seconds is not None for r in reports)
    assert last.status == "complete"
    assert last.have_files == tuple(files)
    assert (last.files_done, last.bytes_done) == (len(files), total)
    assert (last.eta_seconds, last.source) == (None, "hub")


async def test_progress_reports_are_throttled(tmp_path: Path, hub: FakeHub) -> None:
    reports = await download([HubSource(hub.url)], tmp_path, throttle_seconds=60.0)
    assert [r.status for r in reports] == ["downloading", "complete"]


async def test_progress_counts_present_and_partial_files_as_done(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    (tmp_path / "config.json").write_bytes((repo / "config.json").read_bytes())
    partial = 12_345
    (tmp_path / f"{LAST_WEIGHTS}.partial").write_bytes((repo / LAST_WEIGHTS).read_bytes()[:partial])
    reports = await download([HubSource(hub.url)], tmp_path, {"config.json", LAST_WEIGHTS})
    config_size = (repo / "config.json").stat().st_size
    assert reports[0].bytes_done == config_size + partial
    assert (reports[0].files_done, reports[0].have_files) == (1, ("config.json",))
    assert "config.json" not in hub.bytes_sent
    assert hub.offsets(LAST_WEIGHTS) == [partial]
    assert reports[-1].have_files == ("config.json", LAST_WEIGHTS)


# --- disk space ----------------------------------------------------------------


async def test_too_little_disk_space_is_refused_up_front(
    tmp_path: Path, repo: Path, card: ModelCard, hub: FakeHub
) -> None:
    wanted = shard_files(card, 2, 4)
    total = sum((repo / name).stat().st_size for name in wanted)
    partial = 100_000
    (tmp_path / f"{LAST_WEIGHTS}.partial").write_bytes((repo / LAST_WEIGHTS).read_bytes()[:partial])
    needed = total - partial
    floor = 1000
    with pytest.raises(DownloadError) as refused:
        await download([HubSource(hub.url)], tmp_path, wanted, disk=disk_with(needed + floor - 1))
    assert str(refused.value) == (
        f"needs {human_bytes(needed)} more, {human_bytes(needed + floor - 1)} free in "
        f"{tmp_path} of which {human_bytes(floor)} stays free"
    )
    assert hub.requests == []
    # Exactly enough above the floor (the partial's bytes are already on disk) is enough.
    await download([HubSource(hub.url)], tmp_path, wanted, disk=disk_with(needed + floor))
    assert files_in(tmp_path) == wanted


def disk_with(free: int, floor: int = 1000) -> DiskSpace:
    return DiskSpace(min_free_bytes=floor, usage=lambda _: DiskUsage(total=100 * free, free=free))


@pytest.mark.parametrize(
    ("total", "floor"),
    [(10 << 30, 1 << 30), (20 << 30, 1 << 30), (100 << 30, 5 << 30), (1 << 40, (1 << 40) // 20)],
)
def test_the_default_floor_is_1_gib_or_5_percent_of_the_disk(total: int, floor: int) -> None:
    assert default_floor(total) == floor
    assert DiskSpace().floor(total) == floor
    assert DiskSpace(min_free_bytes=7).floor(total) == 7


def test_downloads_that_fit_alone_but_not_together_are_refused_the_second(
    tmp_path: Path,
) -> None:
    disk = disk_with(free=10_000, floor=1_000)  # 9,000 bytes to share
    with disk.reserve(tmp_path, 6_000) as first:
        with pytest.raises(DownloadError) as refused, disk.reserve(tmp_path, 6_000):
            pass
        assert str(refused.value) == (
            f"needs 6.0 KB more, 10.0 KB free in {tmp_path} of which 1.0 KB stays free, "
            "6.0 KB reserved by other downloads"
        )
        # Bytes that landed leave the free space and the reservation alike:
        # the test's disk does not shrink, so the second fits once 3,000 landed.
        first.consume(3_000)
        with disk.reserve(tmp_path, 6_000) as second:
            assert second.remaining == 6_000
    # Both ended: the whole 9,000 is there again; nothing needed always fits.
    with disk.reserve(tmp_path, 9_000), disk.reserve(tmp_path, 0):
        pass


async def test_two_concurrent_downloads_share_the_space(
    tmp_path: Path, repo: Path, card: ModelCard, hub: FakeHub
) -> None:
    """The second of two concurrent downloads that only fit one at a time is
    refused with the reason; the first completes."""
    wanted = shard_files(card, 0, 4)
    total = sum((repo / name).stat().st_size for name in wanted)
    disk = disk_with(free=total + total // 2, floor=0)
    errors: list[str] = []

    async def second() -> None:
        await anyio.sleep(0.01)  # the first has reserved by now
        try:
            await download([HubSource(hub.url)], tmp_path / "b", wanted, disk=disk)
        except DownloadError as error:
            errors.append(str(error))

    async with anyio.create_task_group() as group:
        group.start_soon(second)
        await download([HubSource(hub.url)], tmp_path / "a", wanted, disk=disk)
    assert files_in(tmp_path / "a") == wanted
    [error] = errors
    assert "reserved by other downloads" in error


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "small", "2m") as mount_point:
        yield mount_point


async def test_a_disk_that_fills_during_a_download_fails_it_clearly_and_it_resumes(
    small_disk: Path, repo: Path, hub: FakeHub
) -> None:
    """The space check passes (another process fills the disk meanwhile, here
    simulated by a check that sees plenty): the write hits ENOSPC, the download
    fails with a clear reason, the partial is kept, and once there is space
    again the download resumes and completes."""
    plenty = DiskSpace(min_free_bytes=0, usage=lambda _: DiskUsage(total=1 << 40, free=1 << 40))
    with pytest.raises(DownloadError, match="the disk is full: cannot write " + LAST_WEIGHTS):
        await download([HubSource(hub.url)], small_disk, {LAST_WEIGHTS}, disk=plenty)
    partial = small_disk / f"{LAST_WEIGHTS}.partial"
    assert 0 < partial.stat().st_size < (repo / LAST_WEIGHTS).stat().st_size
    resize(small_disk, "64m")
    requests_before = len(hub.requests)
    await download([HubSource(hub.url)], small_disk, {LAST_WEIGHTS}, disk=plenty)
    assert (small_disk / LAST_WEIGHTS).read_bytes() == (repo / LAST_WEIGHTS).read_bytes()
    assert len(hub.requests) > requests_before


# --- sources in order ------------------------------------------------------------


async def test_an_unavailable_source_is_skipped(tmp_path: Path, repo: Path, hub: FakeHub) -> None:
    sources: list[FileSource] = [Unavailable("peer a"), HubSource(hub.url)]
    remote = remote_file(repo, "config.json")
    used = await fetch_file(sources, MODEL, remote, tmp_path, lambda n: None)
    assert used == "hub"
    assert (tmp_path / "config.json").read_bytes() == (repo / "config.json").read_bytes()

    reports = await download(sources, tmp_path / "all", {"config.json", LAST_WEIGHTS})
    assert reports[-1].source == "hub"


async def test_an_unreachable_source_is_retried_then_skipped(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    down, peer = HubSource(dead), Folder("peer b", repo, {"config.json"})
    down.name = "hub (down)"
    remote = remote_file(repo, "config.json")
    used = await fetch_file([down, peer], MODEL, remote, tmp_path, lambda n: None, retry_delay=0)
    assert used == "peer b"
    assert peer.served == [("config.json", 0)]

    with pytest.raises(DownloadError) as failed:
        await fetch_file(
            [down, Unavailable("peer a")],
            MODEL,
            remote_file(repo, LAST_WEIGHTS),
            tmp_path,
            lambda n: None,
            attempts=2,
            retry_delay=0,
        )
    message = str(failed.value)
    assert message.startswith(f"cannot download {LAST_WEIGHTS} of {MODEL}: hub (down): ")
    assert "(after 2 attempts); peer a: does not have it" in message


async def test_files_a_peer_lacks_come_from_the_next_source(
    tmp_path: Path, repo: Path, card: ModelCard, hub: FakeHub
) -> None:
    wanted = shard_files(card, 0, 2)
    peer = Folder("peer c", repo, {"config.json", "model-00001-of-00003.safetensors"})
    await download([peer, HubSource(hub.url)], tmp_path, wanted)
    assert files_in(tmp_path) == wanted
    assert {path for path, _ in peer.served} == peer.paths
    assert set(hub.bytes_sent) == wanted - peer.paths


# --- a server that ignores Range -------------------------------------------------


async def test_a_full_response_to_a_range_request_is_skipped_to_the_offset(
    tmp_path: Path, repo: Path, hub: FakeHub
) -> None:
    data = (repo / LAST_WEIGHTS).read_bytes()
    partial = 777_777
    (tmp_path / f"{LAST_WEIGHTS}.partial").write_bytes(data[:partial])
    hub.ignore_range_once(LAST_WEIGHTS)
    written: list[int] = []
    remote = remote_file(repo, LAST_WEIGHTS)
    used = await fetch_file([HubSource(hub.url)], MODEL, remote, tmp_path, written.append)
    assert used == "hub"
    assert [(r.offset, r.status) for r in hub.requests] == [(partial, 200)]
    assert hub.bytes_sent[LAST_WEIGHTS] == len(data)
    assert sum(written) == len(data) - partial
    assert (tmp_path / LAST_WEIGHTS).read_bytes() == data
