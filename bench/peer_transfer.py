"""Peer-to-peer model file transfer on loopback vs a plain copy of the same bytes.

Writes a model folder (`config.json` plus `--files` random `*.safetensors` files
of `--mib` MiB each, with valid safetensors headers) into a temp models
directory, starts a real `exo` node serving it (`--model none --no-worker
--no-discovery --no-api`, a free gRPC port, a random cluster secret), then
times, alternating and in `--rounds` rounds (the order swapped every round):

1. **copy**: `shutil.copyfile` of the files into a fresh folder; and the same
   followed by an fsync of each file ("copy + fsync"), since the downloader
   fsyncs what it wrote;
2. **peer**: `download_files([PeerSource(...)], ...)` into a fresh folder, as a
   downloading node does it: `ListModelFiles`, `FetchFile` streams written to
   `.partial` files, sha256 of each, fsync, rename.

Both read the source files from the page cache: every measurement comes after a
warm-up read of them, and written files are synced (untimed) and deleted before
the next one. The serving node hashes each file once, on its first listing, and
caches the hash: that first listing is timed on its own before the rounds, so
the rounds measure the steady state.

To show where the peer transfer's time goes, each round also times the parts on
their own: the `FetchFile` streams alone (bytes received and dropped), sha256 of
the files alone (in this process, from the page cache), and a (cached) listing.
It prints the CPU seconds of the node and of this process during the peer
transfers, and the cores other processes kept busy.

    uv run python bench/peer_transfer.py                 # 2 x 256 MiB, 3 rounds
    uv run python bench/peer_transfer.py --mib 1024 --files 1
    uv run python bench/peer_transfer.py --data-root /dev/shm   # no disk at all
"""

import argparse
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import psutil
from exo_node import CpuMeter, free_port, launch_exo, median, stop_exo
from loguru import logger

from exo.cluster.model_files import PeerSource
from exo.cluster.tls import NodeCertificate
from exo.shared.allocator import keep_large_buffers_in_the_heap
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.ids import ModelId, NodeId
from exo.worker.downloads.transfer import download_files

MODEL_ID = ModelId("bench/transfer")
START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 15.0
MIB = 1 << 20
_BLOCK = 8 * MIB


# -- the model folder --------------------------------------------------------------


def write_model(models_dir: Path, files: int, mib: int) -> list[Path]:
    """A model folder the node can serve (and describe): a small llama-like
    `config.json` and `files` safetensors files of `mib` MiB of random bytes."""
    folder = models_dir / MODEL_ID.replace("/", "--")
    folder.mkdir(parents=True)
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": files,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    paths = [folder / "config.json"]
    for i in range(files):
        path = folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        _write_safetensors(path, f"model.layers.{i}.mlp.weight", mib * MIB)
        paths.append(path)
    return paths


def _write_safetensors(path: Path, tensor: str, size: int) -> None:
    """One U8 tensor so that the whole file is `size` bytes."""

    def header_for(body: int) -> bytes:
        meta = {tensor: {"dtype": "U8", "shape": [body], "data_offsets": [0, body]}}
        return json.dumps(meta).encode().ljust(256)  # fixed length: body = size - 264

    header = header_for(size - 8 - 256)
    body = size - 8 - len(header)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header)
        left = body
        while left > 0:
            n = min(_BLOCK, left)
            fh.write(os.urandom(n))
            left -= n


def read_all(paths: list[Path]) -> None:
    """Read the files once (the warm-up: both paths then read from the page cache)."""
    for path in paths:
        with path.open("rb", buffering=0) as fh:
            while fh.read(_BLOCK):
                pass


def sha256_all(paths: list[Path]) -> None:
    """What the downloader's verification does, on its own (1 MiB blocks)."""
    for path in paths:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while block := fh.read(MIB):
                digest.update(block)


