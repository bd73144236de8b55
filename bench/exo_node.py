"""Shared helpers for the benchmarks: run a real `exo` node process and stream from it.

Not a benchmark itself; imported by the scripts next to it.
"""

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

MODEL_ID = "SmolLM2-135M-Instruct"
READY_TIMEOUT_SECONDS = 300.0
STOP_TIMEOUT_SECONDS = 20.0
REQUEST_TIMEOUT_SECONDS = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def exo_command() -> list[str]:
    """The `exo` entry point of this interpreter's environment."""
    script = Path(sys.executable).parent / "exo"
    if script.exists():
        return [str(script)]
    found = shutil.which("exo")
    if found:
        return [found]
    return [sys.executable, "-c", "from exo.main import main; main()"]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def launch_exo(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """`exo ARGS` with its output in `log_path`, in a session of its own (a Ctrl-C
    of the benchmark reaches the benchmark, which then stops the node)."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [*exo_command(), *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_exo(
    process: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_SECONDS, name: str = "exo"
) -> int | None:
    """SIGINT, a bounded wait, then SIGKILL of the process group (a node and its
    runners, or the server `name`); the exit code, None if it would not die."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{name} did not stop within {timeout:.0f}s after SIGINT; killing it")
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None
    return process.returncode


@dataclass
class ExoNode:
    """A running `exo` node on loopback; use `start_node()` to get one."""

    process: subprocess.Popen[bytes]
    base_url: str
    data_dir: Path
    models_dir: Path
    log_path: Path

    @property
    def model_dir(self) -> Path:
        return self.models_dir / MODEL_ID.replace("/", "--")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> float:
        """Wait for the node's "ready:" log line; returns the seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"exo exited with code {self.process.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            if "ready:" in self.log_path.read_text(errors="replace"):
                return time.monotonic() - start
            time.sleep(0.2)
        raise TimeoutError(f"exo not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> int | None:
        return stop_exo(self.process, timeout)


def _process_cpu(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def _system_busy() -> float:
    times = psutil.cpu_times()
    return float(sum(times)) - float(times.idle) - float(getattr(times, "iowait", 0.0))


@dataclass
class CpuUsage:
    wall: float
    per_process: dict[str, float]  # label -> CPU seconds used in the window
    foreign_cores: float  # average cores busy with processes other than ours

    def cpu_ms_per(self, label: str, count: int) -> float:
        return 1000 * self.per_process.get(label, 0.0) / max(count, 1)


class CpuMeter:
    """CPU seconds of our processes and of everything else over a time window.

    On a shared machine the foreign share tells a quiet measurement from a
    contended one.
    """

    def __init__(self, processes: dict[str, int]) -> None:
        self.processes = processes
        self._start = (0.0, 0.0, dict[str, float]())

    def start(self) -> None:
        cpu = {label: _process_cpu(pid) for label, pid in self.processes.items()}
        self._start = (time.perf_counter(), _system_busy(), cpu)

    def stop(self) -> CpuUsage:
        wall0, busy0, cpu0 = self._start
        cpu = {label: _process_cpu(pid) - cpu0[label] for label, pid in self.processes.items()}
        wall = time.perf_counter() - wall0
        foreign = max(0.0, _system_busy() - busy0 - sum(cpu.values()))
        return CpuUsage(wall, cpu, foreign / wall if wall > 0 else 0.0)


def runner_pid(node: "ExoNode") -> int | None:
    """The pid of the node's runner process, if it runs."""
    try:
        children = psutil.Process(node.process.pid).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            if "exo.worker.runner.runner_main" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


