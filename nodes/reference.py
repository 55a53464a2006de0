"""The product's parameter reference, as data, for the manual's generated pages: every rule,
pre-aggregator, attack, codec, protocol, staleness weight and detector, and the coordinator's
settings, each read from its one declaration (``robust.registry.entry``), so the reference
cannot drift from what the code checks.

The bench's own families live above ``nodes`` and are described the same way by their
caller: ``evaluation.simtime.traits.SPEEDS.describe()`` (and ``LINKS``, ``CHURNS``), and
``entry("scenario", "scenario", doc, evaluation.bench.scenario.SCENARIO)``.
"""

from __future__ import annotations

import re

import aggregators
import attacks
from robust import codecs
from robust.registry import entry

from . import settings
from .engine import detectors, protocol, staleness

_BULLET = re.compile(r"^- ``([a-z-]+)``: (.*?)(?=^- |\Z)", re.MULTILINE | re.DOTALL)


def describe() -> list[dict]:
    """One :func:`robust.registry.entry` per component, family by family (``aggregator``,
    ``attack``, ``codec``, ``protocol``, ``staleness``, ``detector``, ``settings``), names
    sorted within a family. An aggregator's entry also says its ``role`` (``rule`` or
    ``pre-aggregator``) and what it ``needs`` besides the rows; an attack's its ``kind``
    (``omniscient`` or ``node``). A detector has no parameters: its summary is its line of
    ``nodes.engine.detectors``' docstring."""
    out = [{**e, "role": "rule" if aggregators.REGISTRY.entries[e["name"]].is_rule else "pre-aggregator",
            "needs": sorted(aggregators.REGISTRY.entries[e["name"]].needs)} for e in aggregators.REGISTRY.describe()]
    out += [{**e, "kind": attacks.REGISTRY.entries[e["name"]].kind} for e in attacks.REGISTRY.describe()]
    out += codecs.REGISTRY.describe()
    for family, module in (("protocol", protocol), ("staleness", staleness)):
        out += [entry(family, kind, module.__doc__, module.PARAMS[kind]) for kind in sorted(module.PARAMS)]
    lines = {name: " ".join(text.split()) for name, text in _BULLET.findall(detectors.__doc__)}
    out += [entry("detector", name, lines[name], {}) for name in sorted(detectors.DETECTORS)]
    out.append(entry("settings", "coordinator", settings.__doc__, settings.PARAMS))
    return out
