"""Find a model's folder on this node."""

from pathlib import Path

from exo.models.builtin import DEFAULT_MODEL_ID, ensure_default_model
from exo.models.store import model_dir
from exo.shared.types.ids import ModelId


class ModelUnavailable(Exception):
    pass


def resolve_model(models_dir: Path, model_id: ModelId) -> Path:
    """The model's folder, importing the built-in model on first use."""
    if model_id == DEFAULT_MODEL_ID:
        return ensure_default_model(models_dir)
    path = model_dir(models_dir, model_id)
    if not (path / "config.json").exists():
        raise ModelUnavailable(
            f"model {model_id!r} is not in {models_dir}; "
            "import one with 'exo import-gguf PATH --model-id ID'"
        )
    return path
