"""A node's memory under steady agent-like load, without faults: one `exo`
node on the built-in model, 8 clients sending multi-turn chats (60 % streamed,
5 % of the streams closed early), the node process's RSS, open files and
threads sampled every 20 s. The soak (`soak.py`) measures the same with faults.

    uv run python bench/steady_rss.py --minutes 7
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from exo.models.builtin import DEFAULT_MODEL_ID

CLIENTS = 8
SAMPLE_SECONDS = 20


def wait_ready(base: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).json()["data"][0]["status"] == "ready":
                return
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError("the node did not become ready")


def client(base: str, seed: int, until: float, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    history: list[dict[str, str]] = []
    while time.monotonic() < until:
        if len(history) > 8:
            history = []
        history.append({"role": "user", "content": f"Tell me about number {rng.randint(0, 10**6)}"})
        body = {
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "system", "content": "You are terse. " * 20}, *history],
            "max_tokens": 8,
            "temperature": 0.7,
        }
        try:
            text = ""
            if rng.random() < 0.6:
                with httpx.stream(
                    "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60
                ) as response:
                    for n, line in enumerate(response.iter_lines()):
                        if n > 2 and rng.random() < 0.05:
                            break  # the client goes away mid-stream
                        if line.startswith("data: {"):
                            choices = json.loads(line[6:])["choices"]
                            if choices:
                                text += choices[0]["delta"].get("content") or ""
            else:
                answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
                text = answer.json()["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": text})
            counts["answered"] += 1
        except (httpx.HTTPError, KeyError, ValueError):
            counts["failed"] += 1
            history = []


def main() -> None:
    parser = argparse.ArgumentParser(
        description="A node's memory under steady load, without faults"
    )
    parser.add_argument("--minutes", type=float, default=7)
    parser.add_argument("--api-port", type=int, default=53100)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="exo-steady-"))
    base = f"http://127.0.0.1:{args.api_port}"
    command = [sys.executable, "-m", "exo.main", "--data-dir", str(data)]
    command += ["--api-port", str(args.api_port), "--host", "127.0.0.1"]
    with (data / "node.log").open("wb") as log:
        node = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(base)
        counts = {"answered": 0, "failed": 0}
        until = time.monotonic() + args.minutes * 60
        threads = [
            threading.Thread(target=client, args=(base, i, until, counts)) for i in range(CLIENTS)
        ]
        for thread in threads:
            thread.start()
        process, started = psutil.Process(node.pid), time.monotonic()
        while any(thread.is_alive() for thread in threads):
            rss = process.memory_info().rss / 2**20
            print(
                f"{time.monotonic() - started:5.0f} s  RSS {rss:6.1f} MiB  files "
                f"{process.num_fds()}  threads {process.num_threads()}  {counts}",
                flush=True,
            )
            time.sleep(SAMPLE_SECONDS)
    finally:
        node.terminate()
        node.wait(30)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
