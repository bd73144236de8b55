"""Distinct id types: never a bare `str` across module boundaries."""

from typing import NewType
from uuid import uuid4

ModelId = NewType("ModelId", str)
TaskId = NewType("TaskId", str)
RunnerId = NewType("RunnerId", str)


def new_task_id() -> TaskId:
    return TaskId(uuid4().hex)


def new_runner_id() -> RunnerId:
    return RunnerId(uuid4().hex[:12])
