"""Cards of models no node has yet: built from the hub repo's `config.json`,
`model.safetensors.index.json` and file listing, without the weights."""

import json
from typing import Any

from exo.models.cards import CONFIG_FILE, INDEX_FILE, MAX_METADATA_BYTES, card_from_config
from exo.models.file_source import DownloadError, FileSource
from exo.models.weight_files import is_metadata_file
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import ModelCard


async def _read_json(source: FileSource, model_id: ModelId, path: str) -> Any:
    data = bytearray()
    async for chunk in source.read(model_id, path, 0):
        data += chunk
        if len(data) > MAX_METADATA_BYTES:
            raise DownloadError(f"{model_id}: {path} is larger than {MAX_METADATA_BYTES} bytes")
    try:
        return json.loads(data)
    except ValueError as error:
        raise DownloadError(f"{model_id}: {path} is not valid JSON: {error}") from error


async def card_from_source(source: FileSource, model_id: ModelId) -> ModelCard:
    """Raises `SourceUnavailable` (no such repo), `DownloadError` or `ModelCardError`."""
    files = await source.list_files(model_id)
    names = {f.path for f in files}
    if CONFIG_FILE not in names:
        raise DownloadError(f"{model_id} has no {CONFIG_FILE}: not a model repository")
    config = await _read_json(source, model_id, CONFIG_FILE)
    index = await _read_json(source, model_id, INDEX_FILE) if INDEX_FILE in names else None
    return card_from_config(
        model_id,
        config,
        index,
        file_sizes={f.path: f.size for f in files},
        metadata_files=sorted(name for name in names if "/" not in name and is_metadata_file(name)),
    )
