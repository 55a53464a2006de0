"""Calibrate the spot checks' tolerance: how far apart are two honest computations of one task?

``python -m evaluation.spot_tolerance [--checks 1000]`` recomputes honest updates (digits,
the ``delta`` protocol, MLP and CNN, many nodes and rounds from a moving base model) with
1 thread and again with 2 and 4 threads, as volunteers on different compute profiles would
(with ``--cuda``, also on the GPU: a GPU volunteer checked by a CPU coordinator), and prints
the largest relative distance seen, the false convictions
(distance above ``nodes.engine.spotcheck.TOLERANCE``) and, beside them, the distance of the
subtlest forgery the bound must catch (an update scaled by 0.999).
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from nodes.engine.spotcheck import TOLERANCE, distance
from nodes.engine.training import compute, part_of
from nodes.wire import Task
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, sha256


def measure(model: str, checks: int, nodes: int = 25, cuda: bool = False) -> dict:
    data = load("digits", seed=0)
    w = flat_params(build_model(model, data.shape, data.classes, 0))
    gen = torch.Generator().manual_seed(0)
    gaps, equal, forged = [], 0, []
    start = time.perf_counter()
    for k in range(checks):
        node, round = k % nodes, 1 + k // nodes
        if node == 0:  # a new round: the base model moves
            w = w + 0.01 * torch.randn(w.shape, generator=gen)
        part = part_of(data, f"{node + 1}/{nodes}")
        honest = {}
        for threads in (1, 2, 4, *(["cuda"] if cuda else [])):
            task = Task(run="calibrate", round=round, base=sha256(w), seed=0, dataset="digits", model=model,
                        protocol="delta:steps=4", batch_size=32, lr=0.05, momentum=0.9,
                        threads=1 if threads == "cuda" else threads, deadline=60.0)
            device = torch.device("cuda" if threads == "cuda" else "cpu")
            honest[threads], _ = compute(task, w, part.x, part.y, part.classes, f"node-{node}", device)
        for other in [t for t in honest if t != 1]:
            gaps.append(distance(honest[other], honest[1]))
            equal += torch.equal(honest[other], honest[1])
        forged.append(distance(honest[1] * 0.999, honest[1]))
    return {"model": model, "checks": len(gaps), "bitwise_equal": equal, "max_gap": max(gaps),
            "false_convictions": sum(g > TOLERANCE for g in gaps), "forgery_gap": min(forged),
            "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checks", type=int, default=1000, help="honest checks per model (each against 2 thread counts)")
    p.add_argument("--cuda", action="store_true", help="also recompute on the GPU (CUDA) against 1 CPU thread")
    args = p.parse_args()
    what = "thread counts and CUDA" if args.cuda else "thread counts"
    table = Table(title=f"honest recomputations across {what} (tolerance {TOLERANCE:g})")
    for column in ("model", "checks", "bitwise equal", "largest relative gap", "false convictions",
                   "forgery x0.999 gap", "seconds"):
        table.add_column(column, justify="right")
    for model in ("mlp", "cnn"):
        r = measure(model, args.checks // 2, cuda=args.cuda)
        table.add_row(r["model"], str(r["checks"]), str(r["bitwise_equal"]), f"{r['max_gap']:.2e}",
                      str(r["false_convictions"]), f"{r['forgery_gap']:.2e}", f"{r['seconds']:.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
