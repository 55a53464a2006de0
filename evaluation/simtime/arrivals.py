"""Simulated time in the bench: when each node's reply arrives, who is there, what it cost.

A cell builds its :class:`Volunteers` once, from the sorted node ids, the run seed and three
specs (``evaluation.simtime.traits``: ``speed``, ``link``, ``churn``). Then, in simulated
seconds from the start of the run::

    arrival = start + download(bytes_down) + compute(steps) + upload(bytes_up)
    compute = steps * step_seconds * slowness(node)
    download = latency + 8 * bytes_down / down_bps      (the same for upload)

Bytes are bytes; bandwidths are Mbps (10^6 bits/s), so 1 MB (10^6 bytes) at 8 Mbps takes 1 s
plus the latency. ``step_seconds`` is one local step of the model on the reference machine:
given (the scenario's ``step-seconds``), or measured with :func:`measure_step_seconds` once per
process for each kind of task (``evaluation.simtime.timeline``); a measured value differs between machines, so only a given one
makes the schedule the same bits everywhere.

Churn is a seeded chain per node over *epochs* (``online(node, epoch)``, a pure function of
``(seed, node, epoch)``). A synchronous run uses its round index as the epoch: a node
offline in round ``r`` is not there to reply (it never does). An asynchronous run has no
rounds: epoch ``e`` is the simulated interval ``[e * period, (e + 1) * period)`` of the
churn's ``period``; a task is lost if the node is offline in any epoch from its start to its
arrival (:meth:`Volunteers.leaves_during`), and the node asks again at
:meth:`Volunteers.back_at`.

Everything here is a pure function of its inputs: same scenario, seed and ``step_seconds``
=> same times, to the bit. :class:`EventQueue` orders an asynchronous run's arrivals
(ties by node id, then push order); :class:`Traffic` counts the bytes
(``evaluation.reports.target_costs`` says what reaching the target accuracy cost).
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from robust.constraints import Interval, Param, Spec, table

from .calibration import load as load_calibration
from .traits import Churn, Link, Speed, build_churn, build_link, build_speed, draw, in_turn

HORIZON = 1_000_000  # epochs back_at looks ahead before it calls a node gone for good

CLOCK = table(
    Param("speed", Spec(build_speed, "a speed spec: uniform, slow:fraction=0.2,factor=10, lognormal:sigma=1"),
          "uniform", "per-node compute speed"),
    Param("link", Spec(build_link, "a link spec: none, lan, home:up_mbps=10,down_mbps=50,latency_ms=40"),
          "none", "per-node bandwidth and latency"),
    Param("churn", Spec(build_churn, "a churn spec: none, leave:p=0.02,back=0.2,period=60"),
          "none", "nodes leaving and coming back"),
    Param("step-seconds", Interval(float, 0, None), 0.0,
          "simulated seconds of one local step (0: measured once per model)"),
    Param("calibration", Spec(load_calibration, "a calibration file made by robust field --calibrate FILE"), "",
          "what a real deployment adds to each reply and round, measured in the field lab (empty: nothing)"),
)


class Volunteers:
    """The simulated population's traits, built once per cell; every query is pure."""

    def __init__(self, ids: Sequence[str], seed: int, speed: Speed, link: Link | Sequence[Link], churn: Churn) -> None:
        if isinstance(ids, str) or not ids or not all(isinstance(i, str) for i in ids):
            raise ValueError(f"ids must be a non-empty list of node ids (got {ids!r})")
        if len(set(ids)) != len(ids):
            raise ValueError("ids repeats a node: give each volunteer once")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0 (got {seed!r})")
        self.ids, self.seed = sorted(ids), seed
        self.speed, self.link, self.churn = speed, link, churn
        self._slowness = speed.slowness(self.ids, seed)
        self._link = in_turn(link, self.ids, seed)
        self._chain: dict[str, list[bool]] = {}  # node -> its states from epoch 0, extended on demand

    @classmethod
    def of(cls, ids: Sequence[str], seed: int, speed: str = "uniform", link: str | Sequence[str] = "none",
           churn: str = "none") -> Volunteers:
        """From specs, e.g. ``Volunteers.of(ids, 0, speed="slow:fraction=0.2,factor=10")``; ``link``
        may be a list of specs, given to the nodes in turn (:func:`in_turn`)."""
        links = build_link(link) if isinstance(link, str) else [build_link(spec) for spec in link]
        return cls(ids, seed, build_speed(speed), links, build_churn(churn))

    def slowness(self, node: str) -> float:
        """How many times ``step_seconds`` one of the node's steps takes."""
        return self._slowness[self._known(node)]

    def rates(self, node: str) -> tuple[float, float, float]:
        """The node's ``(up bits/s, down bits/s, latency s)``."""
        return self._link[self._known(node)]

    def compute_seconds(self, node: str, steps: int, step_seconds: float) -> float:
        _count("steps", steps)
        _seconds("step_seconds", step_seconds)
        return steps * step_seconds * self.slowness(node)

    def download_seconds(self, node: str, bytes_down: int) -> float:
        _count("bytes_down", bytes_down)
        _, down, latency = self.rates(node)
        return latency + 8 * bytes_down / down

    def upload_seconds(self, node: str, bytes_up: int) -> float:
        _count("bytes_up", bytes_up)
        up, _, latency = self.rates(node)
        return latency + 8 * bytes_up / up

    def transfer_seconds(self, node: str, bytes_up: int, bytes_down: int) -> float:
        """Both ways: a latency and ``8 * bytes / bandwidth`` each."""
        return self.download_seconds(node, bytes_down) + self.upload_seconds(node, bytes_up)

    def arrival(self, node: str, start: float, steps: int, step_seconds: float, bytes_up: int,
                bytes_down: int) -> float:
        """When the reply to a task sent at ``start`` arrives (summed in this order)."""
        _seconds("start", start)
        return (start + self.download_seconds(node, bytes_down) + self.compute_seconds(node, steps, step_seconds)
                + self.upload_seconds(node, bytes_up))

    def online(self, node: str, epoch: int) -> bool:
        """Whether ``node`` is there in ``epoch`` (a round, or an async interval of ``period``)."""
        _count("epoch", epoch)
        self._known(node)
        if self.churn.p == 0:
            return True
        chain = self._chain.setdefault(node, [True])
        while len(chain) <= epoch:  # each step's draw is keyed by its epoch: the order of queries is moot
            chain.append(self.churn.step(chain[-1], draw(self.seed, "churn", node, len(chain))))
        return chain[epoch]

    def epoch_at(self, t: float) -> int:
        """The async epoch holding simulated time ``t``: ``floor(t / period)``; 0 without churn."""
        _seconds("t", t)
        return 0 if math.isinf(self.churn.period) else math.floor(t / self.churn.period)

    def online_at(self, node: str, t: float) -> bool:
        return self.online(node, self.epoch_at(t))

    def leaves_during(self, node: str, start: float, end: float) -> bool:
        """Whether ``node`` is offline in any async epoch from ``start`` to ``end`` (inclusive):
        then the task sent at ``start`` never gets a reply."""
        if _seconds("end", end) < _seconds("start", start):
            raise ValueError(f"end must not be before start (got start={start!r}, end={end!r})")
        return not all(self.online(node, e) for e in range(self.epoch_at(start), self.epoch_at(end) + 1))

    def back_at(self, node: str, t: float) -> float:
        """The first simulated time ``>= t`` at which ``node`` is online (``t`` if it is);
        ``inf`` if it never comes back (``back=0``, or not within ``HORIZON`` epochs)."""
        epoch = self.epoch_at(t)
        if self.online(node, epoch):
            return float(t)
        if self.churn.back > 0:
            for e in range(epoch + 1, epoch + HORIZON):
                if self.online(node, e):
                    return e * self.churn.period
        return math.inf

    def _known(self, node: str) -> str:
        if node not in self._slowness:
            raise ValueError(f"unknown node {node!r}: not one of the {len(self.ids)} volunteers")
        return node


