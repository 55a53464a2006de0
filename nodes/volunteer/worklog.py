"""The node's own account of what it sent: one line of ``DIR/work.jsonl`` per answered task
(run, round, training seconds, declined or not, time, and ``task_made``: when the ServerApp
made the task, by its clock), written just before the reply leaves; and one line per reply
Flower's runtime then refused (``refused_by_runtime``: the cause, ``nodes.volunteer.runtime_watch``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

WORK_LOG = "work.jsonl"


def record(folder: Path, run: str, number: int, seconds: float, declined: bool, made: float) -> None:
    """Log the reply to round ``number`` of ``run``, whose task was made at ``made`` (Unix time)."""
    _append(folder, {"run": run, "round": number, "seconds": round(seconds, 3), "declined": declined,
                     "time": time.time(), "task_made": made})


def refused(folder: Path, run: str, number: int, cause: str) -> None:
    """Log that Flower's runtime refused the reply to round ``number`` of ``run``, and why."""
    _append(folder, {"run": run, "round": number, "time": time.time(), "refused_by_runtime": cause})


def _append(folder: Path, line: dict) -> None:
    with open(folder / WORK_LOG, "a") as out:
        out.write(json.dumps(line) + "\n")
