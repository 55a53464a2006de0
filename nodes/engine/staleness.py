"""How much an asynchronous reply counts, by its staleness (FedBuff, Nguyen et al., AISTATS
2022, "Federated learning with buffered asynchronous aggregation").

A reply computed from model version ``v`` and aggregated into version ``V + 1`` has staleness
``tau = V - v`` (0: computed from the current model). Its row is scaled by ``s(tau)`` before
the robust rule sees the buffer:

- ``constant``: ``s = 1``;
- ``sqrt``: ``s = 1 / sqrt(1 + tau)`` (FedBuff's choice);
- ``poly:a=0.5``: ``s = (1 + tau)^-a`` (Xie et al. 2019's polynomial staleness).

Scaling before the rule keeps the robust rule's guarantee over the scaled rows: a Byzantine
node cannot gain weight by claiming an older base (staleness only shrinks a row), and a row
whose staleness exceeds ``max-staleness`` is rejected with its reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from robust.spec import parse

KINDS = ("constant", "sqrt", "poly")


def weight_of(spec: str) -> Callable[[int], float]:
    """``tau -> s(tau)`` for ``spec``; ``ValueError`` says what to write."""
    parts = parse(spec)
    if len(parts) != 1 or parts[0].name not in KINDS:
        raise ValueError(f"staleness {spec!r}: write constant, sqrt or poly:a=0.5")
    name, params = parts[0].name, dict(parts[0].params)
    allowed = {"poly": {"a"}}.get(name, set())
    if set(params) - allowed:
        raise ValueError(f"staleness {spec!r}: {name} takes {', '.join(sorted(allowed)) or 'no parameters'}")
    if name == "constant":
        return lambda tau: 1.0
    if name == "sqrt":
        return lambda tau: 1.0 / math.sqrt(1.0 + tau)
    a = params.get("a", 0.5)
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 10:
        raise ValueError(f"staleness {spec!r}: a must be a number in [0, 10] (got a={a!r})")
    return lambda tau: (1.0 + tau) ** -float(a)


def stale_reason(tau: int, limit: int) -> str | None:
    """Why a reply ``tau`` versions behind is rejected under ``max-staleness = limit`` (0: no
    limit), or ``None``."""
    return f"stale: {tau} versions behind, max-staleness is {limit}" if limit and tau > limit else None
