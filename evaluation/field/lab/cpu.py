"""A volunteer's share of the CPU: a control group with a CPU quota, the kernel's own.

With cgroup v2 (``cpu`` among ``/sys/fs/cgroup/cgroup.controllers``) a group's ``cpu.max`` is
``quota period``; with v1 (this project's machines), the ``cpu`` hierarchy's
``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` say the same. A share of 0.5 lets the group's
processes run 50 ms of every 100 ms, on any core. A process joins a group by writing its pid
to the group's ``cgroup.procs`` before it starts the program (:func:`join_prefix`); what it
starts stays in the group. Groups are named ``robust-field-<tag>-v<i>`` as the namespaces are.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .netns import PREFIX

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
MIN_SHARE = 0.01  # the kernel's quota floor is 1 ms a period


def hierarchy() -> tuple[Path, str] | None:
    """Where CPU groups are made and the version (``"v2"``/``"v1"``); ``None``: no CPU controller."""
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return ROOT, "v2"
    if (ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        return ROOT / "cpu", "v1"
    return None


class Group:
    """A CPU group holding ``share`` of one CPU (``share`` may exceed 1: several cores)."""

    def __init__(self, name: str, share: float) -> None:
        found = hierarchy()
        if found is None:
            raise RuntimeError("this machine has no CPU controller (cgroup v1 `cpu` or v2 `cpu`): give the volunteers "
                               "no cpu share (drop cpu-share) or run the lab where there is one")
        if not name.startswith(PREFIX):
            raise ValueError(f"a lab's group is named {PREFIX}...: got {name!r}")
        if share < MIN_SHARE:
            raise ValueError(f"a volunteer's cpu share must be at least {MIN_SHARE} of a CPU (got {share:g})")
        base, self.version = found
        self.path = base / name
        self.path.mkdir(exist_ok=True)
        quota = max(1000, round(share * PERIOD_US))
        if self.version == "v2":
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
        else:
            (self.path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        self.share = quota / PERIOD_US

    def join_prefix(self) -> list[str]:
        """A command prefix that moves the process into this group, then runs the rest."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh"]

    def remove(self) -> None:
        _remove(self.path)


def _remove(path: Path) -> None:
    """Remove a group once its processes are gone (those left are moved to the parent first)."""
    if not path.exists():
        return
    procs = path / "cgroup.procs"
    for pid in procs.read_text().split() if procs.exists() else []:
        try:
            (path.parent / "cgroup.procs").write_text(pid)
        except OSError:  # it exited meanwhile
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove_groups(stale: Callable[[str], bool]) -> None:
    """Remove the lab's groups whose name ``stale`` says belongs to a lab that is gone."""
    found = hierarchy()
    if found is None:
        return
    for path in found[0].glob(PREFIX + "*"):
        if path.is_dir() and stale(path.name):
            _remove(path)
