"""The worker: fetches the files of this node's ranks, runs a runner for every
rank the cluster state places on this node, and stops what is no longer needed
(see `plan`)."""

import time
from collections.abc import Callable, Collection
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
from loguru import logger

from exo.cluster.link import ClusterLink
from exo.models.builtin import DEFAULT_MODEL_ID
from exo.models.chat_tokenizer import ChatTokenizer, load_chat_tokenizer, longest_token_bytes
from exo.models.draft_models import draft_refusal
from exo.models.file_source import DownloadError, FileSource
from exo.models.local_store import ModelStore
from exo.models.sampling_defaults import read_sampling_defaults
from exo.models.store import context_length
from exo.models.vision import image_prompts_for
from exo.shared.replica_reports import CacheReports
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.events import (
    DownloadProgressed,
    DownloadRemoved,
    ModelCardPublished,
    ModelFoldersUnreadable,
    RunnerStatusChanged,
)
from exo.shared.types.ids import InstanceId, ModelId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.state import Instance
from exo.worker.downloads.disk_space import DiskSpace
from exo.worker.downloads.sources import model_sources
from exo.worker.downloads.transfer import download_files
from exo.worker.plan import (
    CancelDownload,
    LocalFacts,
    StartDownload,
    StartRunner,
    StopRunner,
    needed_files,
    plan,
    stop_reason,
    wants_standby,
)
from exo.worker.runner.blas import runner_environment
from exo.worker.runner.standby import standby_command
from exo.worker.runner.supervisor import SHUTDOWN_GRACE_SECONDS, RunnerSupervisor
from exo.worker.served_model import ServedModel

# Re-plan at least this often even without events (bounded waits).
REPLAN_SECONDS = 5.0
# A runner process is started ahead (`_tend_standby`) only this long after this
# node last started a runner (its imports would slow the new runner's first
# requests), and stopped once none has been wanted for this long.
STANDBY_DELAY_SECONDS = 10.0
# How long deleting a model's files waits for its cancelled download to end.
DOWNLOAD_STOP_SECONDS = 10.0


@dataclass
class _Running:
    instance: Instance
    served: ServedModel | None  # None: it could not start (the state says why)
    runner: RunnerSupervisor | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


@dataclass
class _Download:
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: anyio.Event = field(default_factory=anyio.Event)  # its task is over


