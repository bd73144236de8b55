"""Soak: three real nodes serving two tiny models (one split over 2 nodes, one
whole on 1) to 8 agent-like clients for `--minutes`, with a fault every
`--fault-every-seconds`.

The nodes are the chaos tests' (`tests/e2e/lan_cluster.py`: each in its own
network namespace when root, on loopback ports otherwise); as root each node's
data dir is a small tmpfs, so that one can be filled to its floor.

Clients (the official `openai` client, one thread each): sessions of 2-6 turns
sharing a system prompt, on either model, through any node that is up; tools
offered in some turns (a tool call is answered with a tool result in the next
turn), streamed and not; some streams closed after two chunks (a client that
leaves), some requests given a client timeout too short to finish. A refusal
that says when to come back (429/503 with Retry-After) or a node that refuses
the connection makes the client send the turn again after a pause (another node).

Faults, in turn: SIGKILL a runner; SIGKILL a worker node (not the master); SIGKILL
the master; SIGSTOP a node for `--stop-seconds`; fill a node's data disk to its
floor (`--min-free-disk-bytes`) for `--fill-seconds`. A killed node is started
again (same data dir) `--restart-after-seconds` later. A model left with no
instance for `--unserved-seconds` is placed again by the soak (an operator),
and counted.

Reported: requests answered, cancelled by their client, failed by reason;
retries (`exo_retried_requests_total` summed over nodes, scraped every few
seconds, resets counted); the longest time any client waited (to an answer,
to a first token); per process RSS, open files and threads at its first
sample, at its own `--steady-minute` of life (a runner: once loaded, as a
standby runner may take an instance over later) and at the end; event log and snapshot bytes; prefix-cache
disk bytes (and its namespace folders); events lost (every event a surviving
node held before a fault, at the same index with the same content at the end).

Targets: 0 requests failed without a reason the client can act on (each
failure a stream that had tokens when its node died; a request whose own
entry node was killed or stopped under it is counted apart), 0 lost events, no
process's RSS growing over 10 % from `--steady-minute` to the end, the event
log within its compaction bound and each disk tier within its budget.

    uv run python bench/soak.py                      # 30 minutes, a fault a minute
    uv run python bench/soak.py --minutes 8
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' harness

import httpx
import openai
import psutil

from exo.models.builtin import DEFAULT_MODEL_ID, ensure_default_model
from exo.models.store import model_dir
from exo.shared.event_store import COMPACT_EVERY, RETAIN_EVENTS
from exo.shared.types.ids import ModelId
from exo.worker.runner.standby import is_runner_process
from tests.e2e.lan_cluster import LanCluster, chat, runner_pids
from tests.e2e.node_process import NodeProcess, await_instance
from tests.e2e.test_serving_limits import samples
from tests.integration.cluster_process import agreed, events, wait_until
from tests.model_factory import make_tiny_llama

SPLIT = ModelId("test-org/tiny-soak-split")
WHOLE = ModelId("test-org/tiny-soak-whole")
MODELS = (SPLIT, WHOLE)
CLIENTS = 8
MAX_TOKENS = 24
FAULTS = ("kill a runner", "kill a worker node", "kill the master", "SIGSTOP a node", "fill a disk")

SYSTEM = (
    "You are a coding agent working in a repository. Use the tools to read and "
    "edit files, run the tests, and answer briefly. " * 4
)
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for name, description in (
        ("read_file", "Read a file of the repository."),
        ("run_tests", "Run the tests under a path."),
    )
]
ASKS = (
    "Read src/app.py and tell me what it does.",
    "Run the tests under tests/unit.",
    "Fix the failing import in the parser.",
    "Summarize the last change in one line.",
    "Which function handles retries?",
    "Rename the helper to something clearer.",
)


# ---------------------------------------------------------------- records


@dataclass
class Request:
    client: int
    model: str
    entry: int
    stream: bool
    tools: bool
    started: float
    first_token: float | None = None
    ended: float | None = None
    chunks: int = 0
    finish_reason: str | None = None
    cancelled: str | None = None  # by its client: "closed early", "client timeout"
    failure: str | None = None  # why it failed (a class, below)
    detail: str = ""

    @property
    def answered(self) -> bool:
        return self.finish_reason is not None and not self.failure and not self.cancelled


@dataclass
class Fault:
    kind: str
    at: float
    victim: int | None
    until: float | None = None  # the node is back (restarted, resumed, disk freed)
    note: str = ""


@dataclass
class ProcessSample:
    at: float
    rss: int
    fds: int
    threads: int


@dataclass
class Soak:
    cluster: LanCluster
    args: argparse.Namespace
    started: float
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    down: set[int] = field(default_factory=set)  # killed or stopped now
    requests: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    client_retries: Counter[str] = field(default_factory=Counter)
    placed_by_soak: Counter[str] = field(default_factory=Counter)
    # (node, model, where) -> the counter's last value, and the sum of increases
    retried_last: dict[tuple[int, str, str], float] = field(default_factory=dict)
    retried: defaultdict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    # pid -> (label, samples)
    processes: dict[int, tuple[str, list[ProcessSample]]] = field(default_factory=dict)
    runners_seen: set[int] = field(default_factory=set)
    # idx -> event, as held by a node that was not the victim, before each fault
    held: dict[int, dict[str, Any]] = field(default_factory=dict)
    disk_fill_health: list[str] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started

    def up(self) -> list[int]:
        with self.lock:
            return [
                i for i, n in enumerate(self.cluster.nodes) if n is not None and i not in self.down
            ]

    def victim_of_at(self, t: float) -> set[int]:
        """Nodes a fault took down around `t` (killed or stopped then)."""
        found = set()
        for fault in self.faults:
            if fault.victim is None or fault.kind in ("fill a disk", "kill a runner"):
                continue
            if fault.at - 1 <= t <= (fault.until or t) + 2:
                found.add(fault.victim)
        return found


# ---------------------------------------------------------------- clients


def agent(soak: Soak, k: int) -> None:
    rng = random.Random(k)
    while not soak.stopping.is_set():
        model = rng.choice(MODELS)
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Session {k}-{rng.randrange(10**6)}. {rng.choice(ASKS)}"},
        ]
        for _turn in range(rng.randint(2, 6)):
            if soak.stopping.is_set():
                return
            reply = turn(soak, k, rng, model, messages)
            if reply is None:  # failed or cancelled: the session starts over
                break
            messages.append(reply)
            for call in reply.get("tool_calls") or ():
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": "ok: 3 lines"}
                )
            if not reply.get("tool_calls"):
                messages.append({"role": "user", "content": rng.choice(ASKS)})
            time.sleep(rng.uniform(0.2, 2.0))  # the agent works between turns


def turn(
    soak: Soak, k: int, rng: random.Random, model: str, messages: list[Any]
) -> dict[str, Any] | None:
    """One turn: its request, sent again (up to 5 times) after a refusal that
    says to come back or a node that refuses connections. The assistant message,
    or None."""
    stream = rng.random() < 0.6
    tools = rng.random() < 0.4
    close_early = stream and rng.random() < 0.12
    short_timeout = not stream and rng.random() < 0.08
    for _attempt in range(5):
        up = soak.up()
        if not up:
            time.sleep(1)
            continue
        entry = rng.choice(up)
        node = soak.cluster.nodes[entry]
        if node is None:
            continue
        request = Request(k, model, entry, stream, tools, time.monotonic())
        with soak.lock:
            soak.requests.append(request)
        reply, again = send(node.base_url, request, messages, rng, close_early, short_timeout, soak)
        request.ended = time.monotonic()
        if not again:
            return reply
        soak.client_retries[request.failure or "?"] += 1
        time.sleep(again)
    return None


def send(
    base_url: str,
    request: Request,
    messages: list[Any],
    rng: random.Random,
    close_early: bool,
    short_timeout: bool,
    soak: Soak,
) -> tuple[dict[str, Any] | None, float]:
    """(the assistant message or None, seconds to wait before sending it again or 0)."""
    timeout = rng.uniform(0.05, 0.5) if short_timeout else 90.0
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", timeout=timeout, max_retries=0)
    extra: dict[str, Any] = {}
    if request.tools:
        extra = {"tools": TOOLS, "tool_choice": rng.choice(("auto", "required"))}
    try:
        if not request.stream:
            response = client.chat.completions.create(
                model=request.model, messages=messages, max_tokens=MAX_TOKENS, **extra
            )
            choice = response.choices[0]
            request.first_token = time.monotonic()
            request.finish_reason = choice.finish_reason
            request.chunks = 1
            return choice.message.model_dump(exclude_none=True), 0
        content, calls = "", {}
        chunks = client.chat.completions.create(
            model=request.model, messages=messages, max_tokens=MAX_TOKENS, stream=True, **extra
        )
        with chunks:
            for chunk in chunks:
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.content or delta.tool_calls:
                        request.chunks += 1
                        request.first_token = request.first_token or time.monotonic()
                    content += delta.content or ""
                    for call in delta.tool_calls or ():
                        slot = calls.setdefault(call.index, {"id": "", "name": "", "args": ""})
                        slot["id"] = call.id or slot["id"]
                        if call.function:
                            slot["name"] += call.function.name or ""
                            slot["args"] += call.function.arguments or ""
                    request.finish_reason = choice.finish_reason or request.finish_reason
                if close_early and request.chunks >= 2:
                    request.cancelled = "closed early"
                    return None, 0
        if request.finish_reason is None:
            fail(request, soak, "stream ended with no finish_reason and no error", "")
            return None, 0
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["args"]}}
                for c in calls.values()
            ]  # fmt: skip
        return message, 0
    except openai.APITimeoutError as error:
        if short_timeout:
            request.cancelled = "client timeout"
            return None, 0
        fail(request, soak, "client timed out (90 s)", repr(error))
    except openai.APIStatusError as error:  # an HTTP error status with its message
        after = error.response.headers.get("retry-after")
        status = error.status_code
        request.failure = f"HTTP {status}" + (" with Retry-After" if after else "")
        request.detail = str(error.message)[:200]
        if after:
            return None, min(float(after), 5.0)
    except openai.APIConnectionError as error:
        if "refused" in repr(error).lower() or "connecterror" in repr(error.__cause__).lower():
            request.failure = "connection refused (node down)"
            request.detail = repr(error.__cause__)[:200]
            return None, 1.0
        fail(request, soak, "connection broke", repr(error.__cause__ or error))
    except openai.APIError as error:  # an SSE error event
        if error.message:
            request.failure = (
                "stream error event after tokens" if request.chunks else "error event, no token"
            )
            request.detail = str(error.message)[:200]
        else:
            fail(request, soak, "error event with no message", repr(error))
    except httpx.HTTPError as error:  # the connection broke mid-stream
        fail(request, soak, "connection broke", repr(error))
    return None, 0


def kind_of(request: Request) -> str:
    """'told to come back' (429/503 with Retry-After), 'entry node down' (its
    connection refused: the client goes to another node), or 'failed'."""
    if (request.failure or "").endswith("with Retry-After"):
        return "told to come back"
    if (request.failure or "").startswith("connection refused"):
        return "entry node down"
    return "failed"


def allowed(request: Request) -> bool:
    """A failure the targets allow: a stream that had tokens when its node died,
    or a request whose own entry node was killed or stopped under it."""
    failure = request.failure or ""
    return failure == "stream error event after tokens" or failure.endswith(
        "(its entry node was killed/stopped)"
    )


def fail(request: Request, soak: Soak, why: str, detail: str) -> None:
    """A failure with no message from the product: was its own node taken down?"""
    request.ended = time.monotonic()
    gone = request.entry in soak.victim_of_at(request.ended - soak.started)
    where = "its entry node was killed/stopped" if gone else "no fault on its entry node"
    tokens = "after tokens" if request.chunks else "before any token"
    request.failure = f"{why}, {tokens} ({where})"
    request.detail = detail[:200]


# ---------------------------------------------------------------- watchers


def scrape_retries(soak: Soak) -> None:
    for i in soak.up():
        node = soak.cluster.nodes[i]
        if node is None:
            continue
        try:
            found = samples(node)
        except Exception:  # a node going down meanwhile
            continue
        for (name, labels), value in found.items():
            if name != "exo_retried_requests_total":
                continue
            label = dict(labels)
            key = (i, label.get("model", ""), label.get("where", ""))
            last = soak.retried_last.get(key, 0.0)
            soak.retried[key[1:]] += value - last if value >= last else value  # reset: restarted
            soak.retried_last[key] = value


def forget_retries_of(soak: Soak, i: int) -> None:
    """A restarted node's counters begin at 0 again."""
    for key in [key for key in soak.retried_last if key[0] == i]:
        soak.retried_last[key] = 0.0


