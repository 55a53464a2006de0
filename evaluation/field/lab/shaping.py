"""Shaping one direction of a link: an ``htb`` qdisc on the egress of the end that sends it.

Each direction is shaped where it leaves: the volunteer's upload on its own end of the pair, its
download on the coordinator's end (``netem`` and ``ifb`` are not needed; this kernel has
neither). The root class holds the link's rate; under it small packets (IP length < 128 bytes:
TCP's acknowledgements, gRPC's pings) go first, in a class of their own, so that a 2 Mbit/s
upload full of a reply does not starve the acknowledgements of the 20 Mbit/s download beside
it (without it, measured here, a 20 Mbit/s download under a busy 2 Mbit/s upload ran at 6.5).
A home router's queue does the same for its own acknowledgements.

:func:`counters` reads the qdisc's statistics back (``tc -s``): bytes sent, packets dropped and
times it held packets back (``overlimits``), so a test can see that shaping acted.
"""

from __future__ import annotations

import json
import math
import subprocess

MAX_MBPS = 1000.0  # a veth pair carries a few Gbit/s here: the lab shapes at most this
MIN_MBPS = 0.01
SMALL = "0xff80"  # IP total length & 0xff80 == 0: under 128 bytes


def tc(namespace: str, *args: str) -> str:
    done = subprocess.run(["tc", "-n", namespace, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`tc -n {namespace} {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def refusal(mbps: float, what: str) -> str | None:
    """Why the lab cannot shape a rate of ``mbps`` (``None``: it can; ``inf``: left unshaped)."""
    if math.isinf(mbps):
        return None
    if not MIN_MBPS <= mbps <= MAX_MBPS:
        return (f"the lab shapes links from {MIN_MBPS:g} to {MAX_MBPS:g} Mbit/s (got {what} {mbps:g}): "
                "set the link's rate within that, or leave it out (none: unshaped)")
    return None


def shape(namespace: str, dev: str, mbps: float) -> None:
    """Limit what leaves ``dev`` (in ``namespace``) to ``mbps`` megabits per second."""
    if math.isinf(mbps):
        return
    reason = refusal(mbps, "a rate of")
    if reason:
        raise ValueError(reason)
    tc(namespace, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    _classes(namespace, dev, mbps, "add")
    tc(namespace, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
       "match", "u16", "0x0000", SMALL, "at", "2", "flowid", "1:10")


def reshape(namespace: str, dev: str, mbps: float) -> None:
    """Change the rate of a direction :func:`shape` shaped (a slow-link fault, and its end)."""
    _classes(namespace, dev, mbps, "change")


def _classes(namespace: str, dev: str, mbps: float, verb: str) -> None:
    """The root class at the rate; under it the small packets' class, then the rest's."""
    rate = f"{mbps * 1e6:.0f}bit"
    small_bps = max(mbps * 1e6 / 20, 8e3)
    small, bulk = f"{small_bps:.0f}bit", f"{max(mbps * 1e6 - small_bps, 8e3):.0f}bit"
    tc(namespace, "class", verb, "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate,
       "quantum", "1514")
    for classid, guaranteed, prio in (("1:10", small, "0"), ("1:20", bulk, "1")):
        tc(namespace, "class", verb, "dev", dev, "parent", "1:1", "classid", classid, "htb", "rate", guaranteed,
           "ceil", rate, "prio", prio, "quantum", "1514")


def counters(namespace: str, dev: str) -> dict:
    """The root qdisc's statistics on ``dev``: ``kind``, ``bytes``, ``packets``, ``drops``,
    ``overlimits`` (``{}``: no qdisc of ours there)."""
    for qdisc in json.loads(tc(namespace, "-j", "-s", "qdisc", "show", "dev", dev) or "[]"):
        if qdisc.get("root") and qdisc.get("kind") == "htb":
            return {k: qdisc.get(k, 0) for k in ("kind", "bytes", "packets", "drops", "overlimits")}
    return {}