class Worker:
    def __init__(
        self,
        link: ClusterLink,
        models: ModelStore,
        cache_dir: Path,
        prefix_cache_bytes: int,
        secret: str,
        on_ready: Callable[[ModelId], None] = lambda model_id: None,
        stale: frozenset[InstanceId] = frozenset(),
        prefix_cache_disk_bytes: int = 0,
        disk_space: DiskSpace | None = None,
        speculation: bool = True,
        draft_model: ModelId | None = None,
    ) -> None:
        self.link = link
        # Every download of this node reserves its space here (a floor stays free).
        self.disk_space = disk_space or DiskSpace()
        self.models = models
        self.cache_dir = cache_dir
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefix_cache_disk_bytes = prefix_cache_disk_bytes
        self.speculation = speculation
        # `--draft-model`: drafts for the models this node serves whole, where it may.
        self.draft_model = draft_model
        self.secret = secret
        self.on_ready = on_ready
        self.stale = stale
        # The models this node serves (its rank-0 runners), by id: the API reads it.
        self.served: dict[ModelId, ServedModel] = {}
        self._running: dict[InstanceId, _Running] = {}
        self._cache_reports = CacheReports(link)
        self._announced: set[InstanceId] = set()
        # Rank-0 runners that are ready before the API can take their requests
        # (its tokenizer still loading): their "ready" goes out once it can.
        self._ready_held: set[InstanceId] = set()
        self._downloads: dict[ModelId, _Download] = {}
        self._cancelling: set[ModelId] = set()
        self._have: dict[ModelId, set[str]] = {}
        self._download_failed: set[InstanceId] = set()
        self._sources_used: dict[ModelId, str] = {}  # where each model's last bytes came from
        # A runner process started ahead, for the next runner (see `standby.py`).
        self._standby: anyio.abc.Process | None = None
        self._runner_started_at = -STANDBY_DELAY_SECONDS
        self._unwanted_since: float | None = None

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            try:
                while True:
                    await self._reconcile(group)
                    await self._tend_standby()
                    await self.link.wait_until(self.link.state.last_idx + 1, REPLAN_SECONDS)
            finally:
                with anyio.CancelScope(shield=True):
                    for instance_id in list(self._running):
                        await self._stop(instance_id)
                    await self._close_standby()
                for download in self._downloads.values():
                    download.scope.cancel()

    async def publish_local_models(self, only: Collection[str] | None = None) -> None:
        self._have.update(await publish_local_models(self.link, self.models, only))

    def _facts(self) -> LocalFacts:
        return LocalFacts(
            running=frozenset(self._running),
            have_files=self._have,
            downloading=frozenset(self._downloads),
            cancelling=frozenset(self._cancelling),
            download_failed=frozenset(self._download_failed),
            stale=self.stale,
        )

    async def _reconcile(self, group: anyio.abc.TaskGroup) -> None:
        state = self.link.state
        self._download_failed.intersection_update(state.instances)  # deleted ones are done
        bound = 2 * (len(state.instances) + len(self._running) + len(self._downloads)) + 1
        for _ in range(bound):
            action = plan(self.link.node_id, self.link.state, self._facts())
            match action:
                case StartRunner():
                    await self._start(action.instance, action.rank, group)
                case StopRunner():
                    stopped = self._running[action.instance_id].instance
                    await self._stop(action.instance_id, stop_reason(self.link.state, stopped))
                case StartDownload():
                    self._start_download(action, group)
                case CancelDownload():
                    logger.info(f"download of {action.model_id} no longer needed: cancelled")
                    # Kept listed until its task has ended (a thread may still be
                    # writing the partial): no new download of it starts before.
                    self._downloads[action.model_id].scope.cancel()
                    self._cancelling.add(action.model_id)
                    self._publish_progress(
                        DownloadProgress(
                            model_id=action.model_id,
                            status="cancelled",
                            files_total=0,
                            files_done=0,
                            bytes_total=0,
                            bytes_done=0,
                            have_files=tuple(sorted(self._have.get(action.model_id, ()))),
                        )
                    )
                case None:
                    return

    # -- downloads -----------------------------------------------------------------

    def _publish_progress(self, progress: DownloadProgress) -> None:
        if progress.source:
            self._sources_used[progress.model_id] = progress.source
        self.link.publish(DownloadProgressed(node_id=self.link.node_id, progress=progress))

    def _sources(self, model_id: ModelId) -> list[FileSource]:
        return model_sources(
            self.link.state, model_id, self.link.node_id, self.secret, self.link.certificate
        )

    def _start_download(self, action: StartDownload, group: anyio.abc.TaskGroup) -> None:
        download = _Download()
        self._downloads[action.model_id] = download
        group.start_soon(self._download, action, download)

    async def _download(self, action: StartDownload, download: _Download) -> None:
        model_id = action.model_id
        wanted = set(action.files) if action.files is not None else None
        with download.scope:
            try:
                if model_id == DEFAULT_MODEL_ID:
                    # Built in: imported from the local GGUF, never fetched.
                    await anyio.to_thread.run_sync(self.models.resolve, model_id)
                elif wanted is None or self.models.folder_with(model_id, wanted) is None:
                    sources = self._sources(model_id)
                    logger.info(
                        f"downloading {len(wanted) if wanted else 'all'} files of {model_id} "
                        f"from {', '.join(s.name for s in sources) or 'nowhere'}"
                    )
                    await download_files(
                        sources,
                        model_id,
                        wanted,
                        self.models.writable_dir(model_id),
                        self._publish_progress,
                        disk=self.disk_space,
                    )
                have = await anyio.to_thread.run_sync(self.models.complete_files, model_id, wanted)
                self._have[model_id] = have
                self._publish_progress(
                    _complete(model_id, have, self._sources_used.get(model_id, "local"))
                )
                if model_id not in self.link.state.cards:
                    await self.publish_local_models()
            except Exception as error:  # any failure to fetch is the instance's failure
                reason = (
                    str(error)
                    if isinstance(error, DownloadError)
                    else f"{type(error).__name__}: {error}"
                )
                logger.error(f"download of {model_id} failed: {reason}")
                self._download_failed.add(action.instance_id)
                # The instance cannot start here: its rank fails, visibly, and the
                # master places a multi-rank instance again.
                self.link.publish(
                    RunnerStatusChanged(
                        instance_id=action.instance_id,
                        node_id=self.link.node_id,
                        status="failed",
                        error=f"download failed: {reason}",
                    )
                )
                self._publish_progress(
                    DownloadProgress(
                        model_id=model_id,
                        status="failed",
                        files_total=len(wanted or ()),
                        files_done=0,
                        bytes_total=0,
                        bytes_done=0,
                        error=reason,
                        have_files=tuple(sorted(self._have.get(model_id, ()))),
                    )
                )
            finally:
                if self._downloads.get(model_id) is download:
                    del self._downloads[model_id]
                    self._cancelling.discard(model_id)
                download.ended.set()

    async def delete_model_files(self, model_id: ModelId) -> bool:
        """Delete this node's writable copy of a model; False when there is none."""
        download = self._downloads.get(model_id)
        if download is not None:
            download.scope.cancel()
            with anyio.move_on_after(DOWNLOAD_STOP_SECONDS):
                await download.ended.wait()
        deleted = await anyio.to_thread.run_sync(self.models.delete, model_id)
        self._have.pop(model_id, None)
        remaining = await anyio.to_thread.run_sync(self.models.complete_files, model_id)
        if remaining:  # a read-only copy stays
            self._have[model_id] = remaining
            self._publish_progress(_complete(model_id, remaining))
        else:
            self.link.publish(DownloadRemoved(node_id=self.link.node_id, model_id=model_id))
        folder = str(self.models.writable_dir(model_id))
        unreadable = self.link.state.unreadable_models.get(self.link.node_id, ())
        if any(f.path == folder for f in unreadable):  # the deleted folder was unreadable
            left = tuple(f for f in unreadable if f.path != folder)
            self.link.publish(ModelFoldersUnreadable(node_id=self.link.node_id, folders=left))
        return deleted

    # -- runners -------------------------------------------------------------------

    async def _tend_standby(self) -> None:
        """Keep one runner process started ahead while the cluster runs a model
        across nodes (a node's death then places ranks here at once); none while
        a runner here starts or has just started, so that it has the CPU."""
        if self._standby is not None and self._standby.returncode is not None:
            self._standby = None  # it died: started again below
        now = time.monotonic()
        if not wants_standby(self.link.state):
            # Not at once: between a ring's deletion and its re-placement none is wanted.
            self._unwanted_since = self._unwanted_since or now
            if now - self._unwanted_since >= STANDBY_DELAY_SECONDS:
                await self._close_standby()
            return
        self._unwanted_since = None
        starting = any(
            running.runner is not None and running.runner.status in ("starting", "loading")
            for running in self._running.values()
        )
        settled = now - self._runner_started_at >= STANDBY_DELAY_SECONDS
        if self._standby is None and not starting and settled:
            try:
                self._standby = await anyio.open_process(
                    standby_command(), env=runner_environment(self.cache_dir), stderr=None
                )
                logger.info(f"standby runner process {self._standby.pid} started")
            except OSError as error:
                logger.warning(f"cannot start a standby runner process: {error}")

    def _take_standby(self) -> anyio.abc.Process | None:
        standby, self._standby = self._standby, None
        return standby

    async def _close_standby(self) -> None:
        standby = self._take_standby()
        if standby is None:
            return
        with anyio.CancelScope(shield=True):
            if standby.stdin is not None:
                with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await standby.stdin.aclose()  # the end of stdin ends it
            with anyio.move_on_after(SHUTDOWN_GRACE_SECONDS):
                await standby.wait()
            if standby.returncode is None:
                standby.kill()
                await standby.wait()

    def _runner_status(
        self, running: "_Running", rank: int, status: RunnerStatus, error: str | None
    ) -> None:
        """A runner's status, but a rank-0 runner's "ready" only once this node's API
        serves it: a client that sees the instance ready must not get a 404 here."""
        instance_id = running.instance.instance_id
        self._ready_held.discard(instance_id)
        if status == "ready" and rank == 0 and running.served is None:
            self._ready_held.add(instance_id)
            return
        self._report(running.instance, status, error)

    def _report(self, instance: Instance, status: RunnerStatus, error: str | None) -> None:
        self.link.publish(
            RunnerStatusChanged(
                instance_id=instance.instance_id,
                node_id=self.link.node_id,
                status=status,
                error=error,
            )
        )
        if status == "ready" and instance.instance_id not in self._announced:
            self._announced.add(instance.instance_id)
            if instance.rank_of(self.link.node_id) == 0:
                self.on_ready(instance.model_id)

    async def _start(self, instance: Instance, rank: int, group: anyio.abc.TaskGroup) -> None:
        part = instance.ranks[rank]
        holds = (
            "a slice of every layer"
            if instance.sharding == "tensor"
            else f"layers [{part.start_layer}, {part.end_layer})"
        )
        where = f" rank {rank} of {len(instance.ranks)}, {holds}" if len(instance.ranks) > 1 else ""
        logger.info(
            f"starting a runner for {instance.model_id}{where} (instance {instance.instance_id})"
        )
        try:
            wanted = needed_files(self.link.state, instance, self.link.node_id)
            path = await anyio.to_thread.run_sync(
                self.models.folder_with, instance.model_id, set(wanted or ())
            )
            if path is None:
                path = await anyio.to_thread.run_sync(self.models.resolve, instance.model_id)
        except Exception as error:  # any failure to prepare the model is the runner's failure
            self._cannot_serve(instance, error)
            return
        tokenizer: ChatTokenizer | None = None
        draft_dir, draft_refused = None, None
        if self.draft_model is not None and rank == 0:
            try:  # the served model's tokens first: the runner gets a draft model that fits
                tokenizer = await anyio.to_thread.run_sync(load_chat_tokenizer, path)
                draft_dir = self.models.find(self.draft_model)
                draft_refused = await anyio.to_thread.run_sync(
                    draft_refusal, self.draft_model, draft_dir, tokenizer, len(instance.ranks)
                )
            except Exception as error:
                self._cannot_serve(instance, error)
                return
            if draft_refused is not None:
                logger.warning(
                    f"{instance.model_id} is served without a draft model: {draft_refused}"
                )
                draft_dir = None
        running = _Running(instance, None)
        runner = RunnerSupervisor(
            instance,
            rank,
            path,
            self.prefix_cache_bytes,
            self.cache_dir,
            prefix_cache_disk_bytes=self.prefix_cache_disk_bytes,
            speculation=self.speculation,
            draft_model_dir=draft_dir,
            on_status=lambda status, error: self._runner_status(running, rank, status, error),
            standby=self._take_standby,
            on_cache_summary=(
                (lambda summary: self._cache_reports.changed(instance.instance_id, summary))
                if rank == 0
                else (lambda summary: None)
            ),
        )
        running.runner = runner
        self._running[instance.instance_id] = running
        self._runner_started_at = time.monotonic()

        async def supervise() -> None:
            with running.scope:
                await runner.run()

        # The runner first: its ring peers wait for it; the API's tokenizer meanwhile.
        group.start_soon(supervise)
        if rank != 0:
            return
        try:
            if tokenizer is None:
                tokenizer = await anyio.to_thread.run_sync(load_chat_tokenizer, path)
            served = ServedModel(
                model_id=instance.model_id,
                tokenizer=tokenizer,
                context_length=context_length(path),
                runner=runner,
                created=int(time.time()),
                max_token_bytes=await anyio.to_thread.run_sync(longest_token_bytes, tokenizer),
                sampling_defaults=read_sampling_defaults(path),
                images=await anyio.to_thread.run_sync(
                    image_prompts_for,
                    path,
                    instance.model_id,
                    tokenizer,
                    instance.sharding if len(instance.ranks) > 1 else None,
                    instance.ranks[0].end_layer if len(instance.ranks) > 1 else None,
                ),
                draft_model=self.draft_model if draft_dir is not None else None,
                draft_refused=draft_refused,
            )
        except Exception as error:
            await runner.shutdown()
            running.scope.cancel()
            self._cannot_serve(instance, error)
            return
        if self._running.get(instance.instance_id) is running:
            running.served = served
            self.served[instance.model_id] = served
            if instance.instance_id in self._ready_held:
                self._runner_status(running, rank, "ready", None)

    def _cannot_serve(self, instance: Instance, error: Exception) -> None:
        logger.error(f"cannot serve {instance.model_id}: {error}")
        self._ready_held.discard(instance.instance_id)
        self._running[instance.instance_id] = _Running(instance, None)
        self._report(instance, "failed", f"{type(error).__name__}: {error}")

    async def _stop(
        self, instance_id: InstanceId, reason: str = "the node is shutting down"
    ) -> None:
        running = self._running.pop(instance_id)
        self._cache_reports.forget(instance_id)
        self._ready_held.discard(instance_id)
        self._announced.discard(instance_id)
        if running.runner is not None:
            logger.info(f"stopping the runner of instance {instance_id}")
            if (
                running.served is not None
                and self.served.get(running.instance.model_id) is running.served
            ):
                del self.served[running.instance.model_id]
            await running.runner.shutdown(reason)
        running.scope.cancel()


