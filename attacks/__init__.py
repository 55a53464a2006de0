"""Byzantine behaviours: omniscient attacks on the round's updates and node-side attacks.

    >>> import attacks, torch
    >>> attack = attacks.build("alie:z=1.5", f=2)
    >>> rows = attack(torch.randn(8, 4), attacks.Context(n=10, generator=torch.Generator()))
    >>> rows.shape
    torch.Size([2, 4])

The spec grammar is the aggregators' (``name:key=value,...``); ``names()`` lists attacks and
``sources()`` the file each one lives in (``robust attacks`` prints them): one file per attack,
named after it (a family such as ``fang-krum``, ``fang-trimmed-mean`` shares one).
"""

from __future__ import annotations

import inspect
from pathlib import Path

from robust.spec import parse

from . import (  # noqa: F401  (registration)
    alie, alie_local, backdoor, cc_orthogonal, drift, evade, fang, forge, gaussian, inf, ipm, label_flip, lazy, mimic,
    min_max, min_sum, none, optimal, poisoned_fl, sign_flip,
)
from . import bad_dispute, fewer_steps, other_data, replay_row  # noqa: F401  (registration: cheats recomputation convicts)
from . import constrain_scale, neurotoxin  # noqa: F401  (registration: backdoors that shape training)
from . import dba, edge_case  # noqa: F401  (registration: a backdoor split among the attackers, one on the data's tail)
from . import a3fl  # noqa: F401  (registration: a backdoor whose trigger adapts to the model it is sent)
from . import text_backdoor  # noqa: F401  (registration: a backdoor for language models)
from .base import REGISTRY, Attack, Context, Memory, NodeAttack, OmniscientAttack, Shaping, Sight

__all__ = ["Attack", "Context", "Memory", "NodeAttack", "OmniscientAttack", "Shaping", "Sight", "build", "names",
           "sources"]


def build(spec: str, f: int) -> Attack:
    """The attack described by ``spec`` (one component, e.g. ``"ipm:eps=0.5"``)."""
    components = parse(spec)
    if len(components) != 1:
        raise ValueError(f"an attack spec names one attack (got {spec!r}): drop the '+'")
    comp = components[0]
    return REGISTRY.lookup(comp.name, spec)(f, **comp.params)


def names() -> list[str]:
    """Every attack a spec may name, sorted."""
    return REGISTRY.names()


def sources() -> dict[str, tuple[str, str]]:
    """Every attack by name -> (its kind, ``omniscient`` or ``node``; the file that defines it,
    relative to the project root, e.g. ``attacks/sign_flip.py``)."""
    root = Path(__file__).resolve().parent.parent
    return {
        name: (cls.kind, Path(inspect.getfile(cls)).resolve().relative_to(root).as_posix())
        for name, cls in sorted(REGISTRY.entries.items())
    }
