"""Several real `exo` processes on loopback ports (static peers, real gRPC)."""

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.node_process import NodeProcess, free_port, start_node

NODE_TIMEOUT = "6"
SECRET = "test-secret"


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as error:  # a node may be restarting
            last = error
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout}s (last: {last!r})")


def digest(state: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def agreed(nodes: list[NodeProcess]) -> str | None:
    """The shared master id when all nodes hold the same state (same index)."""
    states = [n.get("/state") for n in nodes]
    ids = {n.get("/node_id") for n in nodes}
    if (
        len({digest(s) for s in states}) == 1
        and states[0]["master_id"]
        and ids <= set(states[0]["nodes"])
    ):
        return states[0]["master_id"]
    return None


def events(node: NodeProcess, from_idx: int = 0) -> list[dict[str, Any]]:
    """The node's events from `from_idx` to its last applied one."""
    last = node.get("/state")["last_idx"]
    found: list[dict[str, Any]] = []
    if from_idx > last:
        return found
    params = {"from_idx": from_idx}
    with httpx.stream("GET", f"{node.base_url}/events", params=params, timeout=20) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                found.append(json.loads(line[6:]))
                if found[-1]["idx"] >= last:
                    break
    return found


class Cluster:
    def __init__(self, tmp_path: Path, models_dir: Path) -> None:
        self.tmp_path = tmp_path
        self.models_dir = models_dir
        self.ports = [free_port() for _ in range(3)]
        self.peers = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.nodes: list[NodeProcess] = []

    def start(
        self, i: int, *extra: str, model: str | None = None, models_dir: Path | None = None
    ) -> NodeProcess:
        node = start_node(
            self.tmp_path,
            models_dir or self.models_dir,
            "--peers", self.peers,
            "--cluster-secret", SECRET,
            "--node-timeout-seconds", NODE_TIMEOUT,
            *extra,
            *(() if model else ("--no-worker",)),
            model=model,
            data_dir=self.tmp_path / f"node{i}",
            grpc_port=self.ports[i],
        )  # fmt: skip
        node.wait_for_api()
        if len(self.nodes) > i:
            self.nodes[i] = node
        else:
            self.nodes.append(node)
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
