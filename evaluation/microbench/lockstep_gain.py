"""What playing S cells in lockstep would save, kernel by kernel (issue 46, item 5).

    python -m evaluation.microbench.lockstep_gain [--cells 12] [--nodes 25] [--repeats 9] [--device auto]

Lockstep plays S cells of a grid side by side, each of a round's kernels called once for the
S cells instead of once per cell, as the issue lays it out: coordinate-wise work on the
cells' rows side by side ``(n, S * d)``, their Gram matrices in one batched product, their
nodes trained in one call. That takes away each call's fixed cost, S - 1 times in S; not its
arithmetic. This times each such kernel at the speed grid's size (``speed.toml``: 25 rows of
the digits MLP's 4,810 parameters, float32, one CPU thread) on the device the bench would
train on (``auto``: a GPU where torch sees one, where a call's launch may cost more than its
arithmetic), in turns, on rows drawn afresh each turn:

- ``trimmed-mean``: the rule on each cell's ``(n, d)`` rows, and once on the ``(n, S * d)``
  rows side by side (their concatenation included: lockstep would have to make it);
- ``Gram``: the exact float64 Gram matrix Krum, NNM and the detectors read, one product per
  cell, and one batched product (the float64 copies included in both);
- ``training``: the local driver's batched kernel (``evaluation.bench.drivers.batched_dense``,
  ``momentum``) for each cell's nodes, and for the S cells' nodes in one call (each node then
  carries its cell's model: the per-node path of the same kernel);
- ``detectors``: ``score_round`` on each cell's rows (it has no batched form).

Each kernel that takes rows is also timed on rows of 8 values, where a call is all fixed
cost: the most any batching of it could take away.

The batched results' largest relative difference from the one-by-one results is printed with
the times (per cell, alone, together, the share saved, the fixed cost).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import aggregators
from nodes.engine.detectors import score_round
from robust.allocator import reuse_freed_memory
from robust.compute import device_name, profile, resolve_device, synced
from robust.models import build_model
from robust.params import flat_params

from evaluation.bench.drivers.batched_dense import DenseNet

BATCH, BETA, TINY = 32, 0.9, 8  # speed.toml's batch size and momentum; the detectors' tiny d


def median_us(calls: list[Callable[[], object]], repeats: int, fresh: Callable[[], None],
              device: torch.device) -> list[float]:
    """Each call's median microseconds over ``repeats`` turns (the calls in turn, ``fresh``
    drawing new inputs before each turn), until ``device`` has finished it."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        fresh()
        for spent, call in zip(times, calls):
            start = time.perf_counter()
            synced(device, call())
            spent.append(1e6 * (time.perf_counter() - start))
    return [statistics.median(t) for t in times]


