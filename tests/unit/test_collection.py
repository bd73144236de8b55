"""The suite collects and runs where numba cannot be imported, as on a Mac (numba
is a Linux-only dependency): the tests of the CPU decode kernel skip with their
reason, and the rest of what imports the kernel's modules passes.

numba is hidden from a child pytest by a `sitecustomize` on its `PYTHONPATH`
that makes `import numba` raise `ImportError` (in that process and in any Python
process it starts). To run the whole suite so here:
`PYTHONPATH=<dir with that sitecustomize.py> uv run pytest`.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HIDE_NUMBA = 'import sys\n\nsys.modules["numba"] = None  # `import numba` raises ImportError\n'

# `test_batch.py` decodes with the real model: ~8 minutes on a 2-core machine
# without the kernel. Its tests of the kernel's facts (which skip here) and two
# cheap ones that load and batch through the no-kernel path are enough here.
BATCH_TESTS = "model_batches or new_prompt_is_read or small_batch_on_the_cpu"


@pytest.fixture
def without_numba(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes cannot import numba."""
    shim = tmp_path / "without-numba"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HIDE_NUMBA)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    probe = "try:\n    import numba\nexcept ImportError:\n    print('hidden')"
    hidden = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert hidden.stdout.strip() == "hidden", hidden.stdout + hidden.stderr
    return env


def pytest_run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_suite_collects_without_numba(without_numba: dict[str, str]) -> None:
    collected = pytest_run(["--collect-only", "-q", "tests"], without_numba)
    output = collected.stdout + collected.stderr
    assert collected.returncode == 0, output[-4000:]
    summary = output.strip().splitlines()[-1]
    assert "collected" in summary and "error" not in summary, summary
    # The kernel's test modules are collected, not dropped.
    assert "tests/unit/test_cpu_few_rows.py::test_without_numba_nothing_is_swapped" in output
    assert "tests/unit/test_batch.py::test_the_model_batches" in output


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """Each test's (outcome, message) from a JUnit XML report: passed, skipped, failed."""
    found: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("skipped", "failure", "error"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                message = child.get("message") or child.text or ""
        found[name] = (outcome, message)
    return found


def test_the_kernel_s_tests_skip_and_the_rest_pass_without_numba(
    without_numba: dict[str, str], tmp_path: Path
) -> None:
    report = tmp_path / "report.xml"
    ran = pytest_run(
        [
            f"--junitxml={report}",
            "tests/unit/test_cpu_few_rows.py",
            "tests/unit/test_batch.py",
            "-k",
            f"test_cpu_few_rows or ({BATCH_TESTS})",
        ],
        without_numba,
    )
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    results = outcomes(report)
    failed = {name: why for name, (outcome, why) in results.items() if outcome == "failed"}
    assert not failed
    few_rows = {n: r for n, r in results.items() if n.startswith("tests.unit.test_cpu_few_rows")}
    batch = {n: r for n, r in results.items() if n.startswith("tests.unit.test_batch")}
    # Without the kernel nothing is swapped; every test that needs it skips, saying why
    # (or, off the CPU backend, that it is the CPU backend's).
    assert few_rows.pop("tests.unit.test_cpu_few_rows.test_without_numba_nothing_is_swapped") == (
        "passed",
        "",
    )
    kernel_tests = {n: r for n, r in batch.items() if "small_batch_on_the_cpu" in n}
    assert len(few_rows) > 20 and len(kernel_tests) == 3
    for name, (outcome, why) in {**few_rows, **kernel_tests}.items():
        assert outcome == "skipped" and ("numba" in why or "CPU backend" in why), (name, why)
    # The model loads and batches without the kernel.
    others = {n: outcome for n, (outcome, _) in batch.items() if n not in kernel_tests}
    assert others and set(others.values()) == {"passed"}, others
