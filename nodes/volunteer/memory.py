"""The memory a volunteer can still give a task, as the kernel will enforce it, and the decline
of a task that needs more (instead of the OOM killer ending the trainer mid-task).

What this process may still take is the least of the machine's ``MemAvailable``
(``/proc/meminfo``) and, for its memory control group and each group above it, the group's
limit less its use: cgroup v2's ``memory.max`` and ``memory.current``, v1's
``memory.limit_in_bytes`` and ``memory.usage_in_bytes``, the use less the page cache the kernel
can drop first (``inactive_file`` of ``memory.stat``). A container, a ``systemd-run -p
MemoryMax=``, a batch scheduler's job are such groups.

A task says what it needs (``nodes.wire.Task.memory``: the model as received, the training's
parameters and optimiser state, a gradient; ``nodes.engine.protocol.Protocol.memory``);
the model is already here when the task is read, so the rest is what must still fit.
"""

from __future__ import annotations

from pathlib import Path

from ..engine.protocol import Protocol
from ..wire import Task

CGROUP = Path("/sys/fs/cgroup")
MB = 2**20
UNLIMITED = 2**60  # v1 says "no limit" with a number near 2**63


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(group: Path, key: str) -> int:
    for line in (_read(group / "memory.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def groups() -> list[tuple[Path, str]]:
    """This process's memory control group and those above it, each with its version (``v2``/``v1``)."""
    found = []
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and "memory" in (_read(CGROUP / "cgroup.controllers") or "").split():
            base, version = CGROUP, "v2"
        elif "memory" in controllers.split(","):
            base, version = CGROUP / "memory", "v1"
        else:
            continue
        group = base / path.lstrip("/")
        while True:
            found.append((group, version))
            if group == base:
                break
            group = group.parent
    return found


def _headroom(group: Path, version: str) -> int | None:
    """Bytes ``group`` may still take (``None``: it has no limit, or cannot be read)."""
    names = ("memory.max", "memory.current", "inactive_file") if version == "v2" else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    limit, used = _read(group / names[0]), _read(group / names[1])
    if limit is None or used is None or limit == "max" or int(limit) >= UNLIMITED:
        return None
    return int(limit) - max(int(used) - _stat(group, names[2]), 0)


def available() -> tuple[int, str]:
    """Bytes this process may still take, and what bounds it (in words)."""
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024
               for line in (_read(Path("/proc/meminfo")) or "").splitlines() if line.endswith("kB")}
    best, said = meminfo.get("MemAvailable", UNLIMITED), "the machine's available memory"
    for group, version in groups():
        room = _headroom(group, version)
        if room is not None and room < best:
            best, said = room, f"its memory control group {group} (limit less use)"
    return max(best, 0), said


def shortfall(task: Task, d: int) -> str:
    """Why this node cannot hold ``task`` on a ``d``-parameter model (``""``: it can, or the task
    does not say what it needs)."""
    if not task.memory:
        return ""
    parts = Protocol.of(task).memory(d)
    still = task.memory - parts["model"]  # the model is here already
    room, bound = available()
    if still <= room:
        return ""
    said = ", ".join(f"{name} {size / MB:,.0f}" for name, size in parts.items())
    return (f"this task needs {task.memory / MB:,.0f} MB held at once ({said} MB), {still / MB:,.0f} MB more than "
            f"this node holds now, and {bound} gives it {room / MB:,.0f} MB: free memory, raise the limit, or join "
            "runs of smaller models")


def capacity(room: int) -> str:
    """Which models ``room`` bytes can train (what ``robust node join`` says at start)."""
    sizes = [(inner, room // sum(Protocol.parse(f"delta:inner={inner}", lr=0.1, momentum=0.0, batch_size=1)
                                 .memory(1).values())) for inner in ("sgd", "adamw")]
    return "the parameters, gradient and optimiser state of models up to " + " or ".join(f"{d / 1e6:,.0f}M parameters ({'local SGD' if inner == 'sgd' else 'AdamW'})"
                                         for inner, d in sizes)
