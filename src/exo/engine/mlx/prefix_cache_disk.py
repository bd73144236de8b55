"""The prefix cache's disk tier: entries kept across runner and node restarts.

One safetensors file per entry (mlx_lm's prompt-cache format: every layer's
state, with our metadata), in a folder named by `cache_namespace`: a digest of
the model's files, tokenizer, chat template and this runner's layers. A file is
served only when its metadata names the same namespace and format; a foreign,
stale or unreadable file is removed, never loaded.

The byte budget is the node's, for every folder under the root together: the
folders of the other models it serves, and of models and layer ranges it
served before (a re-placement moves a rank's layers, leaving its old folder).
Least recently used files go first, whichever folder holds them (another
runner's file removed under it is a miss there: a file that cannot be read is
never served), and a folder left empty goes with its last file.

A file is named by its entry's key (`entry_key`, a digest of its token ids), the
same on every pipeline rank: each rank keeps its own layers' share of an entry
under its own namespace, and the ranks agree on entries by their keys.
"""

import contextlib
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from loguru import logger
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from exo.engine.token_trie import TokenTrie, best_usable
from exo.shared.types.shard import LayerRange

FORMAT = "exo-prefix-cache-1"
# Files whose content decides what a cached KV means: weights (named and sized),
# config, tokenizer and chat template.
_IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf")

LayerCache = Any


def cache_namespace(
    model_dir: Path,
    layers: LayerRange | None,
    tensor_rank: tuple[int, int] | None = None,
    positions: bool = False,
) -> str:
    """A digest of what a cached KV depends on: model files, tokenizer, template,
    layers, which slice of the heads (`tensor_rank`: rank, ranks), and whether
    the caches end with tokens' position deltas (`positions`: a whole model with
    multimodal RoPE, `multimodal_rope.py`)."""
    h = hashlib.blake2b(FORMAT.encode(), digest_size=16)
    for path in sorted(model_dir.iterdir()):
        if path.name in _IDENTITY_FILES:
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        elif path.suffix in _WEIGHT_SUFFIXES:
            h.update(f"{path.name}\0{path.stat().st_size}".encode())
    h.update(str(layers).encode())
    if tensor_rank is not None:
        h.update(f"tensor rank {tensor_rank[0]} of {tensor_rank[1]}".encode())
    if positions:
        h.update(b"multimodal positions")
    return h.hexdigest()


def _read_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, read from its header alone."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 64 << 20:
            raise ValueError("implausible safetensors header")
        header = json.loads(f.read(size))
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ValueError("no metadata")
    return {str(k): str(v) for k, v in metadata.items()}


def entry_key(tokens: tuple[int, ...]) -> str:
    """The name of the file that holds the KV of `tokens` (32 hex digits)."""
    return hashlib.blake2b(json.dumps(tokens).encode(), digest_size=16).hexdigest()


def _file_id(key: str) -> int:
    return int.from_bytes(bytes.fromhex(key)[:8], "little")


@dataclass
class DiskEntry:
    path: Path
    tokens: tuple[int, ...]
    trimmable: bool
    nbytes: int
    last_used: int


