"""Which served model answers a request that names a model by another name.

Clients built for one vendor send that vendor's model names: Claude Code asks
for `claude-opus-…`, which no exo node serves. `--model-alias PATTERN=MODEL`
rules (fnmatch patterns, e.g. `claude-*=mlx-community/Qwen3-8B-4bit`) map such
names; the first matching rule wins. Without a matching rule, a `claude-*` name
goes to the one model served when exactly one is. A served model's own name is
never mapped, and a name nothing maps is returned as is (the caller reports it
as not served). The reply names the model that answered.
"""

from collections.abc import Collection, Sequence
from fnmatch import fnmatchcase

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.ids import ModelId

# Names of Anthropic's models: Claude Code and the Anthropic SDKs send these.
CLAUDE_MODEL_PATTERN = "claude-*"


class ModelAlias(FrozenModel):
    pattern: str  # fnmatch, case-sensitive
    model: ModelId


def parse_model_alias(rule: str) -> ModelAlias:
    """`PATTERN=MODEL` (the `--model-alias` option's value); ValueError when malformed."""
    pattern, separator, model = rule.partition("=")
    if not separator or not pattern.strip() or not model.strip():
        raise ValueError(f"a model alias is PATTERN=MODEL (e.g. claude-*=MODEL), not {rule!r}")
    return ModelAlias(pattern=pattern.strip(), model=ModelId(model.strip()))


def resolve_model(name: str, aliases: Sequence[ModelAlias], served: Collection[ModelId]) -> ModelId:
    """The model that answers a request for `name`, given the models served in the cluster."""
    if name in served:
        return ModelId(name)
    for alias in aliases:
        if fnmatchcase(name, alias.pattern):
            return alias.model
    if len(served) == 1 and fnmatchcase(name, CLAUDE_MODEL_PATTERN):
        return next(iter(served))
    return ModelId(name)
