"""Event throughput and latency of a three-node exo cluster on loopback.

Starts three `exo` nodes without a model (`--no-worker`, static `--peers`),
waits until they agree on a master, then publishes events to the master over
gRPC (`PublishEvents`, as a node's outbox does) and watches every node's
`GET /events` SSE stream. An event appears on a node's stream only after that
node has appended it to its fsynced event log and applied it to its state, so
"seen on a node's stream" is "applied on that node".

1. Throughput: `--events` events in batches of `--batch`, from `--publishers`
   concurrent publishers; the time from the first publish until all three
   streams delivered every one of them gives events/s.
2. Latency: `--latency-events` single events, one at a time (the next is sent
   once the previous one is on all three streams, after `--gap-ms`); for each,
   the time from send until it shows on each node's stream; p50/p99 to
   "applied on all 3".

The events are `NodeTelemetryReported` for the master, carrying the telemetry
the master already reported, so the cluster state does not change; their
`origin` is a tag of this run (not a node id), which is how the stream readers
recognise them among the nodes' own events. Each publisher uses one origin,
like a node's outbox: the master indexes a batch per origin, with one fsync
per origin, so an origin per event would measure one fsync per event instead.

Nodes, publishers and stream readers share the machine: on a small one, the
benchmark's own CPU (printed) is part of what limits the figures.

    uv run python bench/event_throughput.py
    uv run python bench/event_throughput.py --events 5000 --batch 200 --publishers 4
    uv run python bench/event_throughput.py --data-root /dev/shm   # fsync nearly free
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import grpc
import httpx
import psutil
from exo_node import free_port, launch_exo

from exo.cluster.auth import connect
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.cluster.tls import NodeCertificate
from exo.shared.types.events import NodeTelemetryReported, event_adapter
from exo.shared.types.ids import NodeId
from exo.shared.types.state import NodeTelemetry

NODES = 3
START_TIMEOUT_SECONDS = 60.0
AGREE_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 15.0
RPC_TIMEOUT_SECONDS = 30.0
HTTP_TIMEOUT_SECONDS = 5.0
SECRET = "exo-bench-event-throughput"

T = TypeVar("T")


# -- nodes ----------------------------------------------------------------------------


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    api_url: str
    grpc_address: str
    log_path: Path
    data_dir: Path
    node_id: str = ""

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.api_url}{path}", timeout=HTTP_TIMEOUT_SECONDS)
        response.raise_for_status()
        return response.json()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_nodes(root: Path, secret: str) -> list[Node]:
    grpc_ports = [free_port() for _ in range(NODES)]
    peers = ",".join(f"127.0.0.1:{p}" for p in grpc_ports)
    nodes: list[Node] = []
    for i, grpc_port in enumerate(grpc_ports):
        api_port = free_port()
        data_dir = root / f"node{i}"
        log_path = root / f"node{i}.log"
        command = [
            "--host", "127.0.0.1",
            "--api-port", str(api_port),
            "--grpc-port", str(grpc_port),
            "--no-discovery",
            "--no-worker",
            "--data-dir", str(data_dir),
            "--peers", peers,
            "--cluster-secret", secret,
            "--log-level", "INFO",
        ]  # fmt: skip
        process = launch_exo(command, log_path)
        nodes.append(
            Node(
                process,
                f"http://127.0.0.1:{api_port}",
                f"127.0.0.1:{grpc_port}",
                log_path,
                data_dir,
            )
        )
    return nodes


def stop_nodes(nodes: list[Node], timeout: float = STOP_TIMEOUT_SECONDS) -> list[int | None]:
    """SIGINT to every node, a bounded wait, then SIGKILL for any still running."""
    for node in nodes:
        if node.process.poll() is None:
            node.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for node in nodes:
        try:
            codes.append(node.process.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            print(f"node on {node.api_url} did not stop within {timeout:.0f}s; killing it")
            with suppress(ProcessLookupError):
                node.process.kill()
            with suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=5)
            codes.append(None)
    return codes


def wait_until(check: Callable[[], T | None], timeout: float, what: str, nodes: list[Node]) -> T:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        for node in nodes:
            if node.process.poll() is not None:
                raise RuntimeError(
                    f"node on {node.api_url} exited with {node.process.returncode}:\n"
                    + node.log_tail()
                )
        try:
            result = check()
            if result is not None:
                return result
        except httpx.HTTPError as error:  # the API is not up yet
            last = error
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s (last error: {last!r})")


def wait_for_agreement(nodes: list[Node]) -> str:
    """Wait until every node's API answers and all name the same master, which every
    node's state knows with a gRPC address and telemetry; returns the master's node id."""
    for node in nodes:
        node.node_id = wait_until(
            lambda n=node: n.get("/node_id"), START_TIMEOUT_SECONDS, "API up", nodes
        )

    def agreed() -> str | None:
        masters = {node.get("/cluster")["master_id"] for node in nodes}
        if len(masters) != 1:
            return None
        master = masters.pop()
        if not master:
            return None
        for node in nodes:
            known = node.get("/state")["nodes"]
            if not all(n.node_id in known for n in nodes):
                return None
            master_info = known.get(master) or {}
            if not master_info.get("grpc_address") or not master_info.get("telemetry"):
                return None
        return master

    return wait_until(agreed, AGREE_TIMEOUT_SECONDS, "three nodes agreeing on a master", nodes)


def fsync_ms(directory: Path, count: int = 50) -> float:
    """Median time of a small write + fsync in `directory` (what each log append pays)."""
    path = directory / "fsync-probe"
    times: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for _ in range(count):
            os.write(fd, b"x" * 300)
            start = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return 1000 * percentile(times, 50)


# -- measurement ----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Arrivals:
    """When the events of this run showed on each node's /events stream.

    Events are told apart by their `origin` only: the master indexes a batch
    with one origin as one append (one fsync), as a node's outbox sends it, so
    every batch carries a single origin, and each origin's events arrive in the
    order they were sent.
    """

    nodes: int
    # Per node: origin -> perf_counter() seconds of each arrival, in order.
    seen: list[dict[str, list[float]]] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.seen = [{} for _ in range(self.nodes)]

    def record(self, node: int, origin: str, at: float) -> None:
        self.seen[node].setdefault(origin, []).append(at)
        self.changed.set()
        self.changed = anyio.Event()

    def times(self, node: int, origin: str) -> list[float]:
        return self.seen[node].get(origin, [])

    async def wait_for(self, counts: dict[str, int], timeout: float) -> None:
        """Until every stream delivered `counts[origin]` events of each origin;
        TimeoutError past `timeout`."""
        with anyio.fail_after(timeout):
            while True:
                changed = self.changed
                if all(
                    len(self.times(node, origin)) >= count
                    for node in range(self.nodes)
                    for origin, count in counts.items()
                ):
                    return
                await changed.wait()


async def read_events(
    client: httpx.AsyncClient,
    api_url: str,
    from_idx: int,
    node: int,
    tag: str,
    arrivals: Arrivals,
    connected: anyio.Event,
) -> None:
    """Follow one node's /events stream and time the events whose origin carries `tag`."""
    async with client.stream(
        "GET",
        f"{api_url}/events",
        params={"from_idx": from_idx},
        timeout=httpx.Timeout(HTTP_TIMEOUT_SECONDS, read=None),  # cancelled by the caller
    ) as response:
        response.raise_for_status()
        connected.set()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or tag not in line:
                continue
            at = time.perf_counter()
            indexed = json.loads(line[len("data: ") :])
            arrivals.record(node, indexed["origin"], at)