def sample_processes(soak: Soak) -> None:
    for i in soak.up():
        node = soak.cluster.nodes[i]
        if node is None:
            continue
        try:
            root = psutil.Process(node.process.pid)
            found = [(f"node{i}", root)] + [
                (f"node{i} runner", p) for p in root.children(recursive=True)
            ]
            for label, process in found:
                with process.oneshot():
                    sample = ProcessSample(
                        soak.now(), process.memory_info().rss, process.num_fds(),
                        process.num_threads(),
                    )  # fmt: skip
                if "runner" in label:
                    soak.runners_seen.add(process.pid)
                soak.processes.setdefault(process.pid, (label, []))[1].append(sample)
        except psutil.Error:
            continue


def watch(soak: Soak) -> None:
    last_sample = -1e9
    while not soak.stopping.wait(3.0):
        scrape_retries(soak)
        if soak.now() - last_sample >= 15:
            sample_processes(soak)
            last_sample = soak.now()


# ---------------------------------------------------------------- faults


def master_index(soak: Soak) -> int | None:
    for i in soak.up():
        node = soak.cluster.nodes[i]
        try:
            master = node.get("/state")["master_id"] if node else None
        except httpx.HTTPError:
            continue
        if isinstance(master, str) and master in soak.cluster.ids:
            return soak.cluster.index_of(master)
    return None


