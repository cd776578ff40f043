"""Built-in tasks, generated locally (no downloads): text arithmetic, countdown and synthetic geometry pictures."""

from __future__ import annotations

from typing import Any

from dsv4flash.tasks.arithmetic import ArithmeticTask
from dsv4flash.tasks.base import Example, Task
from dsv4flash.tasks.countdown import CountdownTask
from dsv4flash.tasks.dataset import Batch, Encoder, TaskMixture
from dsv4flash.tasks.geometry import GeometryDescribeTask, GeometryTask
from dsv4flash.tasks.tokenizer import TaskTokenizer, TokenizerError

TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "geometry": GeometryTask,
    "geometry_describe": GeometryDescribeTask,
}


def build_task(name: str, **options: Any) -> Task:
    """Instantiate a built-in task by name; an unknown name lists the known ones."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[name](**options)


__all__ = ["TASKS", "Batch", "Encoder", "Example", "Task", "TaskMixture", "TaskTokenizer", "TokenizerError",
           "build_task", "ArithmeticTask", "CountdownTask", "GeometryDescribeTask", "GeometryTask"]