def envelope(event_payload: bytes, origin: str) -> pb.LocalEventEnvelope:
    return pb.LocalEventEnvelope(id=uuid.uuid4().hex, origin=origin, payload=event_payload)


async def publish(stub: pb_grpc.ClusterStub, batch: list[pb.LocalEventEnvelope]) -> None:
    ack: pb.Ack = await stub.PublishEvents(pb.EventBatch(events=batch), timeout=RPC_TIMEOUT_SECONDS)
    if not ack.ok:
        raise RuntimeError(f"the master refused the batch: {ack.message}")


@dataclass
class ThroughputResult:
    events: int
    batch: int
    publishers: int
    acked_s: float
    applied_s: list[float]  # per node, from the first publish to its last event
    cpu_s: list[float]  # per node, CPU seconds used during the phase
    bench_cpu_s: float  # CPU seconds of this benchmark process during the phase
    other_cores: float  # average cores busy with other processes of the machine


@dataclass
class LatencyResult:
    ack_s: list[float]  # per event
    per_node_s: list[list[float]]  # per node, per event
    all_s: list[float]  # per event: until it was on all three streams
    rpc_s: list[float]  # per call: a read-only RPC (ListModelFiles) to the master, the gRPC floor


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (all processes, all cores)."""
    times = psutil.cpu_times()
    return float(sum(times)) - float(times.idle) - float(getattr(times, "iowait", 0.0))


def cpu_seconds(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process and its children so far."""
    totals: list[float] = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            times = process.cpu_times()
            totals.append(
                float(times.user + times.system + times.children_user + times.children_system)
            )
        except psutil.Error:
            totals.append(math.nan)
    return totals


