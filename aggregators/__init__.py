"""Robust aggregation rules and pre-aggregators, all on one ``(n, d)`` tensor.

    >>> import aggregators, torch
    >>> agg = aggregators.build("nnm+trimmed-mean", f=2)
    >>> agg(torch.randn(10, 4)).shape
    torch.Size([4])

``names()`` lists the stages; a spec chains pre-aggregators and one final rule with ``+``.
Rules that need more than the rows (``agg.needs``: fltrust, foolsgold, fldetector, loss-score)
are called as ``agg(X, RoundInputs(ids=..., w=..., reference=..., ratings=...))``.
"""

from __future__ import annotations

from . import (  # noqa: F401  (each module registers its stage)
    arc,
    bucketing,
    bulyan,
    caf,
    centered_clipping,
    clip,
    dnc,
    flame,
    fldetector,
    fltrust,
    foolsgold,
    geometric_median,
    krum,
    loss_score,
    mda,
    meamed,
    mean,
    median,
    monna,
    multi_krum,
    nnm,
    sign_vote,
    signguard,
    smea,
    trimmed_mean,
)
from .base import REGISTRY, RoundInputs
from .chain import Chain, build

__all__ = ["Chain", "RoundInputs", "build", "names", "pre_aggregators", "rules"]


def names() -> list[str]:
    """Every stage name a spec may use, sorted."""
    return REGISTRY.names()


def rules() -> list[str]:
    """The final rules (a spec ends with one of these)."""
    return [k for k in REGISTRY.names() if REGISTRY.entries[k].is_rule]


def pre_aggregators() -> list[str]:
    """The stages that may precede a rule."""
    return [k for k in REGISTRY.names() if not REGISTRY.entries[k].is_rule]
