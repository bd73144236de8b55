"""Where a generation request is answered: this node's replica of the model or
another node's (`choose_replica`: the longest cached prefix of the prompt,
unless that replica is much busier), and another replica when the chosen
node fails before its answer begins."""

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from loguru import logger
from starlette.responses import Response

from exo.api.errors import APIError
from exo.api.generation import check_prompt_size, render
from exo.api.metrics import observe_route
from exo.api.serving import ROUTED_HEADER, ModelRouter, relay
from exo.shared.prefix_digests import prefix_digests
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import InstanceId
from exo.worker.served_model import ServedModel

T = TypeVar("T")

# Errors of a relay before the serving node answered anything: another replica may.
RELAY_FAILURES = ("relay_failed", "relay_timeout")


async def dispatch(
    router: ModelRouter,
    name: str,
    request: Request,
    chat_for: Callable[[ServedModel], ChatRequest],
    answer: Callable[[ServedModel], Awaitable[T]],
) -> T | Response:
    """`answer` with this node's model, or the request relayed to the replica
    routing chooses. `chat_for` is the request as the generation service takes
    it (rendered here to compare the prompt with what each replica cached)."""
    model_id = router.resolve(name)
    local = router.models.get(model_id)
    if local is not None and ROUTED_HEADER in request.headers:
        return await answer(local)  # the node that took the request chose this one
    tried: set[InstanceId] = set()
    failure: APIError | None = None
    while True:
        replicas = router.replicas(model_id, exclude=tried)
        if local is not None and not any(r.local for r in replicas) and not tried:
            return await answer(local)  # the state has not caught up with this node's runner
        if not replicas:
            if failure is not None:
                raise failure
            router.not_served(name, model_id)
        digests = None
        if len(replicas) > 1 and local is not None and router.policy == "cache-aware":
            chat = chat_for(local)
            check_prompt_size(local, chat)
            digests = prefix_digests((await render(local, chat)).tokens)
        route = router.choose(replicas, digests)
        replica = route.replica
        where = "this node" if replica.local else f"node {replica.node_id}"
        logger.log(
            "INFO" if len(replicas) > 1 else "DEBUG",
            f"routed a {model_id} request to {where} (instance {replica.instance_id}, "
            f"{route.reason}, ~{route.cached_tokens} prompt tokens cached there, "
            f"load {replica.load})",
        )
        observe_route(model_id, route.reason, replica.local, route.cached_tokens)
        if replica.local and local is not None:
            return await answer(local)
        try:
            return await relay(router.relay_to(replica, model_id), request)
        except APIError as error:
            if error.code not in RELAY_FAILURES:
                raise
            logger.warning(f"{where} failed before answering ({error.message}); trying another")
            router.failed(replica.instance_id)
            tried.add(replica.instance_id)
            failure = error
