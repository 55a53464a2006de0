"""The speed baseline: a plain per-node Python training loop, as most FL simulations are written.

Each round, every node loads the global weights into its own ``nn.Module``, draws a batch
from one run-wide generator (the cheapest draw there is), takes one SGD step's gradient
with ``loss.backward()`` and its worker momentum, and the mean of the rows updates the
global model. No attack, no robust rule, no detectors, no evaluation. ``robust bench``
divides two engine rates by this loop's, measured on the same scenario and machine in the
same run: the engine's training phase (the same work) and its whole rounds (which also
attack, validate, aggregate robustly, score six detectors and evaluate, every round).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from robust.data import load
from robust.models import build_model
from robust.partition import partition


def plain_loop_rate(cfg: dict, seed: int = 0, rounds: int = 10) -> float:
    """Node-steps per second of the plain loop on the scenario ``cfg`` (one thread)."""
    torch.set_num_threads(1)
    n, batch, lr, beta = int(cfg["nodes"]), int(cfg["batch-size"]), float(cfg["lr"]), float(cfg["momentum"])
    data = load(cfg["dataset"], root=cfg.get("data-root"), seed=seed)
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
