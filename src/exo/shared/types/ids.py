"""Distinct id types: never a bare `str` across module boundaries.

`ModelId` is also a path segment on disk (`org/name` -> `org--name`), so it is
validated wherever one enters: every pydantic model with a `ModelId` field
(HTTP bodies, commands, events, the state) rejects a bad one, and raw strings
(gRPC fields, the command line, folder names) go through `validate_model_id`.
`ModelId(text)` itself is an unchecked cast, for text that is not a path: a
model name a client asked for, looked up among the served ones.
"""

import re
from typing import NewType
from uuid import uuid4

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

TaskId = NewType("TaskId", str)
NodeId = NewType("NodeId", str)
InstanceId = NewType("InstanceId", str)

MODEL_ID_MAX_LENGTH = 200
# `name` or `org/name`; each part starts with a letter or digit (no `.`, `..`,
# no empty part, no absolute path, no backslash).
_MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$"
_MODEL_ID = re.compile(_MODEL_ID_PATTERN)


class InvalidModelId(ValueError):
    pass


class ModelId(str):
    """A model id: `name` or `org/name` (letters, digits, `.`, `_`, `-`)."""

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[object], handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_after_validator_function(
            validate_model_id,
            core_schema.str_schema(
                pattern=_MODEL_ID_PATTERN, min_length=1, max_length=MODEL_ID_MAX_LENGTH
            ),
            serialization=core_schema.to_string_ser_schema(),
        )


def validate_model_id(model_id: str) -> ModelId:
    """`model_id` as a `ModelId`; raises `InvalidModelId` for anything that is
    not `name` or `org/name` (path traversal, absolute paths, odd characters)."""
    if len(model_id) > MODEL_ID_MAX_LENGTH or not _MODEL_ID.fullmatch(model_id) or ".." in model_id:
        raise InvalidModelId(
            f"invalid model id {model_id[:MODEL_ID_MAX_LENGTH]!r}: use 'name' or 'org/name' "
            f"(letters, digits, '.', '_', '-'; at most {MODEL_ID_MAX_LENGTH} characters, no '..')"
        )
    return ModelId(model_id)


def new_task_id() -> TaskId:
    return TaskId(uuid4().hex)


def new_instance_id() -> InstanceId:
    return InstanceId(uuid4().hex[:12])