# -- the node ------------------------------------------------------------------------


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    grpc_address: str
    secret: str
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_listening(self, timeout: float = START_TIMEOUT_SECONDS) -> float:
        """Until the gRPC port accepts connections; returns the seconds it took."""
        host, port = self.grpc_address.rsplit(":", 1)
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"exo exited with code {self.process.returncode}:\n{self.log_tail()}"
                )
            with suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
                return time.monotonic() - start
            time.sleep(0.2)
        raise TimeoutError(f"exo's gRPC port not open after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> int | None:
        return stop_exo(self.process, timeout)


@contextmanager
def serving_node(root: Path, models_dir: Path) -> Iterator[Node]:
    """A lone `exo` node on loopback that serves `models_dir` and runs nothing else."""
    grpc_port = free_port()
    secret = f"bench-{uuid.uuid4().hex}"
    log_path = root / "exo.log"
    command = [
        "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port),
        "--cluster-secret", secret,
        "--model", "none",
        "--no-worker",
        "--no-discovery",
        "--no-api",
        "--data-dir", str(root / "data"),
        "--models-dir", str(models_dir),
        "--log-level", "INFO",
    ]  # fmt: skip
    process = launch_exo(command, log_path)
    node = Node(process, f"127.0.0.1:{grpc_port}", secret, log_path)
    try:
        seconds = node.wait_listening()
        print(f"exo serving {models_dir.name}/ on {node.grpc_address} after {seconds:.1f}s")
        yield node
    finally:
        code = node.stop()
        print(f"exo stopped (exit code {code})")


# -- measurements ------------------------------------------------------------------------


@dataclass
class Rounds:
    """Seconds per measurement, one entry per round."""

    copy: list[float] = field(default_factory=list)
    copy_fsync: list[float] = field(default_factory=list)
    peer: list[float] = field(default_factory=list)
    stream: list[float] = field(default_factory=list)
    sha256: list[float] = field(default_factory=list)
    listing: list[float] = field(default_factory=list)
    node_cpu: list[float] = field(default_factory=list)  # CPU s during the peer transfer
    own_cpu: list[float] = field(default_factory=list)
    foreign: list[float] = field(default_factory=list)  # other processes' cores, same window


def fresh_dir(root: Path, name: str) -> Path:
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def clear(path: Path) -> None:
    """Write back (untimed) and delete what a measurement wrote."""
    os.sync()
    shutil.rmtree(path, ignore_errors=True)


def time_copy(sources: list[Path], dest: Path) -> tuple[float, float]:
    """Seconds of `shutil.copyfile` of every file, and of that plus an fsync of each."""
    start = time.perf_counter()
    copies = [dest / path.name for path in sources]
    for path, copy in zip(sources, copies, strict=True):
        shutil.copyfile(path, copy)
    copied = time.perf_counter() - start
    for copy in copies:
        fd = os.open(copy, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return copied, time.perf_counter() - start


def time_peer(source: PeerSource, dest: Path) -> float:
    def ignore(progress: DownloadProgress) -> None:
        pass

    async def run() -> None:
        await download_files([source], MODEL_ID, None, dest, ignore)

    start = time.perf_counter()
    anyio.run(run)
    return time.perf_counter() - start


def time_listing(source: PeerSource) -> tuple[float, int]:
    """Seconds of one `ListModelFiles`, and the bytes it lists."""

    async def run() -> int:
        return sum(f.size for f in await source.list_files(MODEL_ID))

    start = time.perf_counter()
    size = anyio.run(run)
    return time.perf_counter() - start, size


def time_stream(source: PeerSource, names: list[str]) -> tuple[float, int]:
    """Seconds to receive every file's `FetchFile` stream, dropping the bytes."""

    async def run() -> int:
        received = 0
        for name in names:
            async for chunk in source.read(MODEL_ID, name, 0):
                received += len(chunk)
        return received

    start = time.perf_counter()
    received = anyio.run(run)
    return time.perf_counter() - start, received


def measure(
    node: Node, sources: list[Path], work: Path, rounds: int, log: Callable[[str], None]
) -> Rounds:
    source = PeerSource(
        NodeId("bench-server"), node.grpc_address, node.secret, NodeCertificate.create()
    )
    names = [path.name for path in sources]
    total = sum(path.stat().st_size for path in sources)
    meter = CpuMeter({"node": node.process.pid, "bench": os.getpid()})
    result = Rounds()

    def copy() -> None:
        read_all(sources)
        dest = fresh_dir(work, "copy")
        copied, synced = time_copy(sources, dest)
        clear(dest)
        result.copy.append(copied)
        result.copy_fsync.append(synced)
        log(f"  copy          {mb_s(total, copied):8.0f} MB/s  (+ fsync {mb_s(total, synced):.0f})")

    def peer() -> None:
        read_all(sources)
        dest = fresh_dir(work, "peer")
        meter.start()
        seconds = time_peer(source, dest)
        usage = meter.stop()
        got = sum(p.stat().st_size for p in dest.iterdir())
        if got != total:
            raise RuntimeError(f"the peer transfer wrote {got} bytes, expected {total}")
        clear(dest)
        result.peer.append(seconds)
        result.node_cpu.append(usage.per_process["node"])
        result.own_cpu.append(usage.per_process["bench"])
        result.foreign.append(usage.foreign_cores)
        log(
            f"  peer          {mb_s(total, seconds):8.0f} MB/s  (CPU s: node "
            f"{usage.per_process['node']:.2f}, bench {usage.per_process['bench']:.2f}; "
            f"other processes {usage.foreign_cores:.2f} cores)"
        )

    def parts() -> None:
        read_all(sources)
        seconds, received = time_stream(source, names)
        if received != total:
            raise RuntimeError(f"FetchFile streams gave {received} bytes, expected {total}")
        result.stream.append(seconds)
        start = time.perf_counter()
        sha256_all(sources)
        result.sha256.append(time.perf_counter() - start)
        result.listing.append(time_listing(source)[0])
        log(
            f"  stream only   {mb_s(total, seconds):8.0f} MB/s; sha256 only "
            f"{mb_s(total, result.sha256[-1]):.0f} MB/s; listing {1000 * result.listing[-1]:.1f} ms"
        )

    for i in range(rounds):
        log(f"round {i + 1}/{rounds}")
        order = [copy, peer] if i % 2 == 0 else [peer, copy]
        for step in [*order, parts]:
            step()
    return result


def mb_s(size: int, seconds: float) -> float:
    return size / seconds / 1e6 if seconds > 0 else float("nan")


def report(result: Rounds, total: int, first_listing: float, command: str) -> None:
    copy, copy_fsync, peer = median(result.copy), median(result.copy_fsync), median(result.peer)
    stream, sha, listing = median(result.stream), median(result.sha256), median(result.listing)
    rows = [
        ("copy (shutil.copyfile)", result.copy),
        ("copy + fsync", result.copy_fsync),
        ("peer (download_files)", result.peer),
        ("  FetchFile streams only", result.stream),
        ("  sha256 only", result.sha256),
    ]
    print()
    print(f"{total / MIB:.0f} MiB in {len(result.copy)} rounds; MB/s per round, then the median")
    print(
        f"| {'':26} | "
        + " | ".join(f"round {i + 1}" for i in range(len(result.copy)))
        + " | median |"
    )
    for label, times in rows:
        cells = " | ".join(f"{mb_s(total, t):7.0f}" for t in times)
        print(f"| {label:26} | {cells} | {mb_s(total, median(times)):6.0f} |")
    print()
    print(f"peer / copy           = {copy / peer:.3f}")
    print(f"peer / (copy + fsync) = {copy_fsync / peer:.3f}")
    print(
        f"peer transfer, median {peer:.2f} s: FetchFile streams {stream:.2f} s, sha256 "
        f"{sha:.2f} s, listing {1000 * listing:.1f} ms, the rest (writing, fsync, rename) "
        f"{max(0.0, peer - stream - sha - listing):.2f} s"
    )
    gib = total / (1 << 30)
    print(
        f"CPU per GiB during the peer transfer (median): node {median(result.node_cpu) / gib:.2f} s, "
        f"this process {median(result.own_cpu) / gib:.2f} s; other processes "
        f"{median(result.foreign):.2f} cores"
    )
    print(
        f"first listing (the node hashes every file once): {first_listing:.2f} s "
        f"= {mb_s(total, first_listing):.0f} MB/s; cached: {1000 * listing:.1f} ms"
    )
    print(f"command: {command}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2, help="safetensors files (default 2)")
    parser.add_argument("--mib", type=int, default=256, help="MiB per file (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="where the temp folder goes (default: the system's temp dir)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp folder and node log")
    args = parser.parse_args()
    logger.remove()  # the downloader logs every file at INFO
    logger.add(sys.stderr, level="WARNING")
    keep_large_buffers_in_the_heap()  # as the downloading node process does
    if args.files < 1 or args.mib < 1 or args.rounds < 1:
        parser.error("--files, --mib and --rounds must be at least 1")

    root = Path(tempfile.mkdtemp(prefix="exo-bench-transfer-", dir=args.data_root))
    try:
        models_dir = root / "models"
        start = time.perf_counter()
        sources = write_model(models_dir, args.files, args.mib)
        os.sync()
        total = sum(path.stat().st_size for path in sources)
        print(
            f"wrote {len(sources)} files, {total / MIB:.0f} MiB, in "
            f"{time.perf_counter() - start:.1f}s; {psutil.cpu_count()} cores"
        )
        with serving_node(root, models_dir) as node:
            source = PeerSource(
                NodeId("bench-server"), node.grpc_address, node.secret, NodeCertificate.create()
            )
            read_all(sources)
            first, listed = time_listing(source)
            if listed != total:
                raise RuntimeError(f"the node lists {listed} bytes, expected {total}")
            print(f"first listing (hashes every file): {first:.2f} s")
            result = measure(node, sources, root / "work", args.rounds, print)
        command = " ".join(["uv run python bench/peer_transfer.py", *sys.argv[1:]])
        report(result, total, first, command)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
