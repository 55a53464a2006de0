"""The speed baseline: a plain per-node Python training loop, as most FL simulations are written.

Each round, every node loads the global weights into its own ``nn.Module``, takes one SGD
step's gradient with ``loss.backward()`` and its worker momentum, and the mean of the rows
updates the global model. No attack, no robust rule, no detectors: the engine's
``node_steps_per_s`` (which does all of those, and evaluates every round) is divided by
this loop's rate, measured on the same scenario and machine in the same run.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from nodes.training import batch_indices
from robust.data import load
from robust.models import build_model
from robust.partition import partition
from robust.seeds import generator


def plain_loop_rate(cfg: dict, seed: int = 0, rounds: int = 10) -> float:
    """Node-steps per second of the plain loop on the scenario ``cfg`` (one thread)."""
    torch.set_num_threads(1)
    n, batch, lr, beta = int(cfg["nodes"]), int(cfg["batch-size"]), float(cfg["lr"]), float(cfg["momentum"])
    data = load(cfg["dataset"], root=cfg.get("data-root"), seed=seed)
    parts = partition(data.y_train, n, cfg["partition"], alpha=float(cfg.get("alpha", 1.0)), seed=seed)
    server = build_model(cfg["model"], data.shape, data.classes, seed)
    workers = [copy.deepcopy(server) for _ in range(n)]
    momenta = [[torch.zeros_like(p) for p in server.parameters()] for _ in range(n)]
    start = time.perf_counter()
    for t in range(rounds):
        rows = []
        for i, worker in enumerate(workers):
            worker.load_state_dict(server.state_dict())
            worker.zero_grad()
            idx = batch_indices(parts[i], batch, generator(seed, t, i, 0, "batch"))
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
