"""The node's own account of what it sent: one line of ``DIR/work.jsonl`` per answered task
(run, round, kind, local steps, training seconds, bytes up, declined or not and why, time, and
``task_made``: when the ServerApp made the task, by its clock), written just before the reply
leaves; and one line per reply Flower's runtime then refused (``refused_by_runtime``: the cause,
``nodes.volunteer.runtime_watch``). ``robust node join`` shows each line to its volunteer as it
comes (:func:`since`, ``nodes.volunteer.terminal``). Flower-free: the supervisor reads it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the wire format imports Flower; `node join` reads this log without it
    from ..wire import Reply

WORK_LOG = "work.jsonl"
# a node's own work; a spot check of another node's; an answer to a dispute (states of work it committed to)
TRAINING, CHECK, DISPUTE = "training", "check", "dispute"


def record(folder: Path, reply: Reply, made: float, seconds: float = 0.0, steps: int = 0, up: int = 0,
           kind: str = "") -> None:
    """Log ``reply`` (to a task made at ``made``, Unix time): ``steps`` local steps trained in
    ``seconds``, ``up`` bytes of arrays sent (``nodes.wire.content_bytes``); its ``kind`` (left
    out: a spot check when it names an author, else training)."""
    _append(folder, {"run": reply.run, "round": reply.round, "kind": kind or (CHECK if reply.author else TRAINING),
                     "steps": steps, "seconds": round(seconds, 3), "bytes": up, "declined": bool(reply.refused),
                     **({"reason": reply.refused} if reply.refused else {}), "time": time.time(), "task_made": made})


def refused(folder: Path, run: str, number: int, kind: str, cause: str) -> None:
    """Log that Flower's runtime refused the reply to the ``kind`` task of round ``number`` of ``run``, and why."""
    _append(folder, {"run": run, "round": number, "kind": kind, "time": time.time(), "refused_by_runtime": cause})


def since(folder: Path, offset: int) -> tuple[list[dict], int]:
    """The lines logged after byte ``offset``, and the offset past them (a line still being
    written waits for the next call; one that is not JSON, cut short by a full disk, is passed
    over: never the end of ``node join``)."""
    try:
        with open(folder / WORK_LOG, "rb") as log:
            log.seek(offset)
            data = log.read()
    except FileNotFoundError:
        return [], offset
    done, lines = data[:data.rfind(b"\n") + 1], []
    for line in done.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines, offset + len(done)


def _append(folder: Path, line: dict) -> None:
    with open(folder / WORK_LOG, "a") as out:
        out.write(json.dumps(line) + "\n")
