"""Decode speed with a JSON schema enforced vs unconstrained, same model, same run.

One process (re-started with exo's runner environment, so OpenBLAS is preloaded
as for a runner) loads the built-in SmolLM2-135M-Instruct with exo's
`load_for_inference` (float32) and decodes greedily with mlx_lm's
`generate_step` from the same chat prompt:

* unconstrained: no logits processor; EOS is ignored, so it runs to `--max-tokens`;
* constrained: `compile_constraint(tokenizer, JsonSchema(...)).matcher()` as the
  logits processor. The schema asks for at least 40 lighthouse records (strings,
  bounded integers, nested objects), more than `--max-tokens` can hold, so the
  grammar never lets it stop early either.

Speed = (tokens - 1) / (time of the last token - time of the first). The sides
alternate for `--rounds` rounds (order swapped every round) after one unmeasured
warm-up each. The matcher's own time per token (consume the last token, fill the
mask, build the masking ops) is measured around each call, after the wait for
the previous token, which is the step's own. Target: constrained / unconstrained >= 0.9.

    uv run python bench/constrained_decoding.py
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from exo_node import CpuMeter
from mlx_lm.generate import generate_step

from exo.engine.constraint_grammar import check_constraint
from exo.engine.mlx.constrained import compile_constraint
from exo.engine.mlx.load import load_for_inference
from exo.models.builtin import ensure_default_model
from exo.shared.types.constraints import JsonSchema, ToolCalls, ToolSpec
from exo.worker.runner.blas import openblas_library, runner_environment

TARGET_RATIO = 0.9
_REEXEC_MARK = "EXO_BENCH_RUNNER_ENV"
PROMPT = (
    "List 40 famous lighthouses of the world as JSON: for each, its name, country, "
    "height in metres and the year it was built."
)
SCHEMA = {
    "type": "object",
    "properties": {
        "lighthouses": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "country": {"type": "string", "maxLength": 30},
                    "height_m": {"type": "integer", "minimum": 1, "maximum": 200},
                    "built": {"type": "integer", "minimum": 1000, "maximum": 2025},
                },
                "required": ["name", "country", "height_m", "built"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["lighthouses"],
    "additionalProperties": False,
}


def agent_tools() -> ToolCalls:
    """Ten tools shaped like a coding agent's (OpenCode sends ~21k characters of them)."""

    def tool(name: str, properties: dict[str, Any], required: list[str]) -> ToolSpec:
        described = {
            key: {**value, "description": f"The {key} of {name}. " * 30}
            for key, value in properties.items()
        }
        schema = {
            "type": "object",
            "properties": described,
            "required": required,
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        }
        return ToolSpec(name=name, parameters=schema)

    text, number, flag = {"type": "string"}, {"type": "number"}, {"type": "boolean"}
    todo = {
        "type": "object",
        "properties": {
            "content": text,
            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
            "priority": {"type": "string", "enum": ["high", "medium", "low"]},
            "id": text,
        },
        "required": ["content", "status", "priority", "id"],
        "additionalProperties": False,
    }
    tools = (
        tool("bash", {"command": text, "timeout": number, "description": text}, ["command"]),
        tool("read", {"filePath": text, "offset": number, "limit": number}, ["filePath"]),
        tool("write", {"content": text, "filePath": text}, ["content", "filePath"]),
        tool(
            "edit",
            {"filePath": text, "oldString": text, "newString": text, "replaceAll": flag},
            ["filePath", "oldString", "newString"],
        ),
        tool("glob", {"pattern": text, "path": text}, ["pattern"]),
        tool("grep", {"pattern": text, "path": text, "include": text}, ["pattern"]),
        tool("list", {"path": text, "ignore": {"type": "array", "items": text}}, []),
        tool("todowrite", {"todos": {"type": "array", "items": todo}}, ["todos"]),
        tool(
            "webfetch",
            {"url": text, "format": {"type": "string", "enum": ["text", "markdown", "html"]}},
            ["url", "format"],
        ),
        tool("task", {"description": text, "prompt": text, "subagent_type": text}, ["prompt"]),
    )
    return ToolCalls(tools=tools, prefix="<tool_call>\n", suffix="\n</tool_call>", parallel=True)