class Kernels:
    """The kernels of one size: S cells' rows, data and models, drawn afresh by :meth:`fresh`."""

    def __init__(self, cells: int, nodes: int, device: torch.device, seed: int = 0) -> None:
        self.S, self.n, self.device = cells, nodes, device
        model = build_model("mlp", (8, 8), 10, 0)
        self.net, self.d = DenseNet.of(model), flat_params(model).numel()
        self.features = model[1].in_features
        self.gen = torch.Generator().manual_seed(seed)
        self.rule = aggregators.build("trimmed-mean", nodes // 5)
        self.fresh()

    def fresh(self) -> None:
        S, n, g, on = self.S, self.n, self.gen, self.device
        self.rows = [1e-2 * torch.randn(n, self.d, generator=g).to(on) for _ in range(S)]
        self.tiny = [torch.randn(n, TINY, generator=g).to(on) for _ in range(S)]
        self.w = [1e-1 * torch.randn(self.d, generator=g).to(on) for _ in range(S)]
        self.x = [torch.randn(n, BATCH, self.features, generator=g).to(on) for _ in range(S)]
        self.y = [torch.randint(0, 10, (n, BATCH), generator=g).to(on) for _ in range(S)]
        self.m = [torch.zeros(n, self.d, device=on) for _ in range(S)]

    # each kernel: (one cell at a time, the S cells in one call or None, the one-by-one calls on
    # rows of TINY values or None, the batched results' distance from the one-by-one ones or None)
    def trimmed_mean(self) -> tuple:
        alone = lambda: [self.rule(X) for X in self.rows]  # noqa: E731
        together = lambda: self.rule(torch.cat(self.rows, dim=1))  # noqa: E731
        return alone, together, lambda: [self.rule(X) for X in self.tiny], lambda: _gap(torch.cat(alone()), together())

    def gram(self) -> tuple:
        def alone(rows=None):
            return [(b := X.to(torch.float64)) @ b.T for X in rows or self.rows]

        def together():
            B = torch.stack(self.rows).to(torch.float64)
            return torch.bmm(B, B.mT)

        return alone, together, lambda: alone(self.tiny), lambda: _gap(torch.stack(alone()), together())

    def training(self) -> tuple:
        def alone():
            return [self.net.accumulate_grad(w, x, y, m.clone(), BETA) for w, x, y, m in zip(self.w, self.x, self.y, self.m)]

        def together():
            w = torch.stack(self.w).repeat_interleave(self.n, dim=0)  # every node its cell's model
            return self.net.accumulate_grad(w, torch.cat(self.x), torch.cat(self.y), torch.cat(self.m), BETA)

        return alone, together, None, lambda: _gap(torch.cat(alone()), together())

    def detectors(self) -> tuple:
        f = self.n // 5
        return lambda: [score_round(X, f) for X in self.rows], None, lambda: [score_round(X, f) for X in self.tiny], None


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between the one-by-one and the batched results, relative to their scale."""
    return float((a.double() - b.double()).abs().max() / a.double().abs().max().clamp_min(1e-30))


def measure(cells: int = 12, nodes: int = 25, repeats: int = 9, device: str = "cpu") -> list[dict]:
    """A row per kernel: per-cell microseconds alone, together (where lockstep has a batched
    form) and on rows of 8 values (the fixed cost, where it can be had), and how far the
    batched results are from the one-by-one ones (see the module); on ``device`` (auto, cpu or cuda)."""
    on = resolve_device(device, "--device ")
    kernels, rows = Kernels(cells, nodes, on), []
    with profile(1, on), torch.no_grad():
        for name in ("trimmed_mean", "gram", "training", "detectors"):
            alone, together, tiny, gap = getattr(kernels, name)()
            calls = [c for c in (alone, together, tiny) if c is not None]
            spent = iter(t / cells for t in median_us(calls, repeats, kernels.fresh, on))
            row = {"kernel": name.replace("_", "-"), "device": device_name(on), "cells": cells, "n": nodes, "d": kernels.d, "alone_us": next(spent),
                   "together_us": None if together is None else next(spent),
                   "fixed_us": None if tiny is None else next(spent), "gap": None if gap is None else gap()}
            row["saved"] = None if together is None else 1 - row["together_us"] / row["alone_us"]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=12, help="S, the cells in lockstep (default 12)")
    parser.add_argument("--nodes", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the kernels run (default auto: a GPU where torch sees one)")
    args = parser.parse_args(argv)
    reuse_freed_memory()  # as in the processes that run cells
    rows = measure(args.cells, args.nodes, args.repeats, args.device)
    print(f"{rows[0]['device']}, {args.cells} cells of {args.nodes} rows x {rows[0]['d']:,} values; microseconds per cell "
          f"(fixed: the same calls on rows of {TINY} values, the most batching could take away):")
    print(f"{'kernel':<14} {'alone':>7} {'together':>9} {'saved':>7} {'fixed':>7}  batched against one by one")
    for r in rows:
        together = "-" if r["together_us"] is None else f"{r['together_us']:.0f}"
        saved = "-" if r["saved"] is None else f"{100 * r['saved']:.0f}%"
        fixed = "-" if r["fixed_us"] is None else f"{r['fixed_us']:.0f}"
        gap = "" if r["gap"] is None else f"largest relative difference {r['gap']:.1e}"
        print(f"{r['kernel']:<14} {r['alone_us']:>7.0f} {together:>9} {saved:>7} {fixed:>7}  {gap}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
