"""Where a generation request is answered: this node's replica of the model or
another node's (`choose_replica`: the longest cached prefix of the prompt,
unless that replica is much busier), and, when the chosen one is lost before
its answer begins, another replica or the one the master places again
(`reply_retry`; a stream whose answer began here: `continuation`)."""

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from loguru import logger
from starlette.responses import Response

from exo.api.continuation import EVENTS_HEADER, continuation_for
from exo.api.errors import APIError
from exo.api.generation import check_prompt_size, render
from exo.api.images import request_images
from exo.api.metrics import observe_retry, observe_route
from exo.api.reply_retry import (
    MAX_ATTEMPTS,
    POLL_SECONDS,
    ReplyRetry,
    is_unanswered,
    lost_unanswered,
)
from exo.api.routing import Replica
from exo.api.serving import (
    NOT_READY_RETRY_SECONDS,
    RELAY_FAILURES,
    ROUTED_HEADER,
    ModelRouter,
    relay,
    until_disconnect,
)
from exo.shared.prefix_digests import prefix_digests
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import InstanceId, ModelId
from exo.worker.served_model import ServedModel

T = TypeVar("T")


async def dispatch(
    router: ModelRouter,
    name: str,
    request: Request,
    chat_for: Callable[[ModelId], ChatRequest],
    answer: Callable[[ServedModel, ReplyRetry], Awaitable[T]],
) -> T | Response:
    """`answer` with this node's model, or the request relayed to the replica
    routing chooses. `chat_for` is the request as the generation service takes
    it (rendered here to compare the prompt with what each replica cached)."""
    model_id = router.resolve(name)
    routed = ROUTED_HEADER in request.headers
    retry = router.reply_retry(
        routed,
        reads_events=routed and EVENTS_HEADER in request.headers,
        continue_elsewhere=None if routed else continuation_for(router, request, model_id),
    )
    if retry.routed:  # the node that took the request chose this one
        local = router.models.get(model_id)
        if local is None:  # its instance went away meanwhile: that node routes it again
            raise lost_unanswered(f"this node no longer serves {model_id}")
        return await until_disconnect(request, lambda: answer(local, retry))
    tried: set[InstanceId] = set()
    failure: APIError | None = None
    for _ in range(MAX_ATTEMPTS):
        if failure is not None:
            # Within --retry-seconds of the first loss (also when it was this node's).
            replicas, local = await _back(router, model_id, tried, retry.deadline())
            if not replicas and local is None:
                if model_id in router.cluster.state.unplaced:
                    router.not_served(name, model_id)  # waits for a node: says so
                raise worth_sending_again(failure)
            observe_retry(model_id, "rerouted")
        else:
            replicas = router.replicas(model_id)
            local = router.models.get(model_id)
        if local is None:  # this node's instance, in the state, without a runner to answer here
            replicas = [r for r in replicas if not r.local]
        if local is not None and not any(r.local for r in replicas):
            # The state has not caught up with this node's runner (or lost it).
            route_local = True
        else:
            if not replicas:
                router.not_served(name, model_id)
            digests = None
            renderer = local or router.routing_model(model_id)
            if len(replicas) > 1 and renderer is not None and router.policy == "cache-aware":
                chat = chat_for(model_id)
                check_prompt_size(renderer, chat)
                images = request_images(chat)
                # Images by address are fetched where the request is served, once;
                # a routing model has no image processor.
                if not any(image.url for image in images) and (local is not None or not images):
                    prompt = await render(renderer, chat, fetch_images=router.fetch_images)
                    digests = prefix_digests(prompt.tokens)
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
            route_local = replica.local and local is not None
            if not route_local:
                try:
                    return await relay(router.relay_to(replica, model_id), request)
                except APIError as error:
                    if error.code not in RELAY_FAILURES:
                        raise
                    logger.warning(
                        f"{where} failed before answering ({error.message}); trying another"
                    )
                    router.failed(replica.instance_id)
                    tried.add(replica.instance_id)
                    failure = error
        if route_local:
            assert local is not None
            serving = local.runner.instance.instance_id  # before a re-placement replaces it
            try:
                return await answer(local, retry)
            except APIError as error:
                if not is_unanswered(error):
                    raise
                logger.warning(f"this node lost the request before answering ({error.message})")
                tried.add(serving)
                failure = error
    assert failure is not None
    raise worth_sending_again(failure)


def worth_sending_again(failure: APIError) -> APIError:
    """The last loss of a request lost before its answer began, with
    `Retry-After`: nothing of it reached the client, and its model's runner
    restarts or is placed again, so sending it again shortly is safe and
    likely to be answered (a fault storm can take its instances down several
    times within a second)."""
    return APIError(
        failure.status,
        f"{failure.message}; nothing was answered: send it again shortly",
        failure.error_type,
        failure.code,
        failure.param,
        headers={**failure.headers, "Retry-After": str(NOT_READY_RETRY_SECONDS)},
    )


async def _back(
    router: ModelRouter,
    model_id: ModelId,
    tried: set[InstanceId],
    deadline: float,
) -> tuple[list[Replica], ServedModel | None]:
    """Where a request lost before its answer began can go now: the model's
    replicas not tried yet, and this node's model unless its instance is the
    one that lost it (a re-placed one here is new); waited for (a re-placement)
    until the deadline."""
    while True:
        local = router.models.get(model_id)
        if local is not None and local.runner.instance.instance_id in tried:
            local = None
        replicas = router.replicas(model_id, exclude=tried)
        if replicas or local is not None or time.monotonic() >= deadline:
            return replicas, local
        await anyio.sleep(POLL_SECONDS)
