"""A volunteer of the lab: its warm trainer and SuperNode in its own namespace, its trainer in
its CPU group, and the relay that gives its link its latency, started and stopped together
(churn stops and starts them on the scenario's schedule)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen

from nodes import launch
from nodes.volunteer import worklog

from .cpu import Group
from .netns import Pair, inside

RELAY_PORT = 9190  # each namespace has its own loopback: every relay listens on the same port


@dataclass
class Volunteer:
    folder: Path
    fp: str
    pair: Pair
    latency_ms: float
    group: Group
    procs: list[Popen] = field(default_factory=list)  # its relay and SuperNode
    trainer: Popen | None = None
    stopped_at: list[float] = field(default_factory=list)  # wall times churn stopped it

    @property
    def running(self) -> bool:
        return bool(self.procs)

    def exited(self) -> bool:
        """Whether one of its processes has exited (a SuperNode gives up on a TLS error, say)."""
        return any(p.poll() is not None for p in [*self.procs, *([self.trainer] if self.trainer else [])])

    def warm(self) -> None:
        """Start its warm trainer (in its CPU group, then its namespace: ``ip netns exec`` mounts a
        sysfs of its own), as a volunteer's machine has it running before a run begins."""
        if self.trainer is None:
            self.trainer = launch.start_trainer(self.folder, self.folder / "trainer.log",
                                                wrap=[*self.group.join_prefix(), *inside(self.pair.namespace)])

    def start(self, coordinator_port: int, ca: Path) -> None:
        """Its trainer (if not warm yet), its relay, and its SuperNode, which connects through it."""
        self.warm()
        relay = [sys.executable, "-m", "evaluation.field.lab.relay", str(RELAY_PORT),
                 f"{self.pair.coordinator_ip}:{coordinator_port}", f"{self.latency_ms:g}"]
        here = inside(self.pair.namespace)
        self.procs = [launch.spawn(relay, self.folder / launch.FLWR_HOME, self.folder / "relay.log", wrap=here),
                      launch.start_supernode(self.folder, f"127.0.0.1:{RELAY_PORT}", ca.resolve(),
                                             self.folder / "supernode.log", wrap=here)]

    def stop(self, churned: bool = False) -> None:
        for proc in [*reversed(self.procs), *([self.trainer] if self.trainer else [])]:
            launch.stop(proc, grace=5.0)
        self.procs, self.trainer = [], None
        if churned:
            self.stopped_at.append(time.time())

    def replies(self, run: str) -> list[dict]:
        """The training replies it handed to its SuperNode in ``run``, as its work log says."""
        path = self.folder / worklog.WORK_LOG
        lines, _ = worklog.since(self.folder, 0) if path.exists() else ([], 0)
        return [e for e in lines if e["run"] == run and e.get("kind") == worklog.TRAINING and not e.get("declined")
                and "refused_by_runtime" not in e]