def measure_step_seconds(step: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Wall seconds of one call of ``step`` (one local step of the model, under the cell's
    compute profile): ``warmup`` untimed calls, then the median of ``repeat`` timed ones."""
    _count("warmup", warmup)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an integer >= 1 (got {repeat!r})")
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return max(statistics.median(times), 1e-9)  # a clock tick, never 0


class Event(NamedTuple):
    """A task's reply arriving at simulated ``time`` from ``node``; ``seq``: push order."""

    time: float
    node: str
    seq: int
    payload: object


class EventQueue:
    """A heap of arrivals, popped by time, then node id, then push order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str, int, Event]] = []
        self._seq = 0

    def push(self, time: float, node: str, payload: object = None) -> Event:
        _seconds("time", time)
        if not isinstance(node, str):
            raise ValueError(f"node must be a node id (a str; got {node!r})")
        event = Event(float(time), node, self._seq, payload)
        self._seq += 1
        heapq.heappush(self._heap, (event.time, node, event.seq, event))  # seq is unique: payloads never compared
        return event

    def pop(self) -> Event:
        """The next arrival; ``IndexError`` if there is none."""
        if not self._heap:
            raise IndexError("the event queue is empty: push an arrival first")
        return heapq.heappop(self._heap)[-1]

    def nodes(self) -> set[str]:
        """The nodes with an arrival still to come."""
        return {node for _, node, _, _ in self._heap}

    def peek(self) -> Event | None:
        return self._heap[0][-1] if self._heap else None

    def pop_until(self, time: float) -> list[Event]:
        """Every arrival at or before ``time``, in order (e.g. those before a deadline)."""
        out = []
        while self._heap and self._heap[0][0] <= time:
            out.append(self.pop())
        return out

    def __len__(self) -> int:
        return len(self._heap)


class Traffic:
    """Bytes sent to (down) and received from (up) the nodes, in total and per node."""

    def __init__(self) -> None:
        self.per_node: dict[str, list[int]] = {}  # node -> [up, down]

    def add(self, node: str, up: int = 0, down: int = 0) -> None:
        _count("up", up)
        _count("down", down)
        totals = self.per_node.setdefault(node, [0, 0])
        totals[0] += up
        totals[1] += down

    @property
    def bytes_up(self) -> int:
        return sum(up for up, _ in self.per_node.values())

    @property
    def bytes_down(self) -> int:
        return sum(down for _, down in self.per_node.values())

    def record(self) -> dict:
        """For a cell's result record: totals, and ``[up, down]`` per node, sorted by id."""
        return {"bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "per_node": {node: list(self.per_node[node]) for node in sorted(self.per_node)}}


def _count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0 (got {value!r})")
    return value


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} must be a finite number of seconds >= 0 (got {value!r})")
    return value
