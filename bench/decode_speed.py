"""Decode speed through exo's HTTP API vs plain `mlx_lm.generate.stream_generate`.

Both sides run the same model folder (the built-in SmolLM2-135M-Instruct
imported by the node), loaded the same way:

* API: a real `exo` node on a free loopback port; a streaming chat completion
  with temperature 0, `"stop": []` and `max_tokens` (default 200);
* mlx_lm: a child process of this script, started with exo's
  `runner_environment(...)` (OpenBLAS preloaded before the process starts, as
  for a runner) that loads the model with exo's `load_for_inference`
  (float32 dequantization) and calls `stream_generate` on the same prompt
  tokens (the chat template applied as exo applies it).

Speed on both sides = (generated tokens - 1) / (time of last content chunk -
time of first content chunk); generated tokens come from `usage` on the API
side and from `GenerationResponse.generation_tokens` on the mlx_lm side. The
two alternate for `--rounds` rounds (order swapped every round); medians and
the ratio API/mlx_lm are reported. Target: ratio >= 0.9.

    uv run python bench/decode_speed.py
"""

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from exo_node import (
    CpuMeter,
    CpuUsage,
    ExoNode,
    median,
    runner_pid,
    start_node,
    stream_chat,
)

TARGET_RATIO = 0.9
WORKER_READY_TIMEOUT_SECONDS = 300.0
WORKER_REQUEST_TIMEOUT_SECONDS = 600.0
# A round counts as quiet when other processes used at most this many cores on average.
QUIET_FOREIGN_CORES = 0.15
DEFAULT_PROMPT = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the village and every character in detail."
)


@dataclass
class Measurement:
    side: str
    round: int
    tokens: int
    first: float  # seconds after the request, first non-empty content chunk
    last: float  # seconds after the request, last non-empty content chunk
    text: str
    cpu: CpuUsage | None = None

    @property
    def tokens_per_second(self) -> float:
        span = self.last - self.first
        return (self.tokens - 1) / span if span > 0 and self.tokens > 1 else float("nan")

    @property
    def quiet(self) -> bool:
        return self.cpu is None or self.cpu.foreign_cores <= QUIET_FOREIGN_CORES


def openblas_mapped(pid: int) -> bool:
    """Whether OpenBLAS is loaded in process `pid` (Linux: its memory maps)."""
    try:
        return "libopenblas" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


# --- the mlx_lm side: a child process -----------------------------------------------------


