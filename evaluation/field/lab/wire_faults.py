"""Faults on the wire, played by the field lab on a volunteer's real link, on a wall schedule.

The scenario key ``faults`` takes a spec, several joined by ``+`` (``none``: no fault), e.g.
``faults = "link-down:node=2,after=30,seconds=20+restart:node=5,after=60"``. ``node`` is the
volunteer's place in sorted id order, from 1, as a list of links gives them in turn; ``after``
is wall seconds after the run's submission.

- ``link-down``: the volunteer's pair goes down for ``seconds`` (both ends: no packet either
  way), then comes back. Its connections see what a dropped Wi-Fi shows them.
- ``slow-link``: both directions of a shaped link drop to ``factor`` of their rate for
  ``seconds`` (a congested path); an unshaped link is refused.
- ``restart``: the volunteer's processes are stopped and started again, with its folder: it
  comes back with its old state (key, momentum, work log), as after a reboot.

Only ``robust field`` plays them: the bench's clock has no word for them, and refuses any but
``none``.
"""

from __future__ import annotations

from robust.constraints import Interval, Param
from robust.registry import Registry
from robust.spec import parse

from evaluation.simtime.traits import Trait

FAULTS: Registry[Fault] = Registry("fault")


class Fault(Trait):
    """A fault of one volunteer, from ``after`` seconds into the run."""

    params = (
        Param("node", Interval(int, 1, None), 1, "the volunteer, by its place in sorted id order (from 1)"),
        Param("after", Interval(float, 0, None), 30.0, "wall seconds after the run's submission"),
    )
    seconds = 0.0  # how long it lasts (0: an event)
    spec = ""


@FAULTS.register
class NoFault(Fault):
    name = "none"


@FAULTS.register
class LinkDown(Fault):
    name = "link-down"

    params = (Param("seconds", Interval(float, 0, None, "neither"), 20.0, "how long the link is down"),)


@FAULTS.register
class SlowLink(Fault):
    name = "slow-link"

    params = (
        Param("seconds", Interval(float, 0, None, "neither"), 60.0, "how long the link is slow"),
        Param("factor", Interval(float, 0, 1, "neither"), 0.01, "the share of its rate left"),
    )


@FAULTS.register
class Restart(Fault):
    name = "restart"


def build_faults(spec: str) -> list[Fault]:
    """The faults of ``spec`` (``none``: none)."""
    out = []
    for comp in parse(spec):
        fault = FAULTS.lookup(comp.name, spec)(0, **comp.params)
        fault.spec = str(comp)  # as the scenario wrote it, for the record
        out.append(fault)
    return [fault for fault in out if fault.name != "none"]
