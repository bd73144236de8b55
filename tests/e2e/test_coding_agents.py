"""The real clients, end to end: OpenCode (OpenAI-compatible provider) and Claude
Code (Anthropic Messages API), installed pinned from the npm registry, driving a
real node on the built-in model. The small model's answers do not matter; the
protocol does: each session must end normally with exo having served it."""

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess

pytestmark = pytest.mark.slow

OPENCODE = ("opencode-ai", "1.18.33", "opencode")
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.328", "claude")
CLIENT_SECONDS = 600
OPENCODE_TOOLS_OFF = ("bash", "write", "glob", "grep", "task", "todowrite", "webfetch", "skill")


def npm_tool(tmp_path_factory: pytest.TempPathFactory, package: tuple[str, str, str]) -> Path:
    """The client's executable, installed pinned into a scratch prefix."""
    name, version, executable = package
    if shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("npm is needed to install the coding agents")
        pytest.skip("npm is not installed")
    prefix = tmp_path_factory.mktemp("npm")
    subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), f"{name}@{version}"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return prefix / "node_modules" / ".bin" / executable


@pytest.fixture(scope="module")
def opencode(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_tool(tmp_path_factory, OPENCODE)


@pytest.fixture(scope="module")
def claude_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return npm_tool(tmp_path_factory, CLAUDE_CODE)


def scratch_project(root: Path) -> tuple[Path, Path]:
    """A throwaway home and a small project for the agent."""
    home, project = root / "home", root / "project"
    home.mkdir()
    project.mkdir()
    (project / "README.md").write_text("# Greeter\n\nA tool that prints hello.\n")
    (project / "greet.py").write_text('print("hello")\n')
    return home, project


def cache_stats(node: NodeProcess) -> dict[str, Any]:
    return httpx.get(f"{node.base_url}/v1/cache/stats", timeout=10).json()["data"][0]


def test_opencode_session_ends_normally_served_by_exo(
    node: NodeProcess, opencode: Path, tmp_path: Path
) -> None:
    home, project = scratch_project(tmp_path)
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "exo": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "exo",
                "options": {"baseURL": f"{node.base_url}/v1"},
                "models": {
                    DEFAULT_MODEL_ID: {"name": "SmolLM2", "limit": {"context": 8192, "output": 48}}
                },
            }
        },
        "model": f"exo/{DEFAULT_MODEL_ID}",
        # Two of its ten tools keep the prompt (~3k tokens) quick to prefill on a CPU.
        "tools": {tool: False for tool in OPENCODE_TOOLS_OFF},
    }
    config_dir = home / ".config" / "opencode"
    config_dir.mkdir(parents=True)
    (config_dir / "opencode.json").write_text(json.dumps(config))
    before = cache_stats(node)["lookups"]
    result = subprocess.run(
        [str(opencode), "run", "Read README.md and say what this project does."],
        cwd=project,
        env={**os.environ, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=CLIENT_SECONDS,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.strip()
    # The title request and at least one agent turn (10 tools in its prompt).
    assert cache_stats(node)["lookups"] >= before + 2


def test_claude_code_session_ends_normally_and_a_repeat_hits_the_cache(
    node: NodeProcess, claude_code: Path, tmp_path: Path
) -> None:
    home, project = scratch_project(tmp_path)
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": node.base_url,
        "ANTHROPIC_AUTH_TOKEN": "unused",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # Claude Code treats a reply cut at this limit as an error; the small model ends
        # its turns well before it, but would otherwise be allowed its whole context.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "300",
    }
    command = [
        str(claude_code), "-p", "Say hello in one short sentence.",
        "--output-format", "json", "--tools", "Read,Edit",
    ]  # fmt: skip
    outputs, reused = [], []
    for _ in range(2):
        before = cache_stats(node)["tokens_reused"]
        result = subprocess.run(
            command, cwd=project, env=env, capture_output=True, text=True, timeout=CLIENT_SECONDS
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        outputs.append(json.loads(result.stdout))
        reused.append(cache_stats(node)["tokens_reused"] - before)
    for output in outputs:
        assert output["type"] == "result" and output["is_error"] is False
        assert output["subtype"] == "success"
        assert isinstance(output["result"], str)
    # The repeated run's first request (system prompt, tools, environment: the
    # same text but for the billing header's hash) comes from the cache, and
    # exo reports it to the client as cache reads.
    repeat = outputs[1]["usage"]
    assert reused[1] >= 2000
    assert repeat["cache_read_input_tokens"] >= reused[1] * 0.9
