"""The local engine: one benchmark cell (scenario x aggregator x attack x seed) in-process.

Each round runs the coordinator's steps on the nodes' rows: the nodes compute their updates
(all at once: by hand-written batched products for ``logreg``/``mlp``, ``evaluation.batched``,
else with ``torch.func.vmap``; or one by one exactly as a volunteer does with
``vectorize=False``), the threat model replaces the Byzantine rows (omniscient attacks) or
the Byzantine nodes trained on poisoned data (node-side attacks), then validate -> canonical
order -> aggregate -> score -> apply -> evaluate. Threads are pinned to one per cell, so a
cell gives the same bits whether cells run one at a time or in parallel processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch.func import vmap

import aggregators
import attacks
from attacks.base import NodeAttack, OmniscientAttack
from attacks.node import Backdoor
from nodes.rounds import canonical, rejected_rows
from nodes.training import TrainConfig, apply_update, local_update
from robust.batches import draw_batches, node_key
from robust.data import Dataset, load
from robust import models
from robust.models import build_model
from robust.params import flat_params, sha256, unflatten
from robust.partition import partition
from robust.seeds import generator

from .batched import DenseNet, local_updates
from .detectors import score_round
from .metrics import kappa_bound, kappa_hat, summarize_detection


@dataclass
class Cell:
    """One run of the grid: scenario values, the defence, the attack, the seed."""

    config: dict
    aggregator: str
    attack: str
    seed: int
    sweep: dict | None = None


def train_config(cfg: dict) -> TrainConfig:
    return TrainConfig(
        batch_size=int(cfg["batch-size"]), lr=float(cfg["lr"]),
        momentum=float(cfg["momentum"]), local_steps=int(cfg["local-steps"]),
    )


def node_data(
    data: Dataset, parts: list[torch.Tensor], byzantine: list[int], attack: object, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Training tensors with poisoned copies appended for Byzantine nodes under a node-side
    attack, and every node's indices into them."""
    xs, ys, parts = data.x_train, data.y_train, list(parts)
    if isinstance(attack, NodeAttack):
        extra_x, extra_y, start = [], [], xs.shape[0]
        for node in byzantine:
            px, py = attack.poison(xs[parts[node]], ys[parts[node]], data.classes, generator(seed, node, "poison"))
            extra_x.append(px)
            extra_y.append(py)
            parts[node] = torch.arange(start, start + px.shape[0])
            start += px.shape[0]
        xs, ys = torch.cat([xs, *extra_x]), torch.cat([ys, *extra_y])
    return xs, ys, parts


class BatchDraws:
    """Every node's sample indices of a round, drawn as each volunteer draws its own
    (``robust.batches``, node ``i``'s stream keyed by ``(seed, i)``), in one call."""

    def __init__(self, parts: list[torch.Tensor], tc: TrainConfig, seed: int) -> None:
        self.sizes = np.array([p.numel() for p in parts])
        self.table = torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)  # (n, largest part)
        self.keys = np.array([node_key(seed, i) for i in range(len(parts))])
        self.tc = tc

    def __call__(self, t: int) -> torch.Tensor:
        """``(n, local steps, batch size)`` indices into the training tensors for round ``t``."""
        pos = draw_batches(self.sizes, self.tc.batch_size, self.keys, t, self.tc.local_steps)
        return self.table.gather(1, pos.flatten(1)).view_as(pos)


def accuracy(
    model: torch.nn.Module, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, net: DenseNet | None = None
) -> float:
    """Share of ``x`` that the model with parameters ``w`` classifies as ``y`` (through ``net``
    when the model has a dense view)."""
    if net is None:
        return models.accuracy(model, unflatten(w, model), x, y)
    with torch.no_grad():
        return float((net.logits(w, x).argmax(dim=1) == y).float().mean())


