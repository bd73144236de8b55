"""Model aliases: `--model-alias` rules (first match wins), the one served
model for unknown `claude-*` names, and served names never remapped."""

import pytest

from exo.api.model_alias import ModelAlias, parse_model_alias, resolve_model
from exo.shared.types.ids import ModelId

QWEN = ModelId("mlx-community/Qwen3-8B-4bit")
SMOL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
RULES = (
    ModelAlias(pattern="claude-haiku-*", model=SMOL),
    ModelAlias(pattern="claude-*", model=QWEN),
    ModelAlias(pattern="gpt-4o", model=SMOL),
)

# (name, rules, served, answer)
CASES: list[tuple[str, tuple[ModelAlias, ...], frozenset[ModelId], ModelId]] = [
    ("claude-opus-5-5", RULES, frozenset({QWEN, SMOL}), QWEN),
    ("claude-haiku-4-5", RULES, frozenset({QWEN, SMOL}), SMOL),  # first match wins
    ("gpt-4o", RULES, frozenset({QWEN, SMOL}), SMOL),
    (SMOL, (ModelAlias(pattern="*", model=QWEN),), frozenset({QWEN, SMOL}), SMOL),  # served: kept
    ("claude-opus-5-5", (), frozenset({QWEN}), QWEN),  # the one model served
    ("claude-opus-5-5", (), frozenset({QWEN, SMOL}), ModelId("claude-opus-5-5")),  # which one?
    ("gpt-4o", (), frozenset({QWEN}), ModelId("gpt-4o")),  # only claude-* by default
    ("Claude-Opus", (), frozenset({QWEN}), ModelId("Claude-Opus")),  # case-sensitive
    ("claude-opus-5-5", (), frozenset[ModelId](), ModelId("claude-opus-5-5")),
]


@pytest.mark.parametrize(("name", "rules", "served", "answer"), CASES)
def test_resolve(
    name: str, rules: tuple[ModelAlias, ...], served: frozenset[ModelId], answer: ModelId
) -> None:
    assert resolve_model(name, rules, served) == answer


@pytest.mark.parametrize(
    ("rule", "alias"),
    [
        ("claude-*=mlx-community/Qwen3-8B-4bit", ModelAlias(pattern="claude-*", model=QWEN)),
        (" gpt-4o = m ", ModelAlias(pattern="gpt-4o", model=ModelId("m"))),
    ],
)
def test_parse(rule: str, alias: ModelAlias) -> None:
    assert parse_model_alias(rule) == alias


@pytest.mark.parametrize("rule", ["claude-*", "=m", "claude-*=", ""])
def test_malformed_rules(rule: str) -> None:
    with pytest.raises(ValueError, match="PATTERN=MODEL"):
        parse_model_alias(rule)
