"""Tokenizers for routing among replicas this node does not hold.

Cache-aware routing compares a request's prompt tokens with what each replica
cached, so the node that receives the request renders it with the model's
chat template. A node with no replica of the model (an API-only node, or one
holding a later rank of a split instance) keeps the model's tokenizer all the
same: its files (every file of the model but the weights, a few MB) come from
this node's own copy of the model or from a peer that has one, into the node's
data dir. It is loaded once the model has replicas elsewhere, in the
background: until then (and for requests with images, which would need the
model's image processor) such a node routes by load."""

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from loguru import logger

from exo.api.routing import serving_replicas
from exo.models.chat_tokenizer import ChatTokenizer, load_chat_tokenizer, longest_token_bytes
from exo.models.file_source import FileSource
from exo.models.local_store import ModelStore
from exo.models.store import context_length, model_dir
from exo.models.vision import ImagePrompts
from exo.shared.cluster_view import ClusterView
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import ModelId
from exo.worker.downloads.disk_space import DiskSpace
from exo.worker.downloads.transfer import download_files

POLL_SECONDS = 1.0  # how often the models that need a tokenizer are looked for
RETRY_SECONDS = 60.0  # after a tokenizer failed to come or load
ROUTING_READS_TEXT_ONLY = "a routing tokenizer reads text only"


@dataclass
class RoutingModel:
    """A model whose replicas are on other nodes, as rendering its prompts
    needs it (`generation.PromptModel`)."""

    model_id: ModelId
    tokenizer: ChatTokenizer
    context_length: int
    max_token_bytes: int
    images: ImagePrompts | str = ROUTING_READS_TEXT_ONLY
    last_prompt: tuple[ChatRequest, Any] | None = None


class RoutingTokenizers:
    """The routing models of this node: one for each model served by more than
    one replica, none of them this node's (`run` keeps them; `get` reads)."""

    def __init__(
        self,
        cluster: ClusterView,
        models: ModelStore,
        folder: Path,
        sources: Callable[[ModelId], Sequence[FileSource]],
        disk: DiskSpace,
    ) -> None:
        """`folder`: where fetched tokenizer files go (one folder per model);
        `sources`: where a model's files can be read (peers, then the hub)."""
        self.cluster = cluster
        self.models = models
        self.folder = folder
        self.sources = sources
        self.disk = disk
        self._loaded: dict[ModelId, RoutingModel] = {}
        self._failed_at: dict[ModelId, float] = {}

    def get(self, model_id: ModelId) -> RoutingModel | None:
        return self._loaded.get(model_id)

    def wanted(self) -> set[ModelId]:
        """The models with several replicas that serve, none of them here (nor
        placed here: a replica on its way brings its own tokenizer)."""
        state = self.cluster.state
        here = {
            i.model_id
            for i in state.instances.values()
            if i.ranks[0].node_id == self.cluster.node_id
        }
        models = {instance.model_id for instance in state.instances.values()} - here
        return {
            model_id
            for model_id in models
            if len(serving_replicas(state, model_id, self.cluster.node_id, None)) > 1
        }

    async def run(self) -> None:
        while True:
            await self.refresh()
            await anyio.sleep(POLL_SECONDS)

    async def refresh(self) -> None:
        """Load the tokenizers now wanted (those that failed lately aside) and
        drop the others, with their files."""
        wanted = self.wanted()
        for model_id in sorted(set(self._loaded) - wanted):
            del self._loaded[model_id]
            await anyio.to_thread.run_sync(self._forget_files, model_id)
        now = time.monotonic()
        for model_id in sorted(wanted - set(self._loaded)):
            if now - self._failed_at.get(model_id, -RETRY_SECONDS) < RETRY_SECONDS:
                continue
            try:
                self._loaded[model_id] = await self._load(model_id)
            except Exception as error:  # any failure: route by load, try again later
                self._failed_at[model_id] = time.monotonic()
                logger.warning(
                    f"no tokenizer of {model_id} to route its requests by cache "
                    f"({type(error).__name__}: {error}); they go by load, trying again "
                    f"in {RETRY_SECONDS:.0f}s"
                )

    async def _load(self, model_id: ModelId) -> RoutingModel:
        card = self.cluster.state.cards.get(model_id)
        if card is None:
            raise LookupError("the cluster has no card of it yet")
        files = set(card.metadata_files)
        path = await anyio.to_thread.run_sync(self.models.folder_with, model_id, files)
        where = "this node's copy"
        if path is None:
            sources = self.sources(model_id)
            path = model_dir(self.folder, model_id)
            await download_files(sources, model_id, files, path, lambda _: None, disk=self.disk)
            where = ", ".join(source.name for source in sources)
        tokenizer = await anyio.to_thread.run_sync(load_chat_tokenizer, path)
        logger.info(f"routing {model_id}'s requests by cache: its tokenizer from {where}")
        return RoutingModel(
            model_id,
            tokenizer,
            context_length(path),
            await anyio.to_thread.run_sync(longest_token_bytes, tokenizer),
        )

    def _forget_files(self, model_id: ModelId) -> None:
        shutil.rmtree(model_dir(self.folder, model_id), ignore_errors=True)
