"""Distinct id types: never a bare `str` across module boundaries."""

from typing import NewType
from uuid import uuid4

ModelId = NewType("ModelId", str)
TaskId = NewType("TaskId", str)
NodeId = NewType("NodeId", str)
InstanceId = NewType("InstanceId", str)


def new_task_id() -> TaskId:
    return TaskId(uuid4().hex)


def new_instance_id() -> InstanceId:
    return InstanceId(uuid4().hex[:12])
