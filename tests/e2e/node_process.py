"""Start `exo` as a real process on a free loopback port, for end-to-end tests."""

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

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=5).json()

    def runner_status(self) -> str:
        return next(iter(self.health()["runners"].values()))["status"]

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


@contextmanager
def running_node(
    tmp_path: Path,
    models_dir: Path,
    *extra_args: str,
    model: str | None = None,
    data_dir: Path | None = None,
) -> Iterator[NodeProcess]:
    port = free_port()
    log_path = tmp_path / f"exo-{port}.log"
    args = [
        sys.executable, "-m", "exo.main",
        "--host", "127.0.0.1",
        "--api-port", str(port),
        "--grpc-port", str(free_port()),
        "--no-discovery",
        "--data-dir", str(data_dir or tmp_path / f"data-{port}"),
        "--models-dir", str(models_dir),
        *(["--model", model] if model else []),
        *extra_args,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
    node = NodeProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        node.wait_for_runner("ready")
        yield node
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_SECONDS)
