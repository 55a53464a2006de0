"""The lab's network: one namespace for the coordinator, one per volunteer, joined by veth pairs.

Volunteer ``i`` (1-based) lives in ``robust-field-<tag>-v<i>`` behind the pair ``vc<i>`` (in the
coordinator's namespace, ``10.<net>.<i>.1/24``) - ``vv`` (in the volunteer's, ``10.<net>.<i>.2/24``).
No namespace has a default route or any interface but its loopback and its ends of the pairs,
so traffic can go only between the interfaces made here, never to the machine's own.

``tag`` is the process id of the lab that made them: a namespace whose lab is gone (killed, say)
is stale: :func:`remove_stale` deletes it (and ``evaluation.field.lab.cpu.remove_groups`` its CPU groups).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

PREFIX = "robust-field-"
NET = 201  # the lab's addresses: 10.201.<volunteer>.0/24
MAX_VOLUNTEERS = 250


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def inside(namespace: str) -> list[str]:
    """The prefix that runs a command inside ``namespace``."""
    return ["ip", "netns", "exec", namespace]


def refusal() -> str | None:
    """Why this machine cannot hold the lab (``None``: it can)."""
    if os.geteuid() != 0:
        return "robust field makes network namespaces and shapes links: run it as root (sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"robust field needs `{tool}` (iproute2): apt-get install iproute2"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"this machine cannot make network namespaces ({made.stderr.strip()}): run the lab where it can"
    ip("netns", "delete", probe, check=False)
    return None


def ours() -> list[str]:
    """The lab's namespaces on this machine, ours or stale."""
    names = ip("netns", "list").stdout.split()
    return sorted(name for name in names if name.startswith(PREFIX))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner(name: str) -> int | None:
    """The pid in a lab namespace's name (``None``: not a lab's)."""
    tag = name[len(PREFIX):].split("-", 1)[0]
    return int(tag) if tag.isdigit() else None


def is_stale(name: str) -> bool:
    """Whether a lab-named namespace or group belongs to a lab that is gone."""
    pid = owner(name)
    return pid is None or not _alive(pid)


def remove_stale() -> list[str]:
    """Delete the namespaces of labs that are gone; return their names."""
    stale = [name for name in ours() if is_stale(name)]
    for name in stale:
        ip("netns", "delete", name, check=False)
    return stale


@dataclass(frozen=True)
class Pair:
    """Volunteer ``index``'s namespace and addresses."""

    index: int
    namespace: str
    coordinator_dev: str  # in the coordinator's namespace
    volunteer_dev: str  # in the volunteer's
    coordinator_ip: str
    volunteer_ip: str


class Network:
    """The coordinator's namespace and ``n`` volunteers', made at once; :meth:`remove` deletes all."""

    def __init__(self, n: int, tag: int | None = None) -> None:
        if not 1 <= n <= MAX_VOLUNTEERS:
            raise ValueError(f"the lab holds 1 to {MAX_VOLUNTEERS} volunteers (got {n}): lower nodes")
        self.tag = os.getpid() if tag is None else tag
        self.coordinator = f"{PREFIX}{self.tag}-c"
        self.pairs = [Pair(i, f"{PREFIX}{self.tag}-v{i}", f"vc{i}", "vv", f"10.{NET}.{i}.1", f"10.{NET}.{i}.2")
                      for i in range(1, n + 1)]
        self.made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.remove()
            raise

    def _make(self) -> None:
        for name in [self.coordinator, *(p.namespace for p in self.pairs)]:
            ip("netns", "add", name)
            self.made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        for p in self.pairs:
            ip("-n", self.coordinator, "link", "add", p.coordinator_dev, "type", "veth", "peer", "name",
               p.volunteer_dev, "netns", p.namespace)
            ip("-n", self.coordinator, "addr", "add", f"{p.coordinator_ip}/24", "dev", p.coordinator_dev)
            ip("-n", p.namespace, "addr", "add", f"{p.volunteer_ip}/24", "dev", p.volunteer_dev)
            ip("-n", self.coordinator, "link", "set", p.coordinator_dev, "up")
            ip("-n", p.namespace, "link", "set", p.volunteer_dev, "up")

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Each volunteer's ``(bytes up, bytes down)`` on the wire so far (its pair's counters
        on the coordinator's end)."""
        links = json.loads(ip("-n", self.coordinator, "-j", "-s", "link", "show").stdout)
        stats = {link["ifname"]: link["stats64"] for link in links}
        return {p.index: (stats[p.coordinator_dev]["rx"]["bytes"], stats[p.coordinator_dev]["tx"]["bytes"])
                for p in self.pairs}

    def remove(self) -> None:
        """Delete every namespace made (their veth pairs go with them)."""
        for name in reversed(self.made):
            ip("netns", "delete", name, check=False)
        self.made = []