def remember_events(soak: Soak, witness: int) -> None:
    """Every event `witness` holds now: at the end the cluster must hold them too."""
    node = soak.cluster.nodes[witness]
    if node is None:
        return
    try:
        for event in events(node, max(soak.held, default=-1) + 1):
            soak.held[event["idx"]] = event
    except httpx.HTTPError as error:
        print(f"  (could not read node{witness}'s events: {error!r})", flush=True)


def restart(soak: Soak, i: int) -> None:
    soak.cluster.start(i)
    forget_retries_of(soak, i)
    with soak.lock:
        soak.down.discard(i)


def inject(soak: Soak, fault: Fault, rng: random.Random) -> Fault:
    """Fill in and carry out `fault` (listed already: a request it breaks is
    told from one that breaks by itself while it lasts)."""
    cluster, args, kind = soak.cluster, soak.args, fault.kind
    up = soak.up()
    master = master_index(soak)
    if kind == "kill a runner":
        with_runners = [i for i in up if runner_pids(cluster.node(i))]
        if not with_runners:
            fault.note = "no runner up"
            return fault
        fault.victim = rng.choice(with_runners)
        pid = rng.choice(runner_pids(cluster.node(fault.victim)))
        witness = next(i for i in up if i != fault.victim) if len(up) > 1 else fault.victim
        remember_events(soak, witness)
        psutil.Process(pid).kill()
        fault.note = f"runner pid {pid}"
        fault.until = soak.now()
        return fault
    if kind in ("kill a worker node", "kill the master"):
        choices = [i for i in up if (i == master) == (kind == "kill the master")]
        if not choices:
            fault.note = "no such node up"
            return fault
        fault.victim = rng.choice(choices)
        witness = next((i for i in up if i != fault.victim), None)
        if witness is not None:
            remember_events(soak, witness)
        pids = runner_pids(cluster.node(fault.victim))
        with soak.lock:
            soak.down.add(fault.victim)
        cluster.kill(fault.victim)
        time.sleep(1)
        for pid in pids:  # a runner outliving its node is a finding: note it, then end it
            try:
                if is_runner_process(psutil.Process(pid).cmdline(), psutil.Process(pid).name()):
                    fault.note += f" runner {pid} outlived its node by 1 s;"
            except psutil.Error:
                pass
        time.sleep(args.restart_after_seconds)
        restart(soak, fault.victim)
        fault.until = soak.now()
        return fault
    if kind == "SIGSTOP a node":
        fault.victim = rng.choice(up)
        witness = next((i for i in up if i != fault.victim), None)
        if witness is not None:
            remember_events(soak, witness)
        fault.note = "the master" if fault.victim == master else "a worker"
        pid = cluster.node(fault.victim).process.pid
        with soak.lock:
            soak.down.add(fault.victim)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(args.stop_seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        with soak.lock:
            soak.down.discard(fault.victim)
        fault.until = soak.now()
        return fault
    # fill a disk: leave exactly the floor free on the node's data disk
    fault.victim = rng.choice(up)
    data = cluster.root / f"node{fault.victim}"
    if not os.path.ismount(data):
        fault.note = "data dir is no tmpfs here (not root): skipped"
        return fault
    filler = data / "soak-filler"
    usage = psutil.disk_usage(str(data))
    size = max(0, usage.free - args.min_free_disk_bytes)
    subprocess.run(["fallocate", "-l", str(size), str(filler)], check=False)
    free_now = psutil.disk_usage(str(data)).free
    fault.note = f"{size >> 20} MiB filler, {free_now >> 20} MiB left free"
    deadline = time.monotonic() + args.fill_seconds
    try:
        while time.monotonic() < deadline:
            try:
                health = cluster.node(fault.victim).health()
                soak.disk_fill_health.append(str(health.get("status")))
            except Exception as error:  # recorded: a node that does not answer while full
                soak.disk_fill_health.append(f"no answer: {type(error).__name__}")
            time.sleep(2)
    finally:
        filler.unlink(missing_ok=True)
    fault.until = soak.now()
    return fault


def keep_models_placed(soak: Soak, unserved_since: dict[str, float]) -> None:
    """An operator: a model with no instance for `--unserved-seconds` is placed again."""
    up = soak.up()
    if not up:
        return
    node = soak.cluster.nodes[up[0]]
    if node is None:
        return
    try:
        instances = node.get("/state")["instances"].values()
    except httpx.HTTPError:
        return
    for model in MODELS:
        if any(i["model_id"] == model for i in instances):
            unserved_since.pop(model, None)
            continue
        since = unserved_since.setdefault(model, soak.now())
        if soak.now() - since >= soak.args.unserved_seconds:
            ranks = 2 if model == SPLIT else 1
            if place(node, model, ranks) == 201:
                soak.placed_by_soak[model] += 1
                print(f"  [{soak.now():6.0f}s] {model} unserved: placed again", flush=True)
            unserved_since.pop(model, None)


def faults(soak: Soak) -> None:
    rng = random.Random(1234)
    unserved: dict[str, float] = {}
    n = 0
    end = soak.args.minutes * 60
    while not soak.stopping.is_set():
        next_at = (n + 1) * soak.args.fault_every_seconds
        while soak.now() < next_at and not soak.stopping.is_set():
            keep_models_placed(soak, unserved)
            soak.stopping.wait(min(5.0, max(0.0, next_at - soak.now())))
        # the last stretch has no new fault, so that the end is measured settled
        if soak.stopping.is_set() or soak.now() > end - soak.args.fault_every_seconds / 2:
            break
        fault = Fault(FAULTS[n % len(FAULTS)], soak.now(), None)
        soak.faults.append(fault)
        try:
            inject(soak, fault, rng)
        except Exception as error:  # reported: the soak goes on
            fault.note += f" fault failed: {error!r}"[:300]
        print(f"  [{fault.at:6.0f}s] {fault.kind}: node{fault.victim} {fault.note}", flush=True)
        n += 1


# ---------------------------------------------------------------- setup


def place(node: NodeProcess, model: str, ranks: int) -> int:
    body = {"model_id": model, "min_nodes": ranks, "max_nodes": ranks}
    return httpx.post(f"{node.base_url}/place_instance", json=body, timeout=30).status_code


@contextmanager
def data_disks(root: Path, size: int) -> Iterator[bool]:
    """A tmpfs of `size` bytes as each node's data dir (as root); False where none."""
    mounted: list[Path] = []
    try:
        for i in range(3):
            target = root / f"node{i}"
            target.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                capture_output=True,
            )
            if done.returncode != 0:
                break
            mounted.append(target)
        yield len(mounted) == 3
    finally:
        for target in mounted:
            subprocess.run(["umount", "-l", str(target)], check=False)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def disk_report(root: Path) -> dict[int, dict[str, int]]:
    found = {}
    for i in range(3):
        data = root / f"node{i}"
        tier = data / "cache" / "prefix_cache"
        namespaces = [p for p in tier.iterdir() if p.is_dir()] if tier.exists() else []
        found[i] = {
            "log": (data / "events.log").stat().st_size if (data / "events.log").exists() else 0,
            "snapshot": (
                (data / "events.snapshot").stat().st_size
                if (data / "events.snapshot").exists()
                else 0
            ),
            "tier": dir_bytes(tier),
            "namespaces": len(namespaces),
            "largest namespace": max((dir_bytes(p) for p in namespaces), default=0),
        }
    return found