class DiskTier:
    def __init__(self, root: Path, namespace: str, byte_budget: int) -> None:
        self.directory = root / namespace
        self.namespace = namespace
        self.byte_budget = byte_budget
        self._entries: dict[int, DiskEntry] = {}
        self._trie = TokenTrie()
        self._clock = 0
        # Files are written here, then renamed into `directory` once complete.
        self._partial = self.directory / "partial"
        self._partial.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _scan(self) -> None:
        files = sorted(self.directory.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                metadata = _read_metadata(path)
                if (metadata.get("0.format"), metadata.get("0.namespace")) != (
                    FORMAT,
                    self.namespace,
                ):
                    raise ValueError("written for another model, tokenizer or format")
                tokens = tuple(int(t) for t in json.loads(metadata["0.tokens"]))
                trimmable = metadata["0.trimmable"] == "1"
            except (OSError, ValueError, KeyError, struct.error) as error:
                logger.warning(f"prefix cache: removing {path.name} from disk: {error}")
                path.unlink(missing_ok=True)
                continue
            self._add(path, tokens, trimmable)
        for partial in self._partial.iterdir():
            partial.unlink(missing_ok=True)
        self._enforce_budget()

    def _add(self, path: Path, tokens: tuple[int, ...], trimmable: bool) -> None:
        file_id = _file_id(path.stem)
        if file_id in self._entries:
            self._trie.remove(file_id, self._entries[file_id].tokens)
        self._entries[file_id] = DiskEntry(
            path, tokens, trimmable, path.stat().st_size, self._tick()
        )
        self._trie.insert(file_id, tokens)

    def __contains__(self, tokens: tuple[int, ...]) -> bool:
        return any(length == len(tokens) for length, _ in self._trie.match(tokens).endings)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def best(self, tokens: tuple[int, ...]) -> tuple[int | None, int]:
        """The file that serves the most of `tokens` (all but the last one at most)."""
        return best_usable(
            self._trie.match(tokens),
            len(tokens) - 1,
            trimmable=lambda i: self._entries[i].trimmable,
            recency=lambda i: self._entries[i].last_used,
        )

    def key(self, file_id: int) -> str:
        return self._entries[file_id].path.stem

    def sequences(self) -> list[tuple[int, ...]]:
        """The token sequences kept, most recently used first."""
        entries = sorted(self._entries.values(), key=lambda e: e.last_used, reverse=True)
        return [entry.tokens for entry in entries]

    def keys(self) -> set[str]:
        """The keys of every file kept (`entry_key` of their tokens)."""
        return {entry.path.stem for entry in self._entries.values()}

    def find(self, key: str) -> int | None:
        """The file named `key`, if kept."""
        file_id = _file_id(key)
        entry = self._entries.get(file_id)
        return file_id if entry is not None and entry.path.stem == key else None

    def discard(self, key: str) -> None:
        """Remove the file named `key`, if kept."""
        file_id = self.find(key)
        if file_id is not None:
            self._remove(file_id)

    def retain(self, keys: set[str]) -> None:
        """Remove every file whose key is not in `keys`."""
        for file_id in [i for i, e in self._entries.items() if e.path.stem not in keys]:
            logger.info(f"prefix cache: removing {self.key(file_id)} from disk: not on every rank")
            self._remove(file_id)

    def load(self, file_id: int) -> tuple[tuple[int, ...], list[LayerCache]] | None:
        """The entry's tokens and layers; None (and the entry dropped) if its file
        is gone or unreadable."""
        entry = self._entries[file_id]
        if not entry.path.exists():  # another runner's budget took it: a miss, not damage
            logger.info(f"prefix cache: {entry.path.name} left the disk (the node's budget)")
            self._remove(file_id)
            return None
        try:
            layers = load_prompt_cache(str(entry.path))
            mx.eval([layer.state for layer in layers])  # read it all now: fail here, not later
        except Exception as error:  # any unreadable file is dropped, never served
            logger.warning(f"prefix cache: removing unreadable {entry.path.name}: {error}")
            self._remove(file_id)
            return None
        entry.last_used = self._tick()
        entry.path.touch()
        return entry.tokens, layers

    def save(self, tokens: tuple[int, ...], layers: list[LayerCache], trimmable: bool) -> None:
        if self.byte_budget <= 0 or tokens in self:
            return
        path = self.directory / f"{entry_key(tokens)}.safetensors"
        partial = self._partial / path.name
        metadata = {
            "format": FORMAT,
            "namespace": self.namespace,
            "tokens": json.dumps(list(tokens)),
            "trimmable": "1" if trimmable else "0",
        }
        try:
            # (Another runner may have removed this folder, emptied, for the budget.)
            self._partial.mkdir(parents=True, exist_ok=True)
            save_prompt_cache(str(partial), layers, metadata)
            partial.rename(path)  # a crash mid-write leaves a partial file, removed at start
        except OSError as error:
            logger.warning(f"prefix cache: could not write to disk: {error}")
            partial.unlink(missing_ok=True)
            return
        if trimmable:  # it holds every shorter cut-back-able file on its path
            for _, shorter in self._trie.match(tokens).endings:
                if self._entries[shorter].trimmable:
                    self._remove(shorter)
        self._add(path, tokens, trimmable)
        self._enforce_budget()

    def _remove(self, file_id: int) -> None:
        entry = self._entries.pop(file_id)
        self._trie.remove(file_id, entry.tokens)
        entry.path.unlink(missing_ok=True)

    def _enforce_budget(self) -> None:
        """Within the budget, with the other folders' files (see the module docstring)."""
        others = self._other_files()
        total = self.nbytes + sum(size for _, _, size in others)
        if total <= self.byte_budget:
            return
        # Oldest first: another folder's by its file's time (touched when used),
        # this one's by use (after the files it was started with, oldest first).
        mtimes: dict[int, float] = {}
        for file_id, entry in list(self._entries.items()):
            try:
                mtimes[file_id] = entry.path.stat().st_mtime
            except FileNotFoundError:  # another runner removed it for the budget
                total -= entry.nbytes
                self._remove(file_id)
        mine = sorted(mtimes, key=lambda i: self._entries[i].last_used)
        queue = sorted(
            [(mtime, None, path, size) for mtime, path, size in others]
            + [(mtimes[i], i, self._entries[i].path, self._entries[i].nbytes) for i in mine],
            key=lambda item: item[0],
        )
        for _, file_id, path, size in queue:
            if total <= self.byte_budget:
                break
            total -= size
            if file_id is not None:
                self._remove(file_id)
            else:
                logger.info(f"prefix cache: removing {path.parent.name}/{path.name} (disk budget)")
                path.unlink(missing_ok=True)
                for empty in (path.parent / "partial", path.parent):  # its folder, once empty
                    with contextlib.suppress(OSError):
                        empty.rmdir()

    def _other_files(self) -> list[tuple[float, Path, int]]:
        """(modified time, path, bytes) of every entry file under the root that
        this tier has not indexed: the other folders', and those another runner
        wrote to this folder (two runners of one model, while it moves)."""
        files: list[tuple[float, Path, int]] = []
        indexed = {entry.path for entry in self._entries.values()}
        root = self.directory.parent
        for folder in root.iterdir() if root.is_dir() else ():
            if not folder.is_dir():
                continue
            for path in folder.glob("*.safetensors"):
                if path in indexed:
                    continue
                with contextlib.suppress(OSError):  # gone meanwhile
                    stat = path.stat()
                    files.append((stat.st_mtime, path, stat.st_size))
        return files
