"""What a real deployment adds to the simulated clock, measured in the field lab.

The clock (``evaluation.simtime.arrivals``) knows links, compute and churn. A deployment adds
costs the clock had no word for. A calibration file says what they were on one machine,
measured by ``robust field --calibrate FILE`` on a scenario with unshaped links, so that
nothing but Flower and the coordinator takes time:

- ``task_seconds``: per task, the seconds from the task's making (the ServerApp's clock) to the
  reply being handed to the SuperNode, less the node's training seconds. That is Flower's 3 s
  poll, the fresh ClientApp process, TLS, and handling the message. Kept as samples, since a
  synchronous round waits for the largest of its nodes'.
- ``collect_seconds``: from the last counted reply being handed on to the round's record. It
  covers the upload on an unshaped pair, pulling the replies, checks, spooling, aggregation and
  evaluation. Its median is used.
- ``between_seconds``: from a round's record to the next round's first task (the checkpoint,
  making and pushing the tasks). Its median is used.
- ``start_seconds``: from the run's submission to its first task (the ServerApp's start), less
  ``between_seconds``.
- ``wire_up`` and ``wire_down``: bytes on the wire (the pairs' counters: TLS, gRPC, Flower's
  message) over the bytes of arrays a reply or a task carries.

With ``calibration = "FILE"`` in a scenario, the clock's run starts at ``start_seconds``. Each
reply arrives ``between + task`` later than the links and compute say, where ``task`` is one of
``task_seconds`` drawn by ``(seed, node, the node's task count)``. Each step of the engine (a
round, or a buffer) then takes the coordinator ``collect`` seconds, one after the other: the
replies that arrive meanwhile are read after it, and the next tasks leave after it
(``SimClock.stepping``). So a synchronous round ends when its record would appear, and an
asynchronous run's buffers queue at a coordinator that is busy. Each transfer carries
``wire_*`` times its bytes. The schedule stays a pure function of the scenario, the seed and
the file.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from robust.seeds import derive

FIELDS = ("task_seconds", "collect_seconds", "between_seconds", "start_seconds", "wire_up", "wire_down")


@dataclass(frozen=True)
class Calibration:
    task_seconds: tuple[float, ...]
    collect_seconds: float
    between_seconds: float
    start_seconds: float
    wire_up: float
    wire_down: float
    source: str = ""  # what was measured, where

    def __post_init__(self) -> None:
        if not self.task_seconds or not all(math.isfinite(s) and s >= 0 for s in self.task_seconds):
            raise ValueError("a calibration needs task_seconds: finite seconds >= 0, at least one")
        for key in ("collect_seconds", "between_seconds", "start_seconds"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) < 0:
                raise ValueError(f"a calibration's {key} must be finite seconds >= 0 (got {getattr(self, key)!r})")
        for key in ("wire_up", "wire_down"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) < 1:
                raise ValueError(f"a calibration's {key} is wire bytes per byte sent: >= 1 (got {getattr(self, key)!r})")

    def delay(self, seed: int, node: str, count: int) -> float:
        """What the deployment adds to one reply: ``between + task``, its ``task`` a sample drawn
        by ``(seed, node, count)``; the coordinator's ``collect`` is the step's (``SimClock.stepping``)."""
        task = self.task_seconds[derive(seed, "field-task", node, count) % len(self.task_seconds)]
        return self.between_seconds + task

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")


@lru_cache(maxsize=16)
def _read(path: str, mtime: float) -> Calibration:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration file {path} not found: make one with robust field --calibrate FILE") from None
    except ValueError as err:
        raise ValueError(f"{path} is not a calibration file ({err}): make one with robust field --calibrate FILE") from None
    missing = [k for k in FIELDS if k not in raw]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: make it with robust field --calibrate FILE")
    try:
        return Calibration(tuple(float(s) for s in raw["task_seconds"]), *(float(raw[k]) for k in FIELDS[1:]),
                           str(raw.get("source", "")))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}: make it again with robust field --calibrate FILE") from None


def load(path: str) -> Calibration | None:
    """The calibration in ``path`` (``""``: none), checked."""
    if not path:
        return None
    p = Path(path)
    return _read(str(p.resolve()), p.stat().st_mtime if p.exists() else 0.0)


def measure(observed: list[dict], source: str) -> Calibration:
    """A calibration from the ``observed`` of field records (``evaluation.field.lab.observe``)."""
    def pooled(key: str) -> list[float]:
        return [s for o in observed for s in o[key]]

    tasks, collect, between = pooled("task_seconds"), pooled("collect_seconds"), pooled("between_seconds")
    if not tasks or not collect or not between:
        raise ValueError("the calibration run observed no two complete rounds: give it at least 3 rounds")
    total = {k: sum(o[k] for o in observed) for k in ("wire_up_bytes", "up_bytes", "wire_down_bytes", "down_bytes")}
    gap = max(0.0, statistics.median(between))  # the next tasks may be made before the lab sees the record
    return Calibration(tuple(sorted(round(max(s, 0.0), 4) for s in tasks)), round(statistics.median(collect), 4),
                       round(gap, 4), round(max(0.0, statistics.median(o["first_task_seconds"] for o in observed) - gap), 4),
                       round(max(1.0, total["wire_up_bytes"] / max(total["up_bytes"], 1)), 4),
                       round(max(1.0, total["wire_down_bytes"] / max(total["down_bytes"], 1)), 4), source)