async def measure(
    args: argparse.Namespace, nodes: list[Node], master_id: str
) -> tuple[ThroughputResult, LatencyResult]:
    master_state = nodes[0].get("/state")["nodes"][master_id]
    master_address: str = master_state["grpc_address"]
    # The master's own last report: re-reporting it leaves the state as it was.
    telemetry = NodeTelemetry.model_validate(master_state["telemetry"])
    payload = event_adapter.dump_json(
        NodeTelemetryReported(node_id=NodeId(master_id), telemetry=telemetry)
    )
    tag = f"bench-{uuid.uuid4().hex[:8]}"
    arrivals = Arrivals(len(nodes))
    pids = [node.process.pid for node in nodes]

    # The master's own key (its data dir is here): a session speaks only for its key's node.
    master = next(node for node in nodes if node.node_id == master_id)
    identity = NodeCertificate.load_or_create(master.data_dir / "tls")
    session = await connect(master_address, args.secret, identity)
    stub = session.stub
    results: tuple[ThroughputResult, LatencyResult] | None = None
    try:
        async with httpx.AsyncClient() as client, anyio.create_task_group() as readers:
            for i, node in enumerate(nodes):
                state = await client.get(f"{node.api_url}/state", timeout=HTTP_TIMEOUT_SECONDS)
                from_idx = int(state.raise_for_status().json()["last_idx"]) + 1
                connected = anyio.Event()
                readers.start_soon(
                    read_events, client, node.api_url, from_idx, i, tag, arrivals, connected
                )
                with anyio.fail_after(HTTP_TIMEOUT_SECONDS):
                    await connected.wait()

            # Warm up the channel and the streams (not measured).
            await publish(stub, [envelope(payload, f"{tag}-w") for _ in range(10)])
            await arrivals.wait_for({f"{tag}-w": 10}, args.timeout)

            throughput = await measure_throughput(args, stub, payload, tag, arrivals, pids)
            latency = await measure_latency(args, stub, payload, tag, arrivals)
            results = (throughput, latency)
            readers.cancel_scope.cancel()
    finally:
        await session.close()
    if results is None:
        raise RuntimeError("the event streams ended before the measurement did")
    return results


