"""Where models live: one MLX model folder per model id under the models directory."""

import json
import re
from pathlib import Path

import platformdirs

from exo.shared.types.ids import ModelId

_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class InvalidModelId(ValueError):
    pass


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("exo"))


def validate_model_id(model_id: str) -> ModelId:
    """`org/name` or `name`; rejects path traversal and absolute paths."""
    if not _MODEL_ID.match(model_id) or ".." in model_id:
        raise InvalidModelId(
            f"invalid model id {model_id!r}: use 'name' or 'org/name' "
            "(letters, digits, '.', '_', '-')"
        )
    return ModelId(model_id)


def model_dir(models_dir: Path, model_id: ModelId) -> Path:
    return models_dir / model_id.replace("/", "--")


def context_length(model_path: Path) -> int:
    config = json.loads((model_path / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("max_seq_len") or 4096)


def sampling_defaults(model_path: Path) -> tuple[float, float]:
    """(temperature, top_p) from `generation_config.json`, else OpenAI's defaults."""
    path = model_path / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return float(config.get("temperature", 1.0)), float(config.get("top_p", 1.0))
