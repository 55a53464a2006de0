"""The coordinator as the field tools run it: ``robust coordinator start`` in a process group of
its own (optionally in a network namespace), and started again when it crashes: it resumes from
its checkpoint, as a user's would under systemd."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from nodes import checkpoint, launch

POLL = 0.05
MAX_CRASHES = 3


def start(coord: Path, wrap: list[str] = ()) -> subprocess.Popen:
    """``robust coordinator start COORD`` (logging to ``COORD/start.log``), returned once it has
    registered the keys and submitted the run."""
    log = coord / "start.log"
    seen = log.stat().st_size if log.exists() else 0
    proc = launch.spawn([sys.executable, "-m", "robust.cli", "coordinator", "start", str(coord)],
                        coord / launch.FLWR_HOME, log, own_group=True, wrap=wrap)
    until = time.monotonic() + 300
    while b" submitted" not in log.read_bytes()[seen:]:
        if proc.poll() is not None or time.monotonic() > until:
            launch.stop(proc)
            raise RuntimeError(f"the coordinator did not start: see {log}")
        time.sleep(POLL)
        launch.raise_if_terminated()
    return proc


class Supervised:
    """A coordinator started again each time it exits without its result, at most
    :data:`MAX_CRASHES` times; ``crashes`` counts them."""

    def __init__(self, coord: Path, wrap: list[str] = ()) -> None:
        self.coord, self.wrap, self.crashes = coord, list(wrap), 0
        self.proc = start(coord, self.wrap)

    def finished(self) -> bool:
        """Whether the run has its result; a coordinator that exited without one is started again."""
        if self.proc.poll() is None:
            return False
        if (self.coord / checkpoint.RESULT).exists():
            return True
        self.crashes += 1
        if self.crashes > MAX_CRASHES:
            raise RuntimeError(f"the coordinator crashed {self.crashes} times: see {self.coord / 'start.log'}")
        self.proc = start(self.coord, self.wrap)
        return False

    def stop(self) -> None:
        launch.stop(self.proc)
