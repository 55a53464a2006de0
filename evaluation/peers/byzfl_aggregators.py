"""ByzFL's robust aggregators (``byzfl==0.0.11``), called the way ByzFL calls them, on our inputs.

ByzFL's package ``__init__`` imports its benchmark, which needs torchvision; :func:`load`
imports ``byzfl.aggregators`` without running it. ByzFL takes the float32 ``(n, d)`` torch
tensor as it is (float64 rows it first converts to float32, as it always does). Each baseline's ``prepare`` (untimed) clones the tensor and builds fresh ByzFL
objects (its clipping pre-aggregators change their input in place, and its CenteredClipping
starts each call from its last output); ``run`` (timed) is the call.

A spec maps when every stage has an equivalent with our parameters (:data:`EQUIVALENTS`):

- ``krum`` -> ``Krum(f)``, ``multi-krum`` (``m = n - f``, ours by default) -> ``MultiKrum(f)``,
  which averages the ``n - f`` best rows: ByzFL scores a row by the mean of its ``n - f - 1``
  smallest squared distances, ours by the sum of ``n - f - 2`` (the paper's), the same work;
- ``mean`` -> ``Average()``, ``median`` -> ``Median()``, ``trimmed-mean`` -> ``TrMean(f)``,
  ``meamed`` -> ``Meamed(f)``, ``caf`` -> ``CAF(f)``;
- ``geometric-median`` -> ``GeometricMedian(nu, T=3)``: our ``nu``, and ByzFL's default ``T``.
  Each of ByzFL's iterations is a pass over the rows, while ours iterates to convergence on the
  ``(n, n)`` distances after one pass: more ByzFL iterations would only slow ByzFL, so its time
  here is the least a converged ByzFL answer costs;
- ``centered-clipping`` -> ``CenteredClipping(tau, L=iters)``, from zero (a fresh object), as our
  rule's first call starts;
- ``mda`` -> ``MDA(f)`` while ``C(n, f) <= SUBSETS``: ByzFL visits the subsets in Python;
- ``smea`` -> ``SMEA(f)`` while ``C(n, f) <= SUBSETS``: ByzFL visits the subsets in Python and
  estimates each one's largest eigenvalue by one power-iteration step from a random vector (ours
  is exact), less work a subset, and a choice that can change from call to call;
- ``monna`` -> ``MoNNA(f, idx)``;
- the pre-aggregators ``nnm`` -> ``NNM(f)``, ``bucketing`` -> ``Bucketing(s)`` (its own random
  buckets), ``arc`` -> ``ARC(f)``, ``clip`` -> ``Clipping(c)``; a chain applies them in turn.

ByzFL has no Bulyan, DnC, SignGuard, FLAME, FLTrust, FoolsGold, FLDetector or sign vote.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
import sys
import types
from collections.abc import Callable

import torch

from aggregators.base import REGISTRY, Stage
from robust.spec import parse

from .baseline import Baseline

INSTALL = "pip install --no-deps byzfl==0.0.11"
SUBSETS = 10_000  # ByzFL's MDA and SMEA try every subset in a Python loop: more take minutes a call

# our stage, with the rows reaching it -> ByzFL's class and its arguments (None: no equivalent)
EQUIVALENTS: dict[str, Callable[[Stage, int], tuple[str, dict] | None]] = {
    "mean": lambda s, n: ("Average", {}),
    "median": lambda s, n: ("Median", {}),
    "trimmed-mean": lambda s, n: ("TrMean", {"f": s.f}),
    "meamed": lambda s, n: ("Meamed", {"f": s.f}),
    "caf": lambda s, n: ("CAF", {"f": s.f}),
    "krum": lambda s, n: ("Krum", {"f": s.f}),
    "multi-krum": lambda s, n: ("MultiKrum", {"f": s.f}) if s.m in (None, n - s.f) else None,
    "geometric-median": lambda s, n: ("GeometricMedian", {"nu": float(s.nu), "T": 3}),
    "centered-clipping": lambda s, n: ("CenteredClipping", {"tau": float(s.tau), "L": s.iters}),
    "mda": lambda s, n: ("MDA", {"f": s.f}) if math.comb(n, s.f) <= SUBSETS else None,
    "smea": lambda s, n: ("SMEA", {"f": s.f}) if math.comb(n, s.f) <= SUBSETS else None,
    "monna": lambda s, n: ("MoNNA", {"f": s.f, "idx": s.idx}),
    "nnm": lambda s, n: ("NNM", {"f": s.f}),
    "bucketing": lambda s, n: ("Bucketing", {"s": s.s}),
    "arc": lambda s, n: ("ARC", {"f": s.f}),
    "clip": lambda s, n: ("Clipping", {"c": float(s.c)}),
}


def load() -> types.ModuleType | None:
    """``byzfl.aggregators``, imported under a bare ``byzfl`` package module (the installed
    package's ``__path__``, not its ``__init__``) put in ``sys.modules``; ``None`` when ByzFL
    is not installed or does not import (then :data:`INSTALL` says what to do)."""
    bare = "byzfl" not in sys.modules
    if bare:
        found = importlib.util.find_spec("byzfl")
        if found is None or found.submodule_search_locations is None:
            return None
        package = types.ModuleType("byzfl")
        package.__path__ = list(found.submodule_search_locations)
        sys.modules["byzfl"] = package
    try:
        return importlib.import_module("byzfl.aggregators")
    except ImportError:
        if bare:
            del sys.modules["byzfl"]
        return None


def version() -> str | None:
    """The installed ByzFL's version (``None``: not installed)."""
    try:
        return importlib.metadata.version("byzfl")
    except importlib.metadata.PackageNotFoundError:
        return None


def baselines(spec: str, X: torch.Tensor, f: int) -> list[Baseline]:
    """ByzFL's equivalent of our ``spec`` on ``X`` (none when ByzFL is missing or a stage has no
    equivalent)."""
    module = load()
    if module is None:
        return []
    rows = X.shape[0]
    made: list[tuple[str, dict]] = []
    for comp in parse(spec):
        stage = REGISTRY.lookup(comp.name, spec)(f, **comp.params)
        equivalent = EQUIVALENTS.get(stage.name)
        found = equivalent(stage, rows) if equivalent else None
        if found is None:
            return []
        made.append(found)
        if not stage.is_rule:
            rows = stage.rows(rows)
    name = "+".join(f"{cls}({', '.join(f'{k}={v}' for k, v in kwargs.items())})" for cls, kwargs in made)

    def prepare() -> tuple[torch.Tensor, list]:
        return X.clone(), [getattr(module, cls)(**kwargs) for cls, kwargs in made]

    def run(state: tuple[torch.Tensor, list]) -> torch.Tensor:
        out, stages = state
        for stage in stages:
            out = stage(out)
        return out

    return [Baseline(f"byzfl {name}", prepare, run)]