async def measure_throughput(
    args: argparse.Namespace,
    stub: pb_grpc.ClusterStub,
    payload: bytes,
    tag: str,
    arrivals: Arrivals,
    pids: list[int],
) -> ThroughputResult:
    batch_count = math.ceil(args.events / args.batch)
    publishers = max(1, min(args.publishers, batch_count))
    # Each publisher stands for a node: one origin, batches sent one after another.
    plans: list[list[list[pb.LocalEventEnvelope]]] = [[] for _ in range(publishers)]
    counts: dict[str, int] = {}
    for b in range(batch_count):
        origin = f"{tag}-t{b % publishers}"
        size = min(args.batch, args.events - b * args.batch)
        plans[b % publishers].append([envelope(payload, origin) for _ in range(size)])
        counts[origin] = counts.get(origin, 0) + size

    async def publisher(batches: list[list[pb.LocalEventEnvelope]]) -> None:
        for batch in batches:
            await publish(stub, batch)

    me = psutil.Process()
    cpu_before = cpu_seconds(pids)
    bench_before = sum(me.cpu_times()[:2])
    busy_before = busy_cpu_seconds()
    start = time.perf_counter()
    with anyio.fail_after(args.timeout):
        async with anyio.create_task_group() as group:
            for batches in plans:
                group.start_soon(publisher, batches)
    acked = time.perf_counter() - start
    await arrivals.wait_for(counts, args.timeout)
    cpu_after = cpu_seconds(pids)
    bench_cpu = sum(me.cpu_times()[:2]) - bench_before
    busy = busy_cpu_seconds() - busy_before
    wall = time.perf_counter() - start
    cpu = [a - b for a, b in zip(cpu_after, cpu_before, strict=True)]
    applied = [
        max(arrivals.times(node, origin)[-1] for origin in counts) - start
        for node in range(arrivals.nodes)
    ]
    return ThroughputResult(
        events=args.events,
        batch=args.batch,
        publishers=publishers,
        acked_s=acked,
        applied_s=applied,
        cpu_s=cpu,
        bench_cpu_s=bench_cpu,
        other_cores=max(0.0, busy - sum(cpu) - bench_cpu) / wall,
    )


async def measure_latency(
    args: argparse.Namespace,
    stub: pb_grpc.ClusterStub,
    payload: bytes,
    tag: str,
    arrivals: Arrivals,
) -> LatencyResult:
    result = LatencyResult(ack_s=[], per_node_s=[[] for _ in arrivals.seen], all_s=[], rpc_s=[])
    # The floor under an ack: a gRPC round trip to the master that writes nothing.
    for _ in range(args.latency_events):
        sent = time.perf_counter()
        with suppress(grpc.aio.AioRpcError):  # NOT_FOUND: no such model here
            await stub.ListModelFiles(
                pb.ListModelFilesRequest(model_id="bench/none"), timeout=RPC_TIMEOUT_SECONDS
            )
        result.rpc_s.append(time.perf_counter() - sent)
        await anyio.sleep(args.gap_ms / 1000)
    origin = f"{tag}-l"
    for i in range(args.latency_events):
        sent = time.perf_counter()
        await publish(stub, [envelope(payload, origin)])
        result.ack_s.append(time.perf_counter() - sent)
        # One at a time: the i-th arrival of this origin on a stream is this event.
        await arrivals.wait_for({origin: i + 1}, args.timeout)
        at = [arrivals.times(node, origin)[i] - sent for node in range(arrivals.nodes)]
        for node, seconds in enumerate(at):
            result.per_node_s[node].append(seconds)
        result.all_s.append(max(at))
        await anyio.sleep(args.gap_ms / 1000)
    return result