@dataclass
class Run:
    side: str
    tokens: list[int]
    first: float
    last: float
    mask_seconds: list[float] = field(default_factory=list)  # matcher time per call
    foreign_cores: float = 0.0  # other processes' average load during the run

    @property
    def tokens_per_second(self) -> float:
        span = self.last - self.first
        return (len(self.tokens) - 1) / span if span > 0 else float("nan")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _with_runner_environment() -> None:
    """Re-start this script with OpenBLAS preloaded, as the worker starts a runner."""
    library = openblas_library()
    if library is None or os.environ.get(_REEXEC_MARK):
        return
    env = runner_environment(Path(tempfile.gettempdir()) / "exo-constrained-bench")
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--models-dir", type=Path, help="a folder holding the imported model")
    args = parser.parse_args()
    _with_runner_environment()

    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="exo-bench-models-"))
    model, tokenizer = load_for_inference(ensure_default_model(models_dir))
    maps = Path("/proc/self/maps")
    openblas = maps.exists() and "libopenblas" in maps.read_text()
    print(f"OpenBLAS loaded: {openblas}")

    constraint = JsonSchema(json_schema=SCHEMA)
    start = time.perf_counter()
    compiled = compile_constraint(tokenizer, constraint)
    first_compile = time.perf_counter() - start
    start = time.perf_counter()
    compile_constraint(tokenizer, constraint)
    cached_compile = time.perf_counter() - start
    start = time.perf_counter()
    compiled.matcher()
    new_matcher = time.perf_counter() - start
    print(
        f"compile (incl. the tokenizer's one-time llguidance view): {first_compile * 1e3:.0f} ms; "
        f"cached: {cached_compile * 1e6:.0f} us; new matcher per request: {new_matcher * 1e6:.0f} us"
    )

    tools = agent_tools()
    size = sum(len(json.dumps(t.parameters)) for t in tools.tools)
    start = time.perf_counter()
    check_constraint(tools)
    checked = time.perf_counter() - start
    start = time.perf_counter()
    compile_constraint(tokenizer, tools)
    tools_compile = time.perf_counter() - start
    print(
        f"{len(tools.tools)} agent tools ({size:,} characters of schemas), parallel calls: "
        f"check_constraint {checked * 1e3:.1f} ms, compile {tools_compile * 1e3:.1f} ms"
    )

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    prompt = mx.array(tokenizer.encode(text, add_special_tokens=False))

    def decode(side: str) -> Run:
        run = Run(side, [], 0.0, 0.0)
        processors: list[Callable[[mx.array, mx.array], mx.array]] = []
        if side == "json_schema":
            matcher = compiled.matcher()

            def timed(tokens: mx.array, logits: mx.array) -> mx.array:
                # As the matcher does: start the forward pass, then wait for the
                # previous token here, outside the timing.
                mx.async_eval(logits)
                tokens[-1].item()
                began = time.perf_counter()
                masked = matcher(tokens, logits)
                run.mask_seconds.append(time.perf_counter() - began)
                return masked

            processors.append(timed)
        meter = CpuMeter({"bench": os.getpid()})
        meter.start()
        began = time.perf_counter()
        for token, _ in generate_step(
            prompt, model, max_tokens=args.max_tokens, logits_processors=processors
        ):
            now = time.perf_counter() - began
            if not run.tokens:
                run.first = now
            run.tokens.append(token)
            run.last = now
        run.foreign_cores = meter.stop().foreign_cores
        return run

    sides = ["unconstrained", "json_schema"]
    for side in sides:
        decode(side)  # warm-up
    runs: list[Run] = []
    for round_index in range(args.rounds):
        for side in sides if round_index % 2 == 0 else sides[::-1]:
            run = decode(side)
            runs.append(run)
            line = (
                f"round {round_index + 1} {side:>13}: {run.tokens_per_second:6.2f} tok/s, "
                f"other processes {run.foreign_cores:.2f} cores"
            )
            if run.mask_seconds:
                line += (
                    f", mask per token median {statistics.median(run.mask_seconds) * 1e6:.0f} us"
                    f" p90 {_percentile(run.mask_seconds, 0.9) * 1e6:.0f} us"
                )
            print(line, flush=True)

    constrained = [r for r in runs if r.side == "json_schema"]
    output = tokenizer.decode(constrained[-1].tokens)
    print(f"constrained output starts: {output[:160]!r}")
    speed = {
        side: statistics.median(r.tokens_per_second for r in runs if r.side == side)
        for side in sides
    }
    masks = [s for r in constrained for s in r.mask_seconds]
    ratio = speed["json_schema"] / speed["unconstrained"]
    print(
        f"median tok/s: unconstrained {speed['unconstrained']:.2f}, "
        f"json_schema {speed['json_schema']:.2f}; ratio {ratio:.3f} (target >= {TARGET_RATIO})"
    )
    print(
        f"mask build per token over {len(masks)} steps: median {statistics.median(masks) * 1e6:.0f} us, "
        f"mean {statistics.mean(masks) * 1e6:.0f} us, p90 {_percentile(masks, 0.9) * 1e6:.0f} us, "
        f"max {max(masks) * 1e6:.0f} us"
    )
    return 0 if ratio >= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
