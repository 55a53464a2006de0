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

from robust.constraints import Interval, Param, check_all, table
from robust.spec import parse

KINDS = ("constant", "sqrt", "poly")
PARAMS = {  # each kind's spec parameters
    "constant": {},
    "sqrt": {},
    "poly": table(Param("a", Interval(float, 0, 10), 0.5, "the exponent: s = (1 + tau)^-a")),
}


def weight_of(spec: str) -> Callable[[int], float]:
    """``tau -> s(tau)`` for ``spec``; ``ValueError`` says what to write."""
    parts = parse(spec)
    if len(parts) != 1 or parts[0].name not in KINDS:
        raise ValueError(f"staleness {spec!r}: write constant, sqrt or poly:a=0.5")
    name = parts[0].name
    values = check_all(name, PARAMS[name], parts[0].params)
    if name == "constant":
        return lambda tau: 1.0
    if name == "sqrt":
        return lambda tau: 1.0 / math.sqrt(1.0 + tau)
    a = values["a"]
    return lambda tau: (1.0 + tau) ** -a


def stale_reason(tau: int, limit: int) -> str | None:
    """Why a reply ``tau`` versions behind is rejected under ``max-staleness = limit`` (0: no
    limit), or ``None``."""
    return f"stale: {tau} versions behind, max-staleness is {limit}" if limit and tau > limit else None
