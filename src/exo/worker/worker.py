"""The worker: runs a runner for every instance the cluster state places on this
node, and shuts down the runners of deleted instances (see `plan`)."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
from loguru import logger
from mlx_lm.utils import load_tokenizer

from exo.api.app import ServedModel
from exo.cluster.link import ClusterLink
from exo.models.resolve import resolve_model
from exo.models.store import context_length, sampling_defaults
from exo.shared.types.events import RunnerStatusChanged
from exo.shared.types.ids import InstanceId, ModelId
from exo.shared.types.runner import RunnerStatus
from exo.shared.types.state import Instance
from exo.worker.plan import StartRunner, StopRunner, plan
from exo.worker.runner.supervisor import RunnerSupervisor

# Re-plan at least this often even without events (bounded waits).
REPLAN_SECONDS = 5.0


@dataclass
class _Running:
    instance: Instance
    served: ServedModel | None  # None: it could not start (the state says why)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class Worker:
    def __init__(
        self,
        link: ClusterLink,
        models_dir: Path,
        cache_dir: Path,
        prefix_cache_bytes: int,
        on_ready: Callable[[ModelId], None] = lambda model_id: None,
        stale: frozenset[InstanceId] = frozenset(),
    ) -> None:
        self.link = link
        self.models_dir = models_dir
        self.cache_dir = cache_dir
        self.prefix_cache_bytes = prefix_cache_bytes
        self.on_ready = on_ready
        self.stale = stale
        # The models this node serves, by id: the API reads it on every request.
        self.served: dict[ModelId, ServedModel] = {}
        self._running: dict[InstanceId, _Running] = {}
        self._announced: set[InstanceId] = set()

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            try:
                while True:
                    await self._reconcile(group)
                    await self.link.store.wait_for_change(REPLAN_SECONDS)
            finally:
                with anyio.CancelScope(shield=True):
                    for instance_id in list(self._running):
                        await self._stop(instance_id)

    async def _reconcile(self, group: anyio.abc.TaskGroup) -> None:
        for _ in range(len(self.link.state.instances) + len(self._running) + 1):
            action = plan(self.link.node_id, self.link.state, self._running.keys(), self.stale)
            if isinstance(action, StartRunner):
                await self._start(action.instance, group)
            elif isinstance(action, StopRunner):
                await self._stop(action.instance_id)
            else:
                return

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
            self.on_ready(instance.model_id)

    async def _start(self, instance: Instance, group: anyio.abc.TaskGroup) -> None:
        logger.info(f"starting a runner for {instance.model_id} (instance {instance.instance_id})")
        try:
            path = await anyio.to_thread.run_sync(resolve_model, self.models_dir, instance.model_id)
            tokenizer = await anyio.to_thread.run_sync(load_tokenizer, path)
        except Exception as error:  # any failure to prepare the model is the runner's failure
            logger.error(f"cannot serve {instance.model_id}: {error}")
            self._running[instance.instance_id] = _Running(instance, None)
            self._report(instance, "failed", f"{type(error).__name__}: {error}")
            return
        runner = RunnerSupervisor(
            instance.model_id,
            path,
            self.prefix_cache_bytes,
            self.cache_dir,
            on_status=lambda status, error: self._report(instance, status, error),
        )
        temperature, top_p = sampling_defaults(path)
        served = ServedModel(
            model_id=instance.model_id,
            tokenizer=tokenizer,
            context_length=context_length(path),
            runner=runner,
            created=int(time.time()),
            default_temperature=temperature,
            default_top_p=top_p,
        )
        running = _Running(instance, served)
        self._running[instance.instance_id] = running
        self.served[instance.model_id] = served

        async def supervise() -> None:
            with running.scope:
                await runner.run()

        group.start_soon(supervise)

    async def _stop(self, instance_id: InstanceId) -> None:
        running = self._running.pop(instance_id)
        if running.served is not None:
            logger.info(f"stopping the runner of instance {instance_id}")
            self.served.pop(running.instance.model_id, None)
            await running.served.runner.shutdown()
        running.scope.cancel()