# -- report ---------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def report(
    nodes: list[Node],
    master_id: str,
    throughput: ThroughputResult,
    latency: LatencyResult,
    fsync: float,
) -> None:
    roles = ["master" if n.node_id == master_id else "follower" for n in nodes]
    labels = [f"node{i} ({role})" for i, role in enumerate(roles)]
    rows: list[tuple[str, str]] = []
    t = throughput
    rows.append(
        (
            "throughput",
            f"{t.events} events, batches of {t.batch}, {t.publishers} publisher(s)",
        )
    )
    rows.append(
        ("  acked by the master", f"{t.events / t.acked_s:,.0f} events/s ({t.acked_s:.2f} s)")
    )
    for label, seconds, cpu in zip(labels, t.applied_s, t.cpu_s, strict=True):
        rows.append(
            (
                f"  applied on {label}",
                f"{t.events / seconds:,.0f} events/s ({seconds:.2f} s; "
                f"CPU {cpu:.2f} s = {1e6 * cpu / t.events:.0f} us/event)",
            )
        )
    total = max(t.applied_s)
    rows.append(("  applied on all 3", f"{t.events / total:,.0f} events/s ({total:.2f} s)"))
    rows.append(
        (
            "  CPU of this benchmark process",
            f"{t.bench_cpu_s:.2f} s; other processes of the machine: {t.other_cores:.2f} cores",
        )
    )
    n = len(latency.all_s)
    rows.append(("latency", f"{n} single events, one at a time"))
    rows.append(
        (
            "  read-only RPC to the master",
            f"p50 {ms(percentile(latency.rpc_s, 50))}, p99 {ms(percentile(latency.rpc_s, 99))}",
        )
    )
    rows.append(
        (
            "  acked by the master",
            f"p50 {ms(percentile(latency.ack_s, 50))}, p99 {ms(percentile(latency.ack_s, 99))}",
        )
    )
    for label, values in zip(labels, latency.per_node_s, strict=True):
        rows.append(
            (
                f"  applied on {label}",
                f"p50 {ms(percentile(values, 50))}, p99 {ms(percentile(values, 99))}",
            )
        )
    rows.append(
        (
            "  applied on all 3",
            f"p50 {ms(percentile(latency.all_s, 50))}, p99 {ms(percentile(latency.all_s, 99))}, "
            f"max {ms(max(latency.all_s))}",
        )
    )
    rows.append(("fsync of a small write (data dir)", f"median {fsync:.2f} ms"))
    width = max(len(r[0]) for r in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Start three exo nodes on loopback (no model) and measure event throughput "
            "(publish to applied on all 3 nodes) and single-event latency."
        )
    )
    parser.add_argument(
        "--events", type=int, default=2000, help="events in the throughput phase (default 2000)"
    )
    parser.add_argument(
        "--batch", type=int, default=50, help="events per PublishEvents call (default 50)"
    )
    parser.add_argument(
        "--publishers", type=int, default=2, help="concurrent publishers (default 2)"
    )
    parser.add_argument(
        "--latency-events",
        type=int,
        default=200,
        help="single events in the latency phase (default 200)",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=10.0,
        help="pause between latency events, in ms (default 10)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="bound of each wait for events, in s (default 120)",
    )
    parser.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help=(
            "folder for the nodes' temporary data dirs (default: the system temp dir); "
            "e.g. /dev/shm, a tmpfs where fsync is nearly free, to see what fsync costs"
        ),
    )
    parser.add_argument("--secret", default=SECRET, help="cluster secret of the nodes")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the nodes' data dirs and logs (printed at the end)",
    )
    args = parser.parse_args()
    for name in ("events", "batch", "publishers", "latency_events"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="exo-bench-events-", dir=args.data_root))
    nodes: list[Node] = []
    try:
        fsync = fsync_ms(root)
        nodes = start_nodes(root, args.secret)
        started = time.monotonic()
        master_id = wait_for_agreement(nodes)
        print(f"3 nodes agree on master {master_id} after {time.monotonic() - started:.1f}s")
        throughput, latency = anyio.run(measure, args, nodes, master_id, backend="asyncio")
        report(nodes, master_id, throughput, latency, fsync)
    finally:
        codes = stop_nodes(nodes)
        print(f"\nnodes stopped (exit codes {codes})")
        if args.keep:
            print(f"data and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except grpc.aio.AioRpcError as error:
        sys.exit(f"gRPC error: {error.code()}: {error.details()}")