async def publish_local_models(
    link: ClusterLink, models: ModelStore, only: Collection[str] | None = None
) -> dict[ModelId, set[str]]:
    """Tell the cluster which models this node has (cards and files), and which
    of its model folders it could not read; `only`: of these folders (names),
    added while the node runs."""
    local = await anyio.to_thread.run_sync(models.local_models, only)
    found = local.found
    for card, files in found:
        link.publish(
            ModelCardPublished(card=card),
            DownloadProgressed(node_id=link.node_id, progress=_complete(card.model_id, files)),
        )
    if found:
        logger.info(f"models here: {', '.join(sorted(c.model_id for c, _ in found))}")
    if only is not None:
        return {card.model_id: files for card, files in found}
    # What the state still says from before a restart (a download cut short, a
    # deleted folder) is corrected: partial files are picked up by the next download.
    here = {card.model_id for card, _ in found}
    for model_id in sorted(link.state.downloads.get(link.node_id, {})):
        if model_id not in here:
            link.publish(DownloadRemoved(node_id=link.node_id, model_id=model_id))
    if local.unreadable != link.state.unreadable_models.get(link.node_id, ()):
        link.publish(ModelFoldersUnreadable(node_id=link.node_id, folders=local.unreadable))
    return {card.model_id: files for card, files in found}


def _complete(model_id: ModelId, files: set[str], source: str = "local") -> DownloadProgress:
    return DownloadProgress(
        model_id=model_id,
        status="complete",
        files_total=len(files),
        files_done=len(files),
        bytes_total=0,
        bytes_done=0,
        source=source,
        have_files=tuple(sorted(files)),
    )
