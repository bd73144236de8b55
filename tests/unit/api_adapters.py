"""Shared by the API adapter tests: a reply that plays scripted events, and
checks on how a request type treats its fields."""

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, get_args

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
    ignored: Mapping[str, str],
    rejected: set[str],
) -> None:
    """Every field of `request` is in exactly one of the three lists, and each
    dotted path of `ignored` names a field of a part of the request."""
    top = {path for path in ignored if "." not in path}
    assert not (honoured & top or honoured & rejected or top & rejected)
    assert honoured | top | rejected == set(request.model_fields)
    for path in set(ignored) - top:
        models: list[type[BaseModel]] = [request]
        for name in path.split("."):
            fields = [model.model_fields[name] for model in models if name in model.model_fields]
            assert fields, f"{path}: no part of the request declares {name!r}"
            models = [model for field in fields for model in _models_in(field.annotation)]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's type holds, through lists, unions and `Annotated`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def assert_rejected(
    request: type[BaseModel], body: dict[str, Any], location: str, message: str
) -> None:
    """`body` fails validation first at `location`, with `message` in the error."""
    with pytest.raises(ValidationError) as caught:
        request.model_validate(body)
    error = caught.value.errors()[0]
    assert ".".join(str(part) for part in error["loc"]) == location
    assert message in error["msg"]
