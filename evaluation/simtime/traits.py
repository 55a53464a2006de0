"""The simulated volunteers' traits, as spec components: compute speed, network link, churn.

Three families, one registry each, in the spec grammar (``robust.spec``), one component per
spec:

- **speed**: each node's *slowness*, the factor its local steps take over ``step_seconds``.
  ``uniform`` (all 1); ``slow:fraction=0.2,factor=10`` (exactly ``round(fraction * n)``
  nodes, Python's rounding, are ``factor`` times slower: a seeded choice among all ids,
  honest and Byzantine alike, that depends on the set of ids, not their order);
  ``lognormal:sigma=1`` (node ``i`` has ``exp(sigma * z_i)``, ``z_i ~ N(0, 1)`` seeded by
  its id, divided by the population's median, the lower one for even ``n``, so the median
  node has slowness exactly 1 and half the nodes are faster than ``step_seconds`` says).
- **link**: each node's bandwidth up and down (Mbps, 10^6 bits/s) and latency (ms).
  ``none`` (infinitely fast, no latency: the default); ``lan`` (1000/1000 Mbps, 1 ms) and
  ``home`` (10 up / 50 down Mbps, 40 ms), any value overridable, e.g.
  ``home:up_mbps=5,latency_ms=80``; ``sigma`` (default 0) spreads bandwidths per node by a
  seeded ``exp(sigma * z_i)`` normalised as for speed (the given bandwidth is the median).
- **churn**: ``none``; ``leave:p=0.02,back=0.2,period=60``: each node's presence is a
  two-state Markov chain over epochs: every node is online at epoch 0; at each later epoch
  an online node leaves with probability ``p`` and an offline node comes back with
  probability ``back`` (stationary share online: ``back / (p + back)``). An epoch is a round
  of a synchronous run, or ``period`` simulated seconds of an asynchronous one
  (:class:`evaluation.simtime.arrivals.Volunteers` says how the drivers use it).

The traits take no ``f`` (they concern honest and Byzantine nodes alike); ``Component``'s is
passed as 0. Each declares its parameters as data (``robust.registry``). Random draws are
hashes, ``derive(seed, purpose, node[, epoch])`` (:func:`draw`): a pure function of the seed
and the node's identity, no generator state, no global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

from robust.constraints import Interval, Param
from robust.registry import Component, Registry
from robust.seeds import derive
from robust.spec import parse

SPEEDS: Registry[Speed] = Registry("speed")
LINKS: Registry[Link] = Registry("link")
CHURNS: Registry[Churn] = Registry("churn")


def draw(*parts: object) -> float:
    """A number in (0, 1) that depends only on ``parts`` (``derive``'s 63 bits)."""
    return (derive(*parts) + 0.5) / 2.0**63


def median_one(ids: list[str], seed: int, purpose: str, sigma: float) -> dict[str, float]:
    """``exp(sigma * z_i)`` per node (``z_i`` standard normal, seeded by ``(seed, purpose,
    node)``), divided by the population's (lower) median so the median node has exactly 1."""
    normal = NormalDist()
    raw = {node: math.exp(sigma * normal.inv_cdf(draw(seed, purpose, node))) for node in ids}
    middle = sorted(raw.values())[(len(raw) - 1) // 2]
    return {node: value / middle for node, value in raw.items()}


class Trait(Component):
    """A speed, link or churn kind, built from one spec component."""

    def __init__(self, f: int = 0, **params: object) -> None:
        super().__init__(f, **params)


def _build(registry: Registry, spec: str) -> Trait:
    components = parse(spec)
    if len(components) != 1:
        raise ValueError(f"a {registry.family} spec names one kind (got {spec!r}): drop the '+'")
    comp = components[0]
    return registry.lookup(comp.name, spec)(0, **comp.params)


def build_speed(spec: str) -> Speed:
    """The speed kind of ``spec``, e.g. ``"slow:fraction=0.2,factor=10"``."""
    return _build(SPEEDS, spec)


def build_link(spec: str) -> Link:
    """The link kind of ``spec``, e.g. ``"home:up_mbps=10,down_mbps=50,latency_ms=40"``."""
    return _build(LINKS, spec)


def build_churn(spec: str) -> Churn:
    """The churn kind of ``spec``, e.g. ``"leave:p=0.02,back=0.2"``."""
    return _build(CHURNS, spec)


# -- speed --------------------------------------------------------------------------------


class Speed(Trait):
    def slowness(self, ids: list[str], seed: int) -> dict[str, float]:
        """Each node's factor over ``step_seconds``."""
        raise NotImplementedError


@SPEEDS.register
class Uniform(Speed):
    name = "uniform"

    def slowness(self, ids: list[str], seed: int) -> dict[str, float]:
        return dict.fromkeys(ids, 1.0)


@SPEEDS.register
class Slow(Speed):
    name = "slow"

    params = (
        Param("fraction", Interval(float, 0, 1), 0.2, "the share of nodes that are slow"),
        Param("factor", Interval(float, 1, None), 10.0, "how many times slower they are"),
    )

    def slowness(self, ids: list[str], seed: int) -> dict[str, float]:
        # rank by a per-node hash: the choice depends on the set of ids, not on their order
        ranked = sorted(ids, key=lambda node: (derive(seed, "speed", "slow", node), node))
        slow = set(ranked[: round(self.fraction * len(ids))])
        return {node: self.factor if node in slow else 1.0 for node in ids}


@SPEEDS.register
class Lognormal(Speed):
    name = "lognormal"

    params = (Param("sigma", Interval(float, 0, None), 1.0, "the log-slowness's spread"),)

    def slowness(self, ids: list[str], seed: int) -> dict[str, float]:
        return median_one(ids, seed, "speed-lognormal", self.sigma)


# -- link ---------------------------------------------------------------------------------


class Link(Trait):
    """Bandwidths in bits per second and latency in seconds, per node."""

    up_mbps = down_mbps = math.inf
    latency_ms = sigma = 0.0

    def of(self, ids: list[str], seed: int) -> dict[str, tuple[float, float, float]]:
        """``node -> (up bits/s, down bits/s, latency s)``."""
        spread = median_one(ids, seed, "link", self.sigma) if self.sigma else dict.fromkeys(ids, 1.0)
        return {node: (self.up_mbps * 1e6 * s, self.down_mbps * 1e6 * s, self.latency_ms / 1e3)
                for node, s in spread.items()}


def in_turn(link: Link | Sequence[Link], ids: list[str], seed: int) -> dict[str, tuple[float, float, float]]:
    """Each node's ``(up bits/s, down bits/s, latency s)``: from ``link``, or from a list of
    links given to the sorted ``ids`` in turn (node ``i`` on ``link[i % len(link)]``; each
    link's ``sigma`` spreads over the nodes it serves)."""
    if isinstance(link, Link):
        return link.of(ids, seed)
    if not link:
        raise ValueError("a list of links needs at least one: give each node's link spec in turn")
    ordered = sorted(ids)
    out: dict[str, tuple[float, float, float]] = {}
    for k, kind in enumerate(link[: len(ordered)]):  # more links than nodes: the extra serve none
        out.update(kind.of(ordered[k :: len(link)], seed))
    return out


def link_params(up_mbps: float, down_mbps: float, latency_ms: float) -> tuple[Param, ...]:
    """A link kind's parameters, with its own defaults."""
    return (
        Param("up_mbps", Interval(float, 0, None, "neither"), up_mbps, "the median node's upload, megabits per second"),
        Param("down_mbps", Interval(float, 0, None, "neither"), down_mbps, "its download, megabits per second"),
        Param("latency_ms", Interval(float, 0, None), latency_ms, "its latency, milliseconds"),
        Param("sigma", Interval(float, 0, None), 0.0, "the bandwidths' log spread across nodes"),
    )


@LINKS.register
class NoLink(Link):
    name = "none"


@LINKS.register
class Lan(Link):
    name = "lan"

    params = link_params(1000.0, 1000.0, 1.0)


@LINKS.register
class Home(Link):
    name = "home"

    params = link_params(10.0, 50.0, 40.0)


# -- churn --------------------------------------------------------------------------------


class Churn(Trait):
    """One step of the presence chain: ``p`` to leave, ``back`` to return, per epoch."""

    p, back, period = 0.0, 1.0, math.inf

    def step(self, online: bool, u: float) -> bool:
        """The next epoch's state from this one's and a uniform draw ``u`` in (0, 1)."""
        return u >= self.p if online else u < self.back


@CHURNS.register
class NoChurn(Churn):
    name = "none"


@CHURNS.register
class Leave(Churn):
    name = "leave"

    params = (
        Param("p", Interval(float, 0, 1), 0.02, "the chance an online node leaves, per epoch"),
        Param("back", Interval(float, 0, 1), 0.2, "the chance an offline node returns, per epoch"),
        Param("period", Interval(float, 0, None, "neither"), 60.0, "simulated seconds per epoch (async runs)"),
    )
