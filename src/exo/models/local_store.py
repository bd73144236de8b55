"""The models on this node: one folder per model in the models directory, plus
read-only model directories (`EXO_MODELS_READ_ONLY_DIRS`) that are used in
place and never written."""

import hashlib
import shutil
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from exo.models.builtin import DEFAULT_MODEL_ID, ensure_default_model
from exo.models.cards import CONFIG_FILE, card_from_folder
from exo.models.store import model_dir, validate_model_id
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import UnreadableModelFolder

# A file being downloaded; complete under its own name only once verified.
PARTIAL_SUFFIX = ".partial"
_HASH_CHUNK = 1 << 20


class ModelUnavailable(Exception):
    pass


@dataclass(frozen=True)
class LocalFile:
    path: str  # relative, '/'-separated
    size: int
    sha256: str


@dataclass(frozen=True)
class LocalModels:
    found: list[tuple[ModelCard, set[str]]]  # each model's card and complete files
    unreadable: tuple[UnreadableModelFolder, ...]


@dataclass
class ModelStore:
    models_dir: Path
    read_only_dirs: tuple[Path, ...] = ()
    # sha256 by (file, size, mtime): hashing a multi-GB file once is enough.
    _digests: dict[tuple[Path, int, int], str] = field(default_factory=dict)

    def writable_dir(self, model_id: ModelId) -> Path:
        """Where downloads of `model_id` go."""
        return model_dir(self.models_dir, model_id)

    def _folders(self, model_id: ModelId) -> list[Path]:
        """The model's folders here (with a config.json): the models directory's
        first, then the read-only ones in order."""
        roots = (self.models_dir, *self.read_only_dirs)
        return [
            model_dir(root, model_id)
            for root in roots
            if (model_dir(root, model_id) / CONFIG_FILE).is_file()
        ]

    def find(self, model_id: ModelId) -> Path | None:
        """The model's most complete folder here (ties: the models directory's)."""
        folders = self._folders(model_id)
        return max(folders, key=lambda f: len(_files_in(f)), default=None)

    def resolve(self, model_id: ModelId) -> Path:
        """The model's folder, importing the built-in model on first use."""
        if model_id == DEFAULT_MODEL_ID and self.find(model_id) is None:
            return ensure_default_model(self.models_dir)
        path = self.find(model_id)
        if path is None:
            raise ModelUnavailable(
                f"model {model_id!r} is not in {self.models_dir}; import one with "
                "'exo import-gguf PATH --model-id ID', or place it with POST /place_instance"
            )
        return path

    def complete_files(self, model_id: ModelId, files: set[str] | None = None) -> set[str]:
        """Relative paths of the model's complete files in the folder used for it:
        a read-only copy only if it has all of `files` (it cannot be completed),
        else the writable one."""
        folder = self.folder_with(model_id, files or set())
        return _files_in(folder or self.writable_dir(model_id))

    def folder_with(self, model_id: ModelId, files: set[str]) -> Path | None:
        """A model folder here that holds all of `files` (read-only ones first)."""
        for folder in sorted(self._folders(model_id), key=lambda f: f.parent == self.models_dir):
            if files <= _files_in(folder):
                return folder
        return None

    def folders_signature(self) -> frozenset[tuple[str, int]]:
        """The model folders here, each with its modification time: cheap, to
        notice folders added (or still being written) by."""
        signature: set[tuple[str, int]] = set()
        for root in (self.models_dir, *self.read_only_dirs):
            if root.is_dir():
                for folder in root.iterdir():
                    if (folder / CONFIG_FILE).is_file():
                        signature.add((folder.name, folder.stat().st_mtime_ns))
        return frozenset(signature)

    def local_models(self, only: Collection[str] | None = None) -> LocalModels:
        """Every model folder here that can be described (`only`: of these
        folder names), with its files, and those that cannot, with why: any
        failure to describe one (a malformed config, one no model has) skips
        that folder alone."""
        found: dict[ModelId, tuple[ModelCard, set[str]]] = {}
        unreadable: list[UnreadableModelFolder] = []
        for root in (self.models_dir, *self.read_only_dirs):
            if not root.is_dir():
                continue
            for folder in sorted(root.iterdir()):
                if not (folder / CONFIG_FILE).is_file():
                    continue
                if only is not None and folder.name not in only:
                    continue
                try:
                    model_id = validate_model_id(folder.name.replace("--", "/", 1))
                    if model_id in found:
                        continue
                    found[model_id] = (card_from_folder(model_id, folder), _files_in(folder))
                except Exception as error:  # a folder never stops the node (MemoryError too)
                    reason = f"{type(error).__name__}: {error}"
                    logger.warning(f"ignoring model folder {folder}: {reason}")
                    unreadable.append(UnreadableModelFolder(path=str(folder), reason=reason))
        return LocalModels(list(found.values()), tuple(unreadable))

    def file(self, model_id: ModelId, path: str) -> Path | None:
        """A complete file of the model here, or None; never outside its folder."""
        folder = self.find(model_id)
        return None if folder is None else _inside(folder, path)

    def list_files(self, model_id: ModelId) -> list[LocalFile]:
        """The model's complete files with sizes and hashes (hashes cached): the
        files `file` gives, so never a link's target outside the folder."""
        folder = self.find(model_id)
        if folder is None:
            return []
        inside = ((name, _inside(folder, name)) for name in sorted(_files_in(folder)))
        return [self._describe(name, path) for name, path in inside if path is not None]

    def _describe(self, name: str, path: Path) -> LocalFile:
        stat = path.stat()
        key = (path, stat.st_size, stat.st_mtime_ns)
        digest = self._digests.get(key)
        if digest is None:
            hasher = hashlib.sha256()
            with path.open("rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    hasher.update(chunk)
            digest = self._digests[key] = hasher.hexdigest()
        return LocalFile(path=name, size=stat.st_size, sha256=digest)

    def delete(self, model_id: ModelId) -> bool:
        """Delete the writable copy (read-only copies stay); False if none. A
        folder that is a symbolic link loses the link only: what it points to
        may be another model's or a shared disk's."""
        folder = self.writable_dir(model_id)
        if folder.is_symlink():
            folder.unlink()
            return True
        if not folder.exists():
            return False
        shutil.rmtree(folder)
        return True


def _inside(folder: Path, path: str) -> Path | None:
    """`folder`/`path` resolved, if it is a complete regular file inside `folder`
    (links followed, and refused when they lead out of it)."""
    candidate = (folder / path).resolve()
    if (
        not candidate.is_relative_to(folder.resolve())
        or not candidate.is_file()
        or candidate.name.endswith(PARTIAL_SUFFIX)
    ):
        return None
    return candidate


def _files_in(folder: Path) -> set[str]:
    if not folder.is_dir():
        return set()
    return {
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and not path.name.endswith(PARTIAL_SUFFIX)
    }
