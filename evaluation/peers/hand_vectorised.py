"""A hand-vectorised loop over a bench grid: the training and aggregation alone, the baseline
``robust bench``'s speed is measured against (``python -m evaluation.hand_loop``).

Written as a researcher writes a fast simulation by hand, apart from the round engine: every
node's worker-momentum gradient of the ``mlp`` (one hidden ReLU layer) in one batched pass
with its backward written out, batch indices drawn for all nodes at once, the Byzantine rows
from the library's attack (an omniscient one crafted from the honest rows; ``label-flip``
trained on flipped labels), the library's rule, the server's step and the test accuracy every
round. No checks of the rows, detectors, flag policy, evidence, quarantine or spot checks, and
not the volunteers' batch streams: the same work as a cell, not the same bits.

:func:`paired` times this loop and ``robust bench --jobs 1`` (its defaults: detectors, flag
policy, evidence on) on the same cells, alternately, so both see the same machine. With
``--split`` it also says what share of the hand loop's time its training kernel (batch
gather, gradients, momentum) and the library's rule take: work the bench does too, whatever
else it does, so ``hand / (training + rule)`` bounds the speed-up any bench that trains with
such a kernel and aggregates with these rules can reach.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager

import torch

import aggregators
import attacks
from attacks.base import Context, NodeAttack
from robust.compute import profile
from robust.data import load
from robust.models import build_model
from robust.params import flat_params
from robust.partition import partition

from evaluation.bench.cell import Cell
from evaluation.bench.scenario import cells, load_scenario


@contextmanager
def timed(clock: Counter | None, part: str):
    """Adds the block's wall seconds to ``clock[part]`` (nothing without a clock)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if clock is not None:
            clock[part] += time.perf_counter() - start


def run_cell(cell: Cell, clock: Counter | None = None) -> float:
    """Plays ``cell`` (an ``mlp`` under the ``momentum`` protocol) by hand; its final test
    accuracy. ``clock`` gets the seconds of its ``training`` and its ``rule``."""
    cfg = cell.config
    if cfg["model"] != "mlp" or cfg["protocol"] != "momentum":
        raise ValueError(f"the hand loop plays model mlp under protocol momentum "
                         f"(got {cfg['model']}, {cfg['protocol']})")
    n, f, rounds, batch = int(cfg["nodes"]), int(cfg["byzantine"]), int(cfg["rounds"]), int(cfg["batch-size"])
    lr, beta = float(cfg["lr"]), float(cfg["momentum"])
    data = load(cfg["dataset"], root=cfg.get("data-root") or None, seed=0)
    x, y = data.x_train.flatten(1).clone(), data.y_train.clone()  # poisoned in place below: our copies
    x_test, y_test = data.x_test.flatten(1), data.y_test
    parts = partition(data.y_train, n, cfg["partition"], alpha=float(cfg.get("alpha", 1.0)), seed=cell.seed)
    attack = attacks.build(cell.attack, f)
    if isinstance(attack, NodeAttack) and (attack.trains_alone or attack.remembers or attack.boost() != 1.0
                                           or type(attack).forge is not NodeAttack.forge):
        raise ValueError(f"the hand loop plays node-side attacks that only poison data (got {cell.attack})")
    byz = list(range(n - f, n)) if cell.attack != "none" else []
    if isinstance(attack, NodeAttack):  # node-side: its nodes train on poisoned data, then are rows like any
        for i in byz:
            px, py = attack.poison(x[parts[i]], y[parts[i]], data.classes, torch.Generator().manual_seed(i))
            x[parts[i]], y[parts[i]] = px, py
    table = torch.nn.utils.rnn.pad_sequence(list(parts), batch_first=True)
    sizes = torch.tensor([len(p) for p in parts], dtype=torch.float64)
    model = build_model(cfg["model"], data.shape, data.classes, cell.seed)
    hidden, features = model[1].weight.shape
    w = flat_params(model)
    m = torch.zeros(n, w.numel())
    rule, ids = aggregators.build(cell.aggregator, f), tuple(f"node{i}" for i in range(n))
    gen, previous, state = torch.Generator().manual_seed(cell.seed), None, {}
    accuracy = 0.0
    with profile(1):
        for t in range(1, rounds + 1):
            with timed(clock, "training"):
                pos = (torch.rand(n, batch, generator=gen, dtype=torch.float64) * sizes[:, None]).long()
                idx = table.gather(1, pos)
                m = beta * m + gradients(w, x[idx], y[idx], hidden, features, data.classes)
            X, inputs = m, aggregators.RoundInputs(ids=ids, w=w)
            if byz and not isinstance(attack, NodeAttack):
                ctx = Context(n=n, generator=gen, previous=previous, own=m[byz], round=t, state=state, step_sign=-1,
                              aggregator=lambda rows: rule(rows, inputs))
                X = torch.cat([m[: n - f], attack(m[: n - f], ctx)])
            with timed(clock, "rule"):
                previous = rule(X, inputs)
            w = w - lr * previous
            accuracy = float((logits(w, x_test, hidden, features, data.classes).argmax(1) == y_test).float().mean())
    return accuracy


