"""Real `exo` nodes as on separate machines: each in its own network namespace
on a private LAN (a bridge), finding each other with real mDNS, on the default
ports. Where namespaces cannot be made (not root, no `ip`), the same nodes run
on loopback ports with static peers, and `lan` is None.

Each node keeps its data dir across `kill` and `start` (a restart resumes it)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from exo.worker.runner.standby import is_runner_process
from tests.e2e.node_process import NodeProcess, free_port
from tests.integration.cluster_process import agreed, wait_until
from tests.netns import NetnsLan, NetnsUnavailable

SECRET = "chaos-secret"
API_PORT = 52415
GRPC_PORT = 52414


def runner_pids(node: NodeProcess) -> list[int]:
    try:
        children = psutil.Process(node.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if is_runner_process(child.cmdline(), child.name()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


class LanCluster:
    def __init__(self, root: Path, models_dir: Path, size: int, *node_args: str) -> None:
        self.root = root
        self.models_dir = models_dir
        self.node_args = node_args
        self.nodes: list[NodeProcess | None] = [None] * size
        self.ids: list[str | None] = [None] * size
        self.lan: NetnsLan | None = None
        self.why_loopback: str | None = None
        try:
            self.lan = NetnsLan.create(size)
        except NetnsUnavailable as error:
            self.why_loopback = str(error)
        self._ports = [(free_port(), free_port()) for _ in range(size)]

    def _address(self, i: int) -> tuple[str, int, int]:
        """(host, api port, gRPC port) of node i."""
        if self.lan is not None:
            return self.lan.addresses[i], API_PORT, GRPC_PORT
        api, grpc = self._ports[i]
        return "127.0.0.1", api, grpc

    def start(self, *indices: int) -> list[NodeProcess]:
        """Start nodes `indices` together; returns them once their APIs answer."""
        started = [self._spawn(i) for i in indices]
        for i, node in zip(indices, started, strict=True):
            node.wait_for_api()
            self.ids[i] = node.get("/node_id")
        return started

    def start_agreeing(self, *indices: int, model: str) -> None:
        """Start nodes `indices` and wait until they agree and know `model`'s card."""
        self.start(*indices)
        wait_until(lambda: agreed(self.running()), 60, f"{len(indices)} nodes agreeing")
        wait_until(lambda: model in self.state()["cards"], 20, "the model's card")

    def _spawn(self, i: int) -> NodeProcess:
        host, api_port, grpc_port = self._address(i)
        if self.lan is not None:
            where: tuple[str, ...] = ("--host", "0.0.0.0", "--grpc-host", "0.0.0.0")
        else:
            peers = ",".join(f"127.0.0.1:{g}" for _, g in self._ports)
            where = ("--host", host, "--grpc-host", host, "--no-discovery", "--peers", peers)
        argv = [
            sys.executable, "-m", "exo.main", *where,
            "--api-port", str(api_port),
            "--grpc-port", str(grpc_port),
            "--data-dir", str(self.root / f"node{i}"),
            "--models-dir", str(self.models_dir),
            "--cluster-secret", SECRET,
            *self.node_args,
        ]  # fmt: skip
        if self.lan is not None:
            argv = self.lan.command(i, argv)  # `ip netns exec` execs: the same pid
        log_path = self.root / f"node{i}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()
            )
        node = NodeProcess(
            process, f"http://{host}:{api_port}", log_path, f"{host}:{grpc_port}", argv
        )
        self.nodes[i] = node
        return node

    def node(self, i: int) -> NodeProcess:
        node = self.nodes[i]
        assert node is not None, f"node {i} is not running"
        return node

    def running(self) -> list[NodeProcess]:
        return [n for n in self.nodes if n is not None]

    def index_of(self, node_id: str) -> int:
        return self.ids.index(node_id)

    def kill(self, i: int) -> None:
        node = self.node(i)
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(10)
        self.nodes[i] = None

    def state(self) -> dict[str, Any]:
        return self.running()[0].get("/state")

    def close(self) -> None:
        try:
            for node in self.running():
                node.stop()
        finally:
            if self.lan is not None:
                self.lan.close()


def chat(base_url: str, model: str, timeout: float) -> str | None:
    """A short answer, or None when none can be had now."""
    try:
        response = httpx.post(
            f"{base_url}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=timeout,
        )
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return response.json()["choices"][0]["message"]["content"] or None


def wait_serving(base_url: str, model: str, since: float, bound: float) -> float:
    """Seconds from `since` until `base_url` answers a chat; raises past `bound`."""
    while (left := since + bound - time.monotonic()) > 0:
        if chat(base_url, model, timeout=left):
            return time.monotonic() - since
        time.sleep(0.2)
    raise TimeoutError(f"no answer from {base_url} within {bound:g}s")
