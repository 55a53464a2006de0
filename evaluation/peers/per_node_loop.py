"""The speed baseline: a plain per-node Python training loop, as most FL simulations are written.

Each round, every node loads the global weights into its own ``nn.Module``, draws a batch
from one run-wide generator (the cheapest draw there is), takes one SGD step's gradient
with ``loss.backward()`` and its worker momentum, and the mean of the rows updates the
global model. No attack, no robust rule, no detectors, no evaluation.

:func:`paired_speed` times this loop and the engine's training phase (the same work: batch
draws, gradients, worker momentum) alternately on one scenario, so both see the same
machine: a shared machine's speed drifts by tens of percent within a minute, and a ratio of
rates measured a minute apart would carry that drift.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from robust.compute import profile
from robust.data import load
from robust.models import build_model
from robust.partition import partition

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import run_cell


def plain_loop_rate(cfg: dict, seed: int = 0, rounds: int = 10) -> float:
    """Node-steps per second of the plain loop on the scenario ``cfg`` (one thread, as the
    engine's default compute profile)."""
    with profile(1):
        return _plain_loop_rate(cfg, seed, rounds)


def _plain_loop_rate(cfg: dict, seed: int, rounds: int) -> float:
    n, batch, lr, beta = int(cfg["nodes"]), int(cfg["batch-size"]), float(cfg["lr"]), float(cfg["momentum"])
    data = load(cfg["dataset"], root=cfg.get("data-root") or None, seed=seed)
    parts = partition(data.y_train, n, cfg["partition"], alpha=float(cfg.get("alpha", 1.0)), seed=seed)
    server = build_model(cfg["model"], data.shape, data.classes, seed)
    workers = [copy.deepcopy(server) for _ in range(n)]
    momenta = [[torch.zeros_like(p) for p in server.parameters()] for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)  # one stream for the run: the cheapest way to draw
    start = time.perf_counter()
    for t in range(rounds):
        rows = []
        for i, worker in enumerate(workers):
            worker.load_state_dict(server.state_dict())
            worker.zero_grad()
            idx = parts[i][torch.randint(parts[i].numel(), (batch,), generator=gen)]
            F.cross_entropy(worker(data.x_train[idx]), data.y_train[idx]).backward()
            for m, p in zip(momenta[i], worker.parameters()):
                m.mul_(beta).add_(p.grad)
            rows.append(torch.cat([m.reshape(-1) for m in momenta[i]]))
        step = torch.stack(rows).mean(dim=0)
        with torch.no_grad():
            offset = 0
            for p in server.parameters():
                p -= lr * step[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
    return rounds * n / (time.perf_counter() - start)


def paired_speed(cfg: dict, repeats: int = 5, rounds: int = 20) -> dict[str, float]:
    """Medians over ``repeats`` alternations of the plain loop and an engine cell (``mean``,
    no attack) of ``rounds`` rounds on ``cfg``: node-steps/s of the loop, of the engine's
    training phase and of its whole rounds, and the median of the paired training ratios."""
    cell = Cell({**cfg, "rounds": rounds}, "mean", "none", 0)
    run_cell(Cell({**cfg, "rounds": 2}, "mean", "none", 0))  # warm-up: kernels, caches
    plain, training, whole, ratios = [], [], [], []
    for _ in range(repeats):
        plain.append(plain_loop_rate(cfg, rounds=rounds))
        record = run_cell(cell)
        training.append(record["train_node_steps_per_s"])
        whole.append(record["node_steps_per_s"])
        ratios.append(training[-1] / plain[-1])
    return {
        "plain_loop_node_steps_per_s": median(plain), "engine_training_node_steps_per_s": median(training),
        "engine_mean_cell_node_steps_per_s": median(whole), "training_speedup": median(ratios),
    }


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