def worker_main(model_dir: Path) -> None:
    """Serve generation requests (JSON lines on stdin) with plain mlx_lm `stream_generate`."""
    # The protocol keeps the real stdout; anything printed elsewhere goes to stderr.
    out: IO[str] = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    from mlx_lm.generate import stream_generate

    from exo.engine.mlx.load import load_for_inference

    model, tokenizer = load_for_inference(model_dir)

    def reply(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    reply({"kind": "ready", "openblas": openblas_mapped(os.getpid())})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request["kind"] == "tokens":
            # As exo renders a chat prompt (src/exo/api/chat_prompt.py).
            text = tokenizer.apply_chat_template(
                request["messages"], add_generation_prompt=True, tokenize=False
            )
            assert isinstance(text, str)
            reply(
                {"kind": "tokens", "tokens": list(tokenizer.encode(text, add_special_tokens=False))}
            )
            continue
        times: list[float] = []
        parts: list[str] = []
        tokens = 0
        generation_tps = 0.0
        start = time.perf_counter()
        for response in stream_generate(
            model, tokenizer, request["tokens"], max_tokens=request["max_tokens"]
        ):
            if response.text:
                times.append(time.perf_counter() - start)
                parts.append(response.text)
            tokens = response.generation_tokens
            generation_tps = response.generation_tps
        reply(
            {
                "kind": "result",
                "tokens": tokens,
                "first": times[0] if times else float("nan"),
                "last": times[-1] if times else float("nan"),
                "text": "".join(parts),
                "mlx_lm_generation_tps": generation_tps,
            }
        )


class MlxLmWorker:
    """The parent's handle on the worker child process."""

    def __init__(self, model_dir: Path, cache_dir: Path) -> None:
        from exo.worker.runner.blas import runner_environment

        env = runner_environment(cache_dir)
        self.ld_preload = env.get("LD_PRELOAD", "")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(model_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            env=env,
            text=True,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._receive(WORKER_READY_TIMEOUT_SECONDS)
        self.openblas = bool(ready.get("openblas"))

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _receive(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty as error:
            raise TimeoutError(f"mlx_lm worker silent for {timeout:.0f}s") from error
        if line is None:
            raise RuntimeError(f"mlx_lm worker exited (code {self.process.wait(timeout=5)})")
        return json.loads(line)

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        return self._receive(WORKER_REQUEST_TIMEOUT_SECONDS)

    def prompt_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self._request({"kind": "tokens", "messages": messages})["tokens"])

    def generate(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        return self._request({"kind": "generate", "tokens": tokens, "max_tokens": max_tokens})

    def stop(self) -> None:
        if self.process.stdin is not None:
            with suppress(OSError):
                self.process.stdin.close()  # EOF: the worker's loop ends
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


# --- the benchmark ------------------------------------------------------------------------


def run_api(
    client: httpx.Client, node: ExoNode, messages: list[dict[str, str]], max_tokens: int, index: int
) -> tuple[Measurement, int]:
    result = stream_chat(client, node.base_url, messages, max_tokens, stop=[])
    measurement = Measurement(
        "api",
        index,
        result.completion_tokens,
        result.content_times[0] if result.content_times else float("nan"),
        result.content_times[-1] if result.content_times else float("nan"),
        result.text,
    )
    return measurement, result.prompt_tokens


def run_mlx_lm(worker: MlxLmWorker, tokens: list[int], max_tokens: int, index: int) -> Measurement:
    result = worker.generate(tokens, max_tokens)
    return Measurement(
        "mlx_lm", index, int(result["tokens"]), result["first"], result["last"], result["text"]
    )


def report(m: Measurement) -> None:
    cpu = ""
    if m.cpu is not None:
        labels = ("runner", "node", "client") if m.side == "api" else ("mlx_lm",)
        per_token = ", ".join(
            f"{label} {m.cpu.cpu_ms_per(label, m.tokens):.1f}" for label in labels
        )
        cpu = f" | CPU ms/token: {per_token} | other processes {m.cpu.foreign_cores:.2f} cores"
    print(
        f"round {m.round} {m.side:6s}: {m.tokens} tokens, first content {m.first:5.2f}s, "
        f"last {m.last:6.2f}s -> {m.tokens_per_second:6.2f} tok/s{cpu}"
    )


def summarize(label: str, measurements: list[Measurement]) -> float:
    api = [m for m in measurements if m.side == "api"]
    ref = [m for m in measurements if m.side == "mlx_lm"]
    if not api or not ref:
        print(f"{label}: none (needs a run of each side)")
        return float("nan")
    api_tps = median([m.tokens_per_second for m in api])
    ref_tps = median([m.tokens_per_second for m in ref])
    ratio = api_tps / ref_tps
    print(f"{label} ({len(api)} API runs, {len(ref)} mlx_lm runs):")
    print(f"  API        {api_tps:6.2f} tok/s")
    print(f"  mlx_lm     {ref_tps:6.2f} tok/s")
    print(f"  API/mlx_lm {ratio:.3f}  (target >= {TARGET_RATIO})")
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Decode tokens/s via exo's HTTP API vs mlx_lm stream_generate (same model)."
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each side")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens to generate")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="reuse this models folder (skips the import when the model is there); "
        "default: a temp folder",
    )
    parser.add_argument(
        "--prefix-cache-bytes", type=int, default=None, help="passed to exo; default exo's"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the node's temp folder")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker_main(args.worker)
        return 0

    messages = [{"role": "user", "content": args.prompt}]
    measurements: list[Measurement] = []
    with (
        start_node(args.models_dir, args.prefix_cache_bytes, args.keep_logs) as node,
        httpx.Client() as client,
    ):
        worker = MlxLmWorker(node.model_dir, node.data_dir / "cache")
        try:
            pid = runner_pid(node)
            print(
                f"OpenBLAS loaded: runner {pid is not None and openblas_mapped(pid)}, "
                f"mlx_lm worker {worker.openblas} (LD_PRELOAD={worker.ld_preload or 'unset'})"
            )
            processes = {"client": os.getpid(), "node": node.process.pid}
            processes["mlx_lm"] = worker.process.pid
            if pid is not None:
                processes["runner"] = pid
            meter = CpuMeter(processes)
            tokens = worker.prompt_tokens(messages)
            # Warm-up, not measured.
            stream_chat(client, node.base_url, messages, 8, stop=[])
            worker.generate(tokens, 8)
            for index in range(1, args.rounds + 1):
                api_first = index % 2 == 1
                for side in ("api", "mlx_lm") if api_first else ("mlx_lm", "api"):
                    meter.start()
                    if side == "api":
                        m, prompt_tokens = run_api(client, node, messages, args.max_tokens, index)
                        if prompt_tokens != len(tokens):
                            print(
                                f"warning: API prompt has {prompt_tokens} tokens, "
                                f"mlx_lm side {len(tokens)}"
                            )
                    else:
                        m = run_mlx_lm(worker, tokens, args.max_tokens, index)
                    m.cpu = meter.stop()
                    measurements.append(m)
                    report(m)
        finally:
            worker.stop()

    api = [m for m in measurements if m.side == "api"]
    ref = [m for m in measurements if m.side == "mlx_lm"]
    print()
    print(f"prompt {len(tokens)} tokens, {median([float(m.tokens) for m in api]):.0f} generated")
    print(
        f"same text on both sides: {all(a.text == r.text for a, r in zip(api, ref, strict=True))}"
    )
    ratio = summarize(f"medians over all {args.rounds} rounds", measurements)
    quiet = [m for m in measurements if m.quiet]
    if len(quiet) < len(measurements):
        summarize(
            f"medians over quiet runs only (other processes <= {QUIET_FOREIGN_CORES} cores)",
            quiet,
        )
    met = ratio >= TARGET_RATIO
    print(f"target {'met' if met else 'MISSED'} (all rounds)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
