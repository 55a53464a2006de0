"""What ``robust node join`` tells its volunteer, and where Flower's own words go.

The terminal gets one line per task this node answered, its own training or a spot check of
another node's update (round, kind, local steps, seconds, bytes up, sent or declined and why,
or lost on the way), read from the node's work log (``nodes.volunteer.worklog``: what its
trainer or ClientApp did, never Flower's text); and one line when the coordinator stops
answering (its run finished, or it stopped) and one when it answers again, from a connection
the supervisor itself tries every ``PROBE_EVERY`` seconds. The node stays joined meanwhile: a
coordinator comes back to resume its run or to start the next one, and a volunteer who
wants to leave presses Ctrl-C.

Flower's log (the SuperNode, its SuperExec and the per-task ClientApp processes: two lines
per message, a retry line per failed connection, forever) goes to ``DIR/flower.log``, each
line timed and in plain text: Flower colours its lines even where they go to a file.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

from .. import launch
from . import worklog

FLOWER_LOG = "flower.log"
PROBE_EVERY = 3.0  # seconds between two tries of the coordinator's port
GONE_AFTER = 2  # failed tries in a row before the coordinator is said to be gone (one is a blip)
KINDS = {worklog.TRAINING: "training", worklog.CHECK: "spot check", worklog.DISPUTE: "dispute answered"}
COLOUR = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")  # ANSI escape codes


def say(text: str, at: float | None = None) -> None:
    """Print ``text`` to the volunteer, after the local time (now, or ``at``: Unix time)."""
    print(f"{time.strftime('%H:%M:%S', time.localtime(at))} {text}", flush=True)


def task_line(entry: dict) -> str:
    """A line of the work log, as the volunteer reads it."""
    what = f"round {entry['round']} {KINDS[entry['kind']]}"
    if "refused_by_runtime" in entry:
        return f"{what}: the reply was lost: {entry['refused_by_runtime']}"
    steps = entry["steps"]
    done = f"{what}: {steps} local step{'s' * (steps != 1)} in {entry['seconds']:.2f} s, {entry['bytes']:,} B up"
    return f"{done}, declined: {entry['reason']}" if entry["declined"] else f"{done}, sent"


def keep_flower_log(proc: subprocess.Popen, path: Path) -> None:
    """Copy the output of ``proc`` (a pipe: the SuperNode's, and its children's) to ``path`` as
    it comes, each line timed, colour codes removed; until every process holding it exits."""
    def copy() -> None:
        with open(path, "ab") as out:
            out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} SuperNode started (pid {proc.pid})\n".encode())
            for line in proc.stdout:
                out.write(time.strftime("%Y-%m-%d %H:%M:%S ").encode() + COLOUR.sub(b"", line))
                out.flush()

    threading.Thread(target=copy, name="flower-log", daemon=True).start()


class Terminal:
    """What the volunteer of ``folder``, joined to ``coordinator`` (``HOST:PORT``; ``answering``
    when it joined), is told: :meth:`show`, called every second or so."""

    def __init__(self, folder: Path, coordinator: str, answering: bool) -> None:
        self.folder, self.coordinator, self.answering = folder, coordinator, answering
        path = folder / worklog.WORK_LOG
        self.offset = path.stat().st_size if path.exists() else 0  # a previous session's tasks were shown then
        self.last: dict | None = None  # the last task this node answered
        self.failed, self.next_try = 0, 0.0

    def show(self) -> None:
        """Say the tasks answered since the last call, and whether the coordinator stopped or
        started answering."""
        entries, self.offset = worklog.since(self.folder, self.offset)
        for entry in entries:
            if entry["run"] != (self.last or {}).get("run"):
                say(f"run {entry['run']}", entry["time"])
            say(task_line(entry), entry["time"])
            self.last = entry
        if time.monotonic() >= self.next_try:
            self.next_try = time.monotonic() + PROBE_EVERY
            self._probe()

    def _probe(self) -> None:
        host, _, port = self.coordinator.rpartition(":")
        up = launch.answers(int(port), host.strip("[]"))
        self.failed = 0 if up else self.failed + 1
        if up and not self.answering:
            self.answering = True
            say(f"the coordinator at {self.coordinator} answers: waiting for its tasks")
        elif self.answering and self.failed >= GONE_AFTER:
            self.answering = False
            after = f" after round {self.last['round']}" if self.last else ""
            say(f"the coordinator at {self.coordinator} stopped answering{after}: its run has finished, or it "
                "stopped. Waiting for it to come back with a run (Ctrl-C to leave)")