def run_cell(
    cell: Cell, vectorize: bool = True, on_round: Callable[[int, float], None] | None = None
) -> dict:
    """Train the cell's scenario under its attack and defence; return its result record."""
    torch.set_num_threads(1)
    cfg, seed = cell.config, cell.seed
    n, f, rounds = int(cfg["nodes"]), int(cfg["byzantine"]), int(cfg["rounds"])
    tc = train_config(cfg)
    data = load(cfg["dataset"], root=cfg.get("data-root"), seed=seed)
    parts = partition(data.y_train, n, cfg["partition"], alpha=float(cfg.get("alpha", 1.0)), seed=seed)
    byzantine = sorted(torch.randperm(n, generator=generator(seed, "byzantine"))[:f].tolist())
    attack = attacks.build(cell.attack, f)
    chain = aggregators.build(cell.aggregator, f)
    model = build_model(cfg["model"], data.shape, data.classes, seed)
    net = DenseNet.of(model)
    xs, ys, parts = node_data(data, parts, byzantine, attack, seed)
    w = flat_params(model)
    momenta = torch.zeros(n, w.numel())
    step = partial(local_update, model, tc)
    batched = vmap(step, in_dims=(None, 0, 0, 0))
    max_norm = cfg.get("max-norm")
    is_byz = torch.zeros(n, dtype=torch.bool)
    is_byz[byzantine] = True
    history: dict = {"accuracy": [], "kappa": [], "scores": [], "positive": [], "rejected": [], "skipped": 0}
    previous = None
    draws = BatchDraws(parts, tc, seed)
    start = time.perf_counter()
    training = 0.0  # seconds spent drawing batches and computing the nodes' rows
    for t in range(rounds):
        began = time.perf_counter()
        idx = draws(t)
        if vectorize and net is not None:
            rows, momenta = local_updates(net, tc, w, xs[idx], ys[idx], momenta)
        elif vectorize:
            rows, momenta = batched(unflatten(w, model), xs[idx], ys[idx], momenta)
        else:
            params = unflatten(w, model)
            outs = [step(params, xs[idx[i]], ys[idx[i]], momenta[i]) for i in range(n)]
            rows, momenta = torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
        training += time.perf_counter() - began
        if isinstance(attack, NodeAttack):
            rows[is_byz] *= attack.scale()
        elif f and isinstance(attack, OmniscientAttack):
            ctx = attacks.Context(
                n=n, generator=generator(seed, t, "attack"), aggregator=chain,
                previous=previous, own=rows[is_byz], round=t,
            )
            rows[is_byz] = attack(rows[~is_byz], ctx).to(rows.dtype)
        rejected = rejected_rows(rows, max_norm)
        history["rejected"].append(rejected)
        ids, X = canonical({i: rows[i] for i in range(n) if i not in rejected})
        positive = is_byz[ids]
        try:
            aggregate = chain(X)
        except ValueError:  # too few valid rows for the rule this round: no step
            history["skipped"] += 1
            history["kappa"].append(float("nan"))
            kept = None
        else:
            history["kappa"].append(kappa_hat(aggregate, X[~positive]))
            w = apply_update(w, aggregate, tc)
            previous, kept = aggregate, chain.last_kept
        history["scores"].append(score_round(X, f, kept))
        history["positive"].append(positive)
        history["accuracy"].append(accuracy(model, w, data.x_test, data.y_test, net))
        if on_round is not None:
            on_round(t, history["accuracy"][-1])
    wall = time.perf_counter() - start
    return {
        "aggregator": cell.aggregator, "attack": cell.attack, "seed": seed,
        "config": cfg, "sweep": cell.sweep, "vectorize": vectorize,
        "final_accuracy": history["accuracy"][-1], "accuracy": history["accuracy"],
        "detect": summarize_detection(history["scores"], history["positive"]),
        "kappa": history["kappa"], "kappa_max": max((k for k in history["kappa"] if k == k), default=float("nan")),
        "kappa_bound": kappa_bound(n, f) if n > 2 * f else float("inf"),
        "rejected": sum(len(r) for r in history["rejected"]), "skipped_rounds": history["skipped"],
        "backdoor_asr": backdoor_success(attack, model, w, data, net),
        "byzantine": byzantine,
        "model_sha256": sha256(w), "wall_time": wall,
        "node_steps_per_s": rounds * n * tc.local_steps / wall,
        "train_node_steps_per_s": rounds * n * tc.local_steps / training,
    }


def backdoor_success(
    attack: object, model: torch.nn.Module, w: torch.Tensor, data: Dataset, net: DenseNet | None = None
) -> float | None:
    """Share of triggered test samples (true label not the target) classified as the target."""
    if not isinstance(attack, Backdoor):
        return None
    keep = data.y_test != attack.target
    stamped = attack.stamp(data.x_test[keep])
    target = torch.full((stamped.shape[0],), attack.target)
    return accuracy(model, w, stamped, target, net)
