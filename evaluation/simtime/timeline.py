"""A bench cell in simulated time: what each reply costs on the wire and when it arrives.

The bench computes every row in-process; :class:`Timeline` adds what a deployment would
see. Each reply is encoded with the run's codec (``compression``; ``robust.codecs``) and
decoded again, as the coordinator does, with the node's error-feedback residual for a biased
codec (top-k), so the rows the engine aggregates are the decoded ones; its bytes are counted
(up: the encoded arrays; down: the model each task carries, float32 or as ``downlink`` sends it). A reply sent at
``start`` arrives at ``start + download + compute(steps, speed) + upload`` on the node's
link (``evaluation.simtime.arrivals.Volunteers``: ``speed``, ``link``, ``churn``). Everything is a
function of the scenario, the seed and the rows: the same cell gives the same times and bits.

``step-seconds`` (simulated seconds of one local step) is given, or measured on this machine
when 0, once per process for each kind of task (model, data, batch size, protocol, threads:
:data:`MEASURED`), as a node update's time over its local steps: then the times (and an
asynchronous run's schedule) are this machine's; give it to compare machines bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from nodes.engine.ledger import Ticket, ttl
from nodes.wire import DOWNLINK_BYTES
from robust import codecs

from .arrivals import Traffic, Volunteers, measure_step_seconds
from .calibration import load

F32 = 4  # bytes per float32 coordinate
MEASURED: dict[tuple, float] = {}  # seconds of one local step, by kind of task, measured in this process


class Timeline:
    def __init__(self, config: dict, ids: list[str], seed: int, settings, steps: int, d: int) -> None:
        self.volunteers = Volunteers.of(ids, seed, speed=config.get("speed", "uniform"),
                                        link=config.get("link", "none"), churn=config.get("churn", "none"))
        self.codec = codecs.build(settings.compression)
        self.seed, self.steps, self.d = seed, steps, d
        self.down = DOWNLINK_BYTES[settings.downlink] * d  # bytes of the model each task carries
        self.deadline = float(config.get("deadline", 0.0))
        self.step_seconds = float(config.get("step-seconds", 0.0))
        self.residual: dict[str, torch.Tensor | None] = {}
        self.traffic = Traffic()
        self.calibration = load(config.get("calibration", ""))
        self.tasks: dict[str, int] = {}  # tasks sent to each node so far
        self.now = self.calibration.start_seconds if self.calibration else 0.0

    @property
    def up(self) -> int:
        """Bytes of values a reply takes on the wire (float32, or as the codec encodes it)."""
        return F32 * self.d if self.codec.name == "none" else self.codec.nbytes(self.d)

    def life(self, asynchronous: bool, settings_deadline: float) -> float:
        """How long a task lives (simulated seconds), as in a deployment: ``deadline`` + 30 s
        (``nodes.engine.ledger.ttl``) of the scenario's deadline (an asynchronous run without one: the
        coordinator's ``settings_deadline``); a synchronous round without a deadline waits for
        every reply."""
        if self.deadline or asynchronous:
            return ttl(self.deadline or settings_deadline)
        return math.inf

    def round_end(self, start: float, arrivals: Iterable[float]) -> float:
        """When a synchronous round started at ``start`` ends: at its last task's reply, or at
        its deadline if that is sooner (with no task of its own: at the deadline)."""
        end = max(arrivals, default=start + self.deadline)
        return min(end, start + self.deadline) if self.deadline else end

    @staticmethod
    def counts(arrival: float, ticket: Ticket, end: float) -> bool:
        """Whether a reply arriving at ``arrival`` counts in a round ending at ``end``: it
        arrives by then, and before its task is given up."""
        return arrival <= min(end, ticket.expires)

    def measure(self, update, kind: tuple) -> None:
        """Set ``step_seconds``, unless the scenario gave it, from timed calls of ``update``
        (one node update: ``self.steps`` local steps), once per process for each ``kind`` of task."""
        if not self.step_seconds:
            if kind not in MEASURED:
                MEASURED[kind] = measure_step_seconds(update) / self.steps
            self.step_seconds = MEASURED[kind]

    def send(self, node: str, task_round: int, row: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(the row the coordinator decodes, bytes sent)`` for ``node``'s reply to the task
        of round ``task_round``."""
        if self.codec.name == "none":
            return row, F32 * self.d
        key = (self.seed, task_round, node)
        if self.codec.biased:
            enc, self.residual[node] = codecs.error_feedback(self.codec, row, self.residual.get(node), key)
        else:
            enc = self.codec.encode(row, key)
        return self.codec.decode(enc, self.d), codecs.nbytes(enc)

    def transmit(self, rows: torch.Tensor, task_round: int, ids: list[str]) -> torch.Tensor:
        """Crafted rows as the coordinator decodes them (an omniscient attacker crafts in the
        decoded space and encodes like everyone; no residual; a non-finite row travels as is,
        to be rejected)."""
        if self.codec.name == "none":
            return rows
        out = rows.clone()
        for k, node in enumerate(ids):
            if bool(torch.isfinite(rows[k]).all()):
                out[k] = self.codec.decode(self.codec.encode(rows[k].float(), (self.seed, task_round, node)), self.d)
        return out

    @property
    def coordinator_seconds(self) -> float:
        """What the coordinator spends on each step (round or buffer), the serve loop's clock
        moving on by it (``SimClock.stepping``): a calibration's ``collect_seconds``, else 0."""
        return self.calibration.collect_seconds if self.calibration else 0.0

    def arrival(self, node: str, start: float, up: int) -> float:
        """When ``node``'s reply of ``up`` bytes to a task sent at ``start`` arrives (with a
        calibration, later by what the deployment adds, its transfers as many bytes as the wire
        carries: ``evaluation.simtime.calibration``)."""
        self.traffic.add(node, up=up, down=self.down)
        cal = self.calibration
        if cal is None:
            return self.volunteers.arrival(node, start, self.steps, self.step_seconds, up, self.down)
        self.tasks[node] = count = self.tasks.get(node, 0) + 1
        return cal.delay(self.seed, node, count) + self.volunteers.arrival(
            node, start, self.steps, self.step_seconds, round(up * cal.wire_up), round(self.down * cal.wire_down))

    def record(self) -> dict:
        return {"sim_seconds": self.now, "step_seconds": self.step_seconds, **self.traffic.record()}