@contextmanager
def start_node(
    models_dir: Path | None = None,
    prefix_cache_bytes: int | None = None,
    keep_logs: bool = False,
    ready_timeout: float = READY_TIMEOUT_SECONDS,
) -> Iterator[ExoNode]:
    """Start a lone `exo` node on free loopback ports with its own temp data dir;
    stop it on exit.

    `models_dir` may point at a folder that already holds the imported built-in
    model, to skip the import; by default a temp folder is used.
    """
    temp = Path(tempfile.mkdtemp(prefix="exo-bench-"))
    data_dir = temp / "data"
    models = models_dir if models_dir is not None else temp / "models"
    port = free_port()
    command = [
        "--host",
        "127.0.0.1",
        "--api-port",
        str(port),
        # A lone node: its own cluster port, no mDNS, a secret no other node has.
        "--grpc-port",
        str(free_port()),
        "--no-discovery",
        "--cluster-secret",
        f"bench-{uuid.uuid4().hex}",
        "--data-dir",
        str(data_dir),
        "--models-dir",
        str(models),
        "--log-level",
        "INFO",
    ]
    if prefix_cache_bytes is not None:
        command += ["--prefix-cache-bytes", str(prefix_cache_bytes)]
    log_path = temp / "exo.log"
    process = launch_exo(command, log_path)
    node = ExoNode(process, f"http://127.0.0.1:{port}", data_dir, models, log_path)
    try:
        seconds = node.wait_ready(ready_timeout)
        kept = f" (log: {log_path})" if keep_logs else ""
        print(f"exo ready on {node.base_url} after {seconds:.1f}s{kept}")
        yield node
    finally:
        code = node.stop()
        print(f"exo stopped (exit code {code})")
        if keep_logs:
            print(f"kept {temp}")
        else:
            shutil.rmtree(temp, ignore_errors=True)  # data, log and (if ours) models


@dataclass
class StreamResult:
    """One streamed chat completion, timed on the client."""

    text: str = ""
    # perf_counter() seconds after the request was sent, one per non-empty content chunk.
    content_times: list[float] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    total_seconds: float = 0.0

    @property
    def ttft(self) -> float:
        return self.content_times[0] if self.content_times else float("nan")

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0))

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens", 0) or 0)


def sse_data(client: httpx.Client, url: str, body: dict[str, Any], timeout: float) -> Iterator[str]:
    """POST `body` and yield the payload of each SSE `data:` line as it arrives
    (blank separators and ": keep-alive" comments are skipped); an answer other
    than 200 raises."""
    with client.stream("POST", url, json=body, timeout=timeout) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield line[len("data: ") :]


def stream_chat(
    client: httpx.Client,
    base_url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    timeout: float = REQUEST_TIMEOUT_SECONDS,
    **extra: Any,
) -> StreamResult:
    """POST a streaming chat completion and time every content chunk."""
    body: dict[str, Any] = {
        "model": MODEL_ID,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    result = StreamResult()
    parts: list[str] = []
    start = time.perf_counter()
    for payload in sse_data(client, f"{base_url}/v1/chat/completions", body, timeout):
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        if chunk.get("usage"):
            result.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                result.content_times.append(time.perf_counter() - start)
                parts.append(content)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"stream still going after {timeout:.0f}s")
    result.total_seconds = time.perf_counter() - start
    result.text = "".join(parts)
    return result


def float32_copy(model_dir: Path, target: Path) -> Path:
    """The model as exo runs it on the CPU (dequantized to float32), for mlx_lm.server."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from exo.engine.mlx.load import load_for_inference

    model, _ = load_for_inference(model_dir)
    target.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config))
    for path in model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_")):
            shutil.copy(path, target / path.name)
    return target


@contextmanager
def mlx_lm_server(model_dir: Path, work: Path) -> Iterator[tuple[str, int]]:
    """`mlx_lm.server` with its default flags (OpenBLAS preloaded, as for exo's
    runners): its base URL and pid."""
    from exo.worker.runner.blas import runner_environment

    port = free_port()
    log = (work / "mlx_lm_server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=runner_environment(work / "blas"),
        start_new_session=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited: see {work / 'mlx_lm_server.log'}")
            try:
                httpx.get(f"{base_url}/v1/models", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TimeoutError("mlx_lm.server did not start") from None
                time.sleep(0.5)
        yield base_url, process.pid
    finally:
        # Its generation thread keeps it alive after SIGINT: it is killed at the
        # deadline, which a short one keeps from slowing the bench's exit.
        stop_exo(process, timeout=3, name="mlx_lm.server")
        log.close()