# ---------------------------------------------------------------- report


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(soak: Soak, disks: tuple[dict[int, dict[str, int]], dict[int, dict[str, int]]],
           start_idx: int, last_idx: int, lost: int, compared: int) -> bool:  # fmt: skip
    args = soak.args
    requests = soak.requests
    answered = [r for r in requests if r.answered]
    cancelled = Counter(r.cancelled for r in requests if r.cancelled)
    failed = [r for r in requests if r.failure and not r.cancelled]
    reasons = Counter(r.failure for r in failed)
    told = [r for r in failed if kind_of(r) != "failed"]
    bad = [r for r in failed if kind_of(r) == "failed" and not allowed(r)]
    waits = [r.ended - r.started for r in answered if r.ended]
    ttfts = [r.first_token - r.started for r in requests if r.first_token and r.stream]
    print(f"\nsoak: {args.minutes:g} minutes, a fault every {args.fault_every_seconds:g} s, "
          f"{len(soak.faults)} faults")  # fmt: skip
    for kind, count in Counter(f.kind for f in soak.faults).items():
        print(f"  {kind}: {count}")
    print(f"requests: {len(requests)} sent, {len(answered)} answered, "
          f"{sum(cancelled.values())} cancelled by their client {dict(cancelled)}, "
          f"{len(told)} refused and sent again by the client "
          f"{dict(Counter(kind_of(r) for r in told))}, {len(failed) - len(told)} failed "
          f"({len(failed) - len(told) - len(bad)} of them allowed: a stream with tokens, "
          f"or a request whose own entry node died)")  # fmt: skip
    for reason, count in reasons.most_common():
        example = next(r.detail for r in failed if r.failure == reason)
        print(f"  {count:5d} {reason}  e.g. {example[:140]!r}")
    print(f"  sent again by their client (after the failures above): {dict(soak.client_retries)}")
    print(f"retried by the product (exo_retried_requests_total, summed): "
          f"{sum(soak.retried.values()):.0f} {dict(soak.retried)}")  # fmt: skip
    if soak.disk_fill_health:
        print(f"/health of a node while its disk was full to its floor: "
              f"{dict(Counter(soak.disk_fill_health))}")  # fmt: skip
    print(f"models placed again by the soak (left unserved {args.unserved_seconds:g} s): "
          f"{dict(soak.placed_by_soak)}")  # fmt: skip
    if waits:
        longest = max((r for r in answered if r.ended), key=lambda r: (r.ended or 0) - r.started)
        print(f"longest wait for an answer: {max(waits):.1f} s "
              f"(client {longest.client}, {longest.model}, stream={longest.stream}, "
              f"at {longest.started - soak.started:.0f} s); median {sorted(waits)[len(waits) // 2]:.2f} s")  # fmt: skip
    if ttfts:
        print(f"longest time to a first streamed token: {max(ttfts):.1f} s")
    longest_any = max(((r.ended or 0) - r.started for r in requests if r.ended), default=0)
    print(f"longest any request lasted (answered or not): {longest_any:.1f} s")

    steady = args.steady_minute * 60
    print(f"\nprocesses (RSS / open files / threads): first sample, at its minute "
          f"{args.steady_minute:g} of life (runners: once loaded), last sample; growth "
          f"where that leaves 2 minutes or more")  # fmt: skip
    worst = 0.0
    measured = 0
    end_at = max((got[-1].at for _, got in soak.processes.values()), default=0)
    shown = {
        pid: (label, got)
        for pid, (label, got) in soak.processes.items()
        if got[0].at < 1 or got[-1].at >= end_at - 1 or got[-1].at - got[0].at >= 120
    }
    print(f"  ({len(soak.processes) - len(shown)} shorter-lived processes, runners of "
          f"killed nodes or replaced instances, not shown)")  # fmt: skip
    for pid, (label, got) in sorted(shown.items(), key=lambda x: x[1][0]):
        first, last = got[0], got[-1]
        # from the process's own steady minute of life (a runner once loaded:
        # a standby runner, imports only, takes an instance over later)
        at_steady = next(
            (s for s in got
             if s.at >= first.at + steady and ("runner" not in label or s.threads > 4)),
            None,
        )  # fmt: skip
        growth = ""
        if at_steady is not None and last.at - at_steady.at >= 120:
            ratio = last.rss / at_steady.rss - 1
            worst = max(worst, ratio)
            measured += 1
            growth = f"  RSS {ratio:+.1%} over {(last.at - at_steady.at) / 60:.1f} min"
        span = f"{first.at / 60:.1f}-{last.at / 60:.1f} min"

        def fmt(s: ProcessSample | None) -> str:
            return f"{mib(s.rss)}/{s.fds}/{s.threads}" if s else "-"

        print(f"  {label:12s} pid {pid:7d} {span:13s} {fmt(first)}  {fmt(at_steady)}  "
              f"{fmt(last)}{growth}")  # fmt: skip
    start, end = disks
    print(f"\nevent log (last index {last_idx}; compaction every {COMPACT_EVERY} events, "
          f"keeping {RETAIN_EVENTS})")  # fmt: skip
    for i in range(3):
        print(f"  node{i}: log {mib(start[i]['log'])} -> {mib(end[i]['log'])}, "
              f"snapshot {mib(start[i]['snapshot'])} -> {mib(end[i]['snapshot'])}; "
              f"prefix-cache disk {mib(start[i]['tier'])} -> {mib(end[i]['tier'])} in "
              f"{end[i]['namespaces']} namespace folders (largest {mib(end[i]['largest namespace'])}, "
              f"budget {mib(args.prefix_cache_disk_bytes)} per runner)")  # fmt: skip
    # The log holds at most COMPACT_EVERY + RETAIN_EVENTS events: at the bytes
    # per event of the start (1.5x for larger events), or all of them when fewer.
    per_event = max(e["log"] for e in start.values()) / max(start_idx + 1, 1)
    held_events = min(last_idx + 1, COMPACT_EVERY + RETAIN_EVENTS)
    log_bound = all(e["log"] <= 1.5 * per_event * held_events for e in end.values())
    if last_idx + 1 <= COMPACT_EVERY:
        print(f"  (the log never reached compaction: {last_idx + 1} events)")
    tier_bound = all(e["largest namespace"] <= args.prefix_cache_disk_bytes for e in end.values())
    print(f"events lost: {lost} of {compared} held by a surviving node before a fault")

    print("\ntargets")
    checks = {
        "failures without a reason the client can act on == 0": len(bad) == 0,
        "lost events == 0": lost == 0 and compared > 0,
        f"RSS growth from minute {args.steady_minute:g} <= {args.rss_target:.0%} "
        f"(worst {worst:+.1%} of {measured} processes that lived long enough)": measured > 0
        and worst <= args.rss_target,
        "event log within its compaction bound": log_bound,
        "each disk tier folder within its budget": tier_bound,
    }
    for what, ok in checks.items():
        print(f"  {'met   ' if ok else 'MISSED'} {what}")
    if bad:
        print(f"  the {len(bad)} failures that miss:")
        for r in bad:
            print(f"    at {r.started - soak.started:6.1f}-{(r.ended or 0) - soak.started:6.1f} s "
                  f"client {r.client} via node{r.entry} {r.model} stream={r.stream} "
                  f"tools={r.tools} chunks={r.chunks}: {r.failure}: {r.detail[:160]}")  # fmt: skip
    return all(checks.values())


