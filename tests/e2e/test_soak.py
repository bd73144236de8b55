"""The soak (`bench/soak.py`) for 5 minutes, a fault every 30 s (each of its
five kinds twice): three real nodes, two models (one split), eight agent-like
clients of the official `openai` client. The targets of the 30-minute run are
held, but for RSS: a process's first minutes are its warm-up (its caches, a
master's state), so growth from minute 0.5 is held to 50 %, which a leak per
request or per fault would still cross."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MINUTES = 5
FAULT_EVERY_SECONDS = 30
FAULT_KINDS = ("kill a runner", "kill a worker node", "kill the master", "SIGSTOP a node")
# A disk is filled where the soak can give each node a small tmpfs (root).
FAULT_KINDS += ("fill a disk",) if os.geteuid() == 0 else ()

pytestmark = [pytest.mark.slow, pytest.mark.runs_first]


def test_five_minutes_of_agents_under_a_fault_every_30_s_meet_the_soak_s_targets(
    models_dir: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "bench" / "soak.py"),
            "--minutes", str(MINUTES),
            "--fault-every-seconds", str(FAULT_EVERY_SECONDS),
            "--steady-minute", "0.5",
            "--rss-target", "0.5",
            "--models-dir", str(models_dir),
            "--logs-dir", str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=MINUTES * 60 + 600,
    )  # fmt: skip
    report = done.stdout[done.stdout.find("\nsoak:") :]
    assert done.returncode == 0, f"{report}\n{done.stderr[-3000:]}"
    # Traffic and faults really happened: the targets are not met by default.
    for kind in FAULT_KINDS:
        faults = re.search(rf"^  {kind}: (\d+)$", report, re.MULTILINE)
        assert faults and int(faults[1]) >= 1, f"no {kind!r} fault:\n{report}"
    sent = re.search(r"^requests: (\d+) sent, (\d+) answered", report, re.MULTILINE)
    assert sent and int(sent[2]) >= 100, report
    assert "met    failures without a reason the client can act on == 0" in report
    assert "met    lost events == 0" in report
