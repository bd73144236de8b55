"""Start `exo` as a real process on a free loopback port, for end-to-end tests."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

READY_TIMEOUT_SECONDS = 180.0
STOP_TIMEOUT_SECONDS = 15.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class NodeProcess:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    grpc_address: str
    args: list[str]

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.base_url}{path}", timeout=5)
        response.raise_for_status()
        return response.json()

    def wait_for_api(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exo exited with {self.process.returncode}:\n{self.log()}")
            try:
                self.get("/cluster")
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(f"API not up after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_SECONDS)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=5).json()

    def runner_status(self) -> str:
        runners = list(self.health()["runners"].values())
        return runners[0]["status"] if runners else "none yet"

    def wait_for_runner(self, status: str, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exo exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.runner_status() == status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"runner not {status!r} after {timeout}s:\n{self.log()}")


def start_node(
    tmp_path: Path,
    models_dir: Path,
    *extra_args: str,
    model: str | None = None,
    data_dir: Path | None = None,
    grpc_port: int | None = None,
) -> NodeProcess:
    """Start `exo` (not waiting for anything); `stop()` it when done."""
    port = free_port()
    grpc_port = grpc_port or free_port()
    log_path = tmp_path / f"exo-{port}.log"
    args = [
        sys.executable, "-m", "exo.main",
        "--host", "127.0.0.1",
        "--grpc-host", "127.0.0.1",
        "--api-port", str(port),
        "--grpc-port", str(grpc_port),
        "--no-discovery",
        "--data-dir", str(data_dir or tmp_path / f"data-{port}"),
        "--models-dir", str(models_dir),
        *(["--model", model] if model else []),
        *extra_args,
    ]  # fmt: skip
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
    return NodeProcess(
        process, f"http://127.0.0.1:{port}", log_path, f"127.0.0.1:{grpc_port}", args
    )


@contextmanager
def running_node(
    tmp_path: Path,
    models_dir: Path,
    *extra_args: str,
    model: str | None = None,
    data_dir: Path | None = None,
    ready: Literal["runner", "api"] = "runner",
) -> Iterator[NodeProcess]:
    """A node whose runner is ready (or whose API is up, with `--no-worker` or
    `ready="api"`)."""
    node = start_node(tmp_path, models_dir, *extra_args, model=model, data_dir=data_dir)
    try:
        if "--no-worker" in extra_args or ready == "api":
            node.wait_for_api()
        else:
            node.wait_for_runner("ready")
        yield node
    finally:
        node.stop()


def await_instance(base_url: str, model_id: str, timeout: float = 120) -> list[dict[str, Any]]:
    """The events of `GET /instance/await` for `model_id`, until it ends."""
    with httpx.stream(
        "GET",
        f"{base_url}/instance/await",
        params={"model_id": model_id, "timeout": timeout},
        timeout=timeout + 10,
    ) as stream:
        return [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
