"""Where models live: one MLX model folder per model id under the models directory."""

import json
from pathlib import Path

import platformdirs

from exo.models.cards import CONFIG_FILE, context_length_from_config
from exo.shared.types.ids import InvalidModelId as InvalidModelId
from exo.shared.types.ids import ModelId
from exo.shared.types.ids import validate_model_id as validate_model_id


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("exo"))


def model_dir(models_dir: Path, model_id: ModelId) -> Path:
    # Checked again here: `ModelId(text)` casts unchecked, and this is a path.
    return models_dir / validate_model_id(model_id).replace("/", "--")


def context_length(model_path: Path) -> int:
    """The context length of the model in `model_path`, by the card's rule."""
    return context_length_from_config(json.loads((model_path / CONFIG_FILE).read_text()))
