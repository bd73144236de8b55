"""Retry before the first token: a request whose runner (or node) is lost
before its reply produced anything runs again, and its client sees one slow
answer instead of an error. Nothing reached the client, so a retry cannot
repeat or lose anything.

Where it runs again, within `seconds` of the loss (`--retry-seconds`):
- this node's runner, restarted (a whole-model runner restarts by itself):
  the request keeps its slot meanwhile, so requests queued behind it keep
  their order and none is failed;
- another instance of the model, or the one the master places again: the
  request goes back to `dispatch`, which routes it anew. A routed request
  (relayed here by the node that took it) is not waited for here: its
  answer says it was lost unanswered (`UNANSWERED_HEADER`), and that node
  routes it again.

A stream answered by this node has sent its HTTP head once the runner took
it (keep-alives flow through a long prefill). When it cannot run here again
(the model placed elsewhere, its instance deleted), it continues on another
replica (`continuation`): that node sends the reply's events, not its API's
answer, and this node's adapter writes them into the answer it began. A
relayed stream's serving node holds its head until the first token
(`generation.held_until`), so the node that took it can send it anywhere.
"""

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import anyio

from exo.api.errors import APIError
from exo.api.reply_stream import ReplyEvent
from exo.api.routing import SERVING
from exo.shared.types.ids import InstanceId, ModelId
from exo.worker.served_model import ServedModel

DEFAULT_RETRY_SECONDS = 30.0
# A request that loses its runner this often is likely what kills it: it fails.
MAX_ATTEMPTS = 3
POLL_SECONDS = 0.2
# Set on the answer to a routed request that was lost before its first token:
# the node that routed it sends it elsewhere.
UNANSWERED_HEADER = "x-exo-unanswered"


def lost_unanswered(reason: str) -> APIError:
    """A 503 for a request whose runner was lost before its first token."""
    return APIError(
        503,
        f"the model runner is unavailable: {reason}",
        "server_error",
        "runner_unavailable",
        headers={UNANSWERED_HEADER: "1"},
    )


def is_unanswered(error: APIError) -> bool:
    return UNANSWERED_HEADER in error.headers


@dataclass
class ReplyRetry:
    """How one request is retried when its runner is lost before any of its
    reply reached the client."""

    seconds: float
    # This node's model by id (its runner may be restarting), or None.
    local: Callable[[ModelId], ServedModel | None]
    # Whether another node serves the model now: a request stops waiting for
    # this node's model to come back (it is routed there, or fails if it is a
    # stream answered here).
    served_elsewhere: Callable[[ModelId], bool]
    # A relayed request: its answer (the HTTP head included) begins with its
    # first token, and it waits here only for this node's runner to restart.
    routed: bool = False
    # A routed stream whose node reads its events (`continuation`): its answer
    # begins when the runner took it, and a loss before its first token ends
    # it with an event that says so, for that node to send it elsewhere.
    reads_events: bool = False
    # A stream answered here whose runner cannot come back: its events from
    # another replica (not the lost instance; the prompt's tokens choose it).
    continue_elsewhere: Callable[[InstanceId, Sequence[int]], AsyncIterator[ReplyEvent]] | None = (
        None
    )
    _deadline: float | None = field(default=None, init=False)

    def deadline(self) -> float:
        """When retrying stops: `seconds` after the request was first lost."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.seconds
        return self._deadline

    async def runner_back(self, model_id: ModelId) -> ServedModel | None:
        """This node's model once its runner serves again, or None: at the
        deadline, or as soon as it cannot come back here (or need not)."""
        while time.monotonic() < self.deadline():
            model = self.local(model_id)
            if model is not None and model.runner.status in SERVING:
                return model
            restarting = (
                model is not None and model.runner.restart and model.runner.status != "stopped"
            )
            if not restarting and (self.routed or self.served_elsewhere(model_id)):
                return None  # it is routed again, to where the model is now
            await anyio.sleep(POLL_SECONDS)
        return None


def no_retry() -> ReplyRetry:
    """Outside the API's routing (a tool, a test): a lost request fails at once."""
    return ReplyRetry(0.0, lambda model_id: None, lambda model_id: False)
