"""Shared by the API adapter tests: a reply that plays scripted events, and
checks on how a request type treats its fields."""

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from exo.api.errors import APIError
from exo.api.reply_stream import PreparedReply, ReplyEvent


def scripted(events: Sequence[ReplyEvent], error: APIError | None = None) -> PreparedReply:
    """A reply whose run yields `events`, then raises `error` if one is given."""

    async def run() -> AsyncIterator[ReplyEvent]:
        for event in events:
            yield event
        if error is not None:
            raise error

    return PreparedReply(
        reply_id="r1", model="served/model", prompt_tokens=1000, created=1700000000, events=run()
    )


def assert_fields_classified(
    request: type[BaseModel],
    honoured: frozenset[str],
    ignored: frozenset[str],
    rejected: set[str],
) -> None:
    """Every field of `request` is in exactly one of the three lists."""
    assert not (honoured & ignored or honoured & rejected or ignored & rejected)
    assert honoured | ignored | rejected == set(request.model_fields)


def assert_rejected(
    request: type[BaseModel], body: dict[str, Any], location: str, message: str
) -> None:
    """`body` fails validation first at `location`, with `message` in the error."""
    with pytest.raises(ValidationError) as caught:
        request.model_validate(body)
    error = caught.value.errors()[0]
    assert ".".join(str(part) for part in error["loc"]) == location
    assert message in error["msg"]