def _layers(w: torch.Tensor, hidden: int, features: int, classes: int) -> tuple[torch.Tensor, ...]:
    a = hidden * features
    b = a + hidden + classes * hidden
    return w[:a].view(hidden, features), w[a : a + hidden], w[a + hidden : b].view(classes, hidden), w[b:]


def logits(w: torch.Tensor, x: torch.Tensor, hidden: int, features: int, classes: int) -> torch.Tensor:
    W1, b1, W2, b2 = _layers(w, hidden, features, classes)
    return (x @ W1.T + b1).relu() @ W2.T + b2


def gradients(w: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, hidden: int, features: int, classes: int
              ) -> torch.Tensor:
    """``(n, d)``: each node's mean cross-entropy gradient on its batch ``xb[i], yb[i]`` at ``w``."""
    W1, b1, W2, b2 = _layers(w, hidden, features, classes)
    pre = xb @ W1.T + b1  # (n, B, hidden)
    h = pre.relu()
    p = torch.softmax(h @ W2.T + b2, dim=-1)
    p.scatter_add_(-1, yb[..., None], torch.full_like(p[..., :1], -1.0))
    p /= xb.shape[1]
    dh = (p @ W2) * (pre > 0)
    return torch.cat([torch.einsum("nbh,nbf->nhf", dh, xb).flatten(1), dh.sum(1),
                      torch.einsum("nbc,nbh->nch", p, h).flatten(1), p.sum(1)], dim=1)


def run_grid(todo: list[Cell], clock: Counter | None = None) -> float:
    """Seconds to play every cell of ``todo`` by hand (``clock``: see :func:`run_cell`)."""
    start = time.perf_counter()
    for cell in todo:
        run_cell(cell, clock)
    return time.perf_counter() - start


def split(config: str | None, sets: list[str]) -> dict:
    """The hand loop on one grid, timed by part: its seconds, its training's and its rule's,
    and the bound ``seconds / (training + rule)`` on any bench's speed-up over it that
    trains with such a kernel and aggregates with the library's rules."""
    clock: Counter = Counter()
    seconds = run_grid(cells(load_scenario(config, sets)), clock)
    return {"hand_seconds": seconds, "training_seconds": clock["training"], "rule_seconds": clock["rule"],
            "bound": seconds / (clock["training"] + clock["rule"])}


def run_bench(config: str | None, sets: list[str], out: str | None = None) -> float:
    """Seconds of ``robust bench --jobs 1`` on the same grid, in a fresh process and a fresh
    folder (``out``, kept, or a temporary one)."""
    if out is None:
        with tempfile.TemporaryDirectory(prefix="robust-paired-") as temp:
            return run_bench(config, sets, temp)
    cmd = [sys.executable, "-m", "robust.cli", "bench", "--out", out, "--jobs", "1",
           *(["--config", config] if config else []), *(a for s in sets for a in ("--set", s))]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"robust bench failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.perf_counter() - start


def paired(config: str | None, sets: list[str], pairs: int) -> dict:
    """``pairs`` alternations of the hand loop (in this process) and ``robust bench --jobs 1``
    (a fresh process each time, as a user runs it) on one grid: the medians and their ratio."""
    todo = cells(load_scenario(config, sets))
    hand, bench = [], []
    for _ in range(pairs):
        hand.append(run_grid(todo))
        bench.append(run_bench(config, sets))
    hand_s, bench_s = sorted(hand)[len(hand) // 2], sorted(bench)[len(bench) // 2]
    return {"cells": len(todo), "hand_seconds": hand_s, "bench_seconds": bench_s, "speedup": hand_s / bench_s,
            "bench_cells_per_minute": 60 * len(todo) / bench_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="robust bench --jobs 1 against a hand-vectorised loop, on one grid")
    p.add_argument("--config", metavar="FILE", help="scenario TOML (default: the built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario key")
    p.add_argument("--pairs", type=int, default=1, help="alternations of the two (median reported; default 1)")
    p.add_argument("--split", action="store_true",
                   help="also time the hand loop's training and rule: the most any bench can gain on it")
    args = p.parse_args(argv)
    if args.split:
        parts = split(args.config, args.set)
        print(f"hand-vectorised loop {parts['hand_seconds']:.1f} s, of which training {parts['training_seconds']:.1f} s "
              f"and the rule {parts['rule_seconds']:.1f} s: a bench that trains and aggregates the same is at most "
              f"{parts['bound']:.2f}x its speed")
    out = paired(args.config, args.set, args.pairs)
    print(f"{out['cells']} cells: hand-vectorised loop {out['hand_seconds']:.1f} s, robust bench --jobs 1 "
          f"{out['bench_seconds']:.1f} s ({out['bench_cells_per_minute']:.1f} cells a minute): "
          f"robust is {out['speedup']:.2f}x the hand loop's speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