# ---------------------------------------------------------------- main


def settle(soak: Soak) -> None:
    """Every node up and agreeing, and both models answering."""
    cluster = soak.cluster
    for i, node in enumerate(cluster.nodes):
        if node is None:
            restart(soak, i)
    wait_until(lambda: agreed(cluster.running()), 180, "three nodes agreeing at the end")


def main() -> int:
    parser = argparse.ArgumentParser(description="soak: agent clients under faults")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--fault-every-seconds", type=float, default=60)
    parser.add_argument("--steady-minute", type=float, default=5,
                        help="RSS growth is measured from here to the end")  # fmt: skip
    parser.add_argument("--rss-target", type=float, default=0.10,
                        help="the most a process's RSS may grow from --steady-minute on")  # fmt: skip
    parser.add_argument("--restart-after-seconds", type=float, default=10)
    parser.add_argument("--stop-seconds", type=float, default=10)
    parser.add_argument("--fill-seconds", type=float, default=20)
    parser.add_argument("--unserved-seconds", type=float, default=60)
    parser.add_argument("--retry-seconds", type=float, default=30)
    parser.add_argument("--disk-bytes", type=int, default=256 << 20,
                        help="each node's data tmpfs (as root)")  # fmt: skip
    parser.add_argument("--min-free-disk-bytes", type=int, default=64 << 20)
    parser.add_argument("--prefix-cache-disk-bytes", type=int, default=16 << 20)
    parser.add_argument("--models-dir", type=Path, help="a folder holding the imported model")
    parser.add_argument("--logs-dir", type=Path, help="copy the nodes' logs here at the end")
    args = parser.parse_args()

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="exo-soak-")))
        models = work / "models"
        smollm = model_dir(args.models_dir or models, DEFAULT_MODEL_ID)
        ensure_default_model(args.models_dir or models)
        for model, layers in ((SPLIT, 4), (WHOLE, 2)):
            make_tiny_llama(model_dir(models, model), smollm, n_layers=layers)
        root = work / "cluster"
        tmpfs = stack.enter_context(data_disks(root, args.disk_bytes))
        cluster = LanCluster(
            root, models, 3,
            "--model", "none",
            "--sse-keepalive-seconds", "1",
            "--retry-seconds", str(args.retry_seconds),
            "--min-free-disk-bytes", str(args.min_free_disk_bytes),
            "--prefix-cache-disk-bytes", str(args.prefix_cache_disk_bytes),
        )  # fmt: skip
        stack.callback(cluster.close)
        if args.logs_dir:
            stack.callback(copy_logs, root, args.logs_dir)
        print(f"nodes: {'network namespaces' if cluster.lan else f'loopback ({cluster.why_loopback})'}; "
              f"data dirs: {'tmpfs' if tmpfs else 'plain (no disk fault)'}", flush=True)  # fmt: skip
        cluster.start(0, 1, 2)
        wait_until(lambda: agreed(cluster.running()), 90, "three nodes agreeing")
        wait_until(lambda: all(m in cluster.state()["cards"] for m in MODELS), 30, "cards")
        entry = cluster.node(0)
        for model, ranks in ((SPLIT, 2), (WHOLE, 1)):
            assert place(entry, model, ranks) == 201
            assert await_instance(entry.base_url, model, timeout=180)[-1]["status"] == "ready"
            assert chat(entry.base_url, model, timeout=60), f"{model} does not answer"
        soak = Soak(cluster, args, time.monotonic())
        stack.callback(end_orphans, soak)
        disk_start = disk_report(root)
        start_idx = cluster.state()["last_idx"]
        sample_processes(soak)
        print(f"placed and answering; soaking for {args.minutes:g} minutes", flush=True)

        threads = [threading.Thread(target=agent, args=(soak, k), daemon=True)
                   for k in range(CLIENTS)]  # fmt: skip
        threads += [threading.Thread(target=t, args=(soak,), daemon=True) for t in (watch, faults)]
        for thread in threads:
            thread.start()
        progress = 0.0
        while soak.now() < args.minutes * 60:
            time.sleep(5)
            if soak.now() - progress >= 60:
                progress = soak.now()
                ok = sum(r.answered for r in soak.requests)
                print(f"  [{soak.now():6.0f}s] {len(soak.requests)} requests, {ok} answered, "
                      f"{sum(bool(r.failure) for r in soak.requests)} failed", flush=True)  # fmt: skip
        soak.stopping.set()
        for thread in threads:
            thread.join(120)
        scrape_retries(soak)
        sample_processes(soak)
        settle(soak)
        final = events(cluster.node(0), min(soak.held, default=0))
        by_idx = {e["idx"]: e for e in final}
        lost = sum(by_idx.get(idx) != event for idx, event in soak.held.items())
        last_idx = cluster.state()["last_idx"]
        print(f"runners alive at the end whose node is gone: {orphans(soak)}")
        met = report(
            soak, (disk_start, disk_report(root)), start_idx, last_idx, lost, len(soak.held)
        )
        print(f"\n{'met' if met else 'MISSED'}")
        return 0 if met else 1


def copy_logs(root: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for log in root.glob("node*.log"):
        shutil.copy(log, target / log.name)


def orphans(soak: Soak) -> list[int]:
    """Runner processes alive now whose node process is not a running node."""
    nodes = {n.process.pid for n in soak.cluster.running()}
    found = []
    for pid in soak.runners_seen:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE and not any(
                p.pid in nodes for p in process.parents()
            ):
                found.append(pid)
        except psutil.Error:
            pass
    return found


def end_orphans(soak: Soak) -> None:
    """Runners this soak started that outlived their nodes."""
    for pid in soak.runners_seen:
        try:
            process = psutil.Process(pid)
            if is_runner_process(process.cmdline(), process.name()):
                process.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    sys.exit(main())
