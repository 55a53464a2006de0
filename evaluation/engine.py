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
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch.func import vmap

import aggregators
import attacks
from attacks.base import NodeAttack, OmniscientAttack
from attacks.node import Backdoor
from nodes.rounds import rejected_rows
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
    (``robust.batches``, node ``i``'s stream keyed by ``(seed, i)``), several rounds per
    call (a few MB at most): the draw's cost is per call, not per sample."""

    BUDGET = 1 << 23  # hashes per call

    def __init__(self, parts: list[torch.Tensor], tc: TrainConfig, seed: int) -> None:
        self.sizes = np.array([p.numel() for p in parts])
        self.table = torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)  # (n, largest part)
        self.keys = np.array([node_key(seed, i) for i in range(len(parts))])
        self.tc = tc
        width = max(int(self.sizes.max()), tc.batch_size)
        self.chunk = max(1, min(16, self.BUDGET // (len(parts) * tc.local_steps * width)))
        self.first, self.drawn = -1, torch.empty(0)

    def __call__(self, t: int) -> torch.Tensor:
        """``(n, local steps, batch size)`` indices into the training tensors for round ``t``."""
        if not self.first <= t < self.first + len(self.drawn):
            n, rounds = len(self.sizes), np.arange(t, t + self.chunk)
            pos = draw_batches(np.tile(self.sizes, self.chunk), self.tc.batch_size, np.tile(self.keys, self.chunk),
                               np.repeat(rounds, n), self.tc.local_steps)
            table = self.table.repeat(self.chunk, 1)
            self.first, self.drawn = t, table.gather(1, pos.flatten(1)).view(self.chunk, n, *pos.shape[1:])
        return self.drawn[t - self.first]

    def node(self, i: int, t: int) -> torch.Tensor:
        """Node ``i``'s ``(local steps, batch size)`` indices for round ``t``, drawn alone."""
        pos = draw_batches(self.sizes[i : i + 1], self.tc.batch_size, self.keys[i : i + 1], t, self.tc.local_steps)
        return self.table[i][pos[0]]


def accuracy(
    model: torch.nn.Module, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, net: DenseNet | None = None
) -> float:
    """Share of ``x`` that the model with parameters ``w`` classifies as ``y`` (through ``net``
    when the model has a dense view)."""
    if net is None:
        return models.accuracy(model, unflatten(w, model), x, y)
    with torch.no_grad():
        return float((net.logits(w, x).argmax(dim=1) == y).float().mean())


class CellRun:
    """One cell between rounds: its scenario built once, the global model, and the history.

    A round is ``finish_round(t, rows)`` on the nodes' rows of round ``t``: those of
    ``rows(t)`` here, or those Flower's simulated nodes computed with :meth:`node_row`
    (``evaluation.flower_engine``). Threads are pinned to one, so a cell gives the same bits
    whether cells run one at a time or in parallel processes.
    """

    def __init__(self, cell: Cell, vectorize: bool = True) -> None:
        torch.set_num_threads(1)
        cfg, seed = cell.config, cell.seed
        self.cell, self.vectorize, self.seed = cell, vectorize, seed
        self.n, self.f, self.rounds = int(cfg["nodes"]), int(cfg["byzantine"]), int(cfg["rounds"])
        self.tc = train_config(cfg)
        self.data = load(cfg["dataset"], root=cfg.get("data-root"), seed=seed)
        parts = partition(self.data.y_train, self.n, cfg["partition"], alpha=float(cfg.get("alpha", 1.0)), seed=seed)
        self.byzantine = sorted(torch.randperm(self.n, generator=generator(seed, "byzantine"))[: self.f].tolist())
        self.attack = attacks.build(cell.attack, self.f)
        self.chain = aggregators.build(cell.aggregator, self.f)
        self.model = build_model(cfg["model"], self.data.shape, self.data.classes, seed)
        self.net = DenseNet.of(self.model)
        self.xs, self.ys, self.parts = node_data(self.data, parts, self.byzantine, self.attack, seed)
        self.w = flat_params(self.model)
        self.momenta = torch.zeros(self.n, self.w.numel())
        self.step = partial(local_update, self.model, self.tc)
        self.draws = BatchDraws(self.parts, self.tc, seed)
        self.max_norm = cfg.get("max-norm")
        self.is_byz = torch.zeros(self.n, dtype=torch.bool)
        self.is_byz[self.byzantine] = True
        self.history: dict = {"accuracy": [], "kappa": [], "scores": [], "positive": [], "rejected": [], "skipped": 0}
        self.previous: torch.Tensor | None = None

    def node_row(self, i: int, t: int, w: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Node ``i``'s ``(row, new momentum)`` in round ``t`` from the global ``w`` and its
        momentum ``m``, computed alone as a volunteer computes it (node-side attacks included)."""
        idx = self.draws.node(i, t)
        row, m = self.step(unflatten(w, self.model), self.xs[idx], self.ys[idx], m)
        return (row * self.attack.scale() if self.is_byz[i] and isinstance(self.attack, NodeAttack) else row), m

    def rows(self, t: int) -> torch.Tensor:
        """Every node's row of round ``t`` (batched unless ``vectorize`` is off); the nodes'
        momenta advance."""
        if not self.vectorize:
            outs = [self.node_row(i, t, self.w, self.momenta[i]) for i in range(self.n)]
            self.momenta = torch.stack([o[1] for o in outs])
            return torch.stack([o[0] for o in outs])
        idx = self.draws(t)
        if self.net is not None:  # flat samples by index_select: 3x faster than indexing by a 3-d idx
            x = self.xs.flatten(1).index_select(0, idx.flatten()).view(*idx.shape, -1)
            y = self.ys.index_select(0, idx.flatten()).view(idx.shape)
            rows, self.momenta = local_updates(self.net, self.tc, self.w, x, y, self.momenta)
        else:
            batched = vmap(self.step, in_dims=(None, 0, 0, 0))
            rows, self.momenta = batched(unflatten(self.w, self.model), self.xs[idx], self.ys[idx], self.momenta)
        if isinstance(self.attack, NodeAttack) and self.attack.scale() != 1.0:
            rows = rows.clone()  # with one local step the rows *are* the momenta: scale a copy
            rows[self.is_byz] *= self.attack.scale()
        return rows

    def finish_round(self, t: int, rows: torch.Tensor) -> None:
        """The coordinator's steps on round ``t``'s rows (``(n, d)``, node order): validate,
        the threat model (on the valid honest rows; its rows are validated in turn), canonical
        order, aggregate, apply, score, evaluate."""
        history, is_byz = self.history, self.is_byz
        rejected = rejected_rows(rows, self.max_norm)
        honest = ~is_byz
        honest[list(rejected)] = False
        if self.f and isinstance(self.attack, OmniscientAttack) and bool(honest.any()):
            ctx = attacks.Context(
                n=self.n, generator=generator(self.seed, t, "attack"), aggregator=self.chain,
                previous=self.previous, own=rows[is_byz], round=t,
            )
            rows = rows.clone()
            rows[is_byz] = self.attack(rows[honest], ctx).to(rows.dtype)
            crafted = rejected_rows(rows[is_byz], self.max_norm)
            rejected = {i: r for i, r in rejected.items() if not is_byz[i]}
            rejected.update({self.byzantine[j]: r for j, r in crafted.items()})
        history["rejected"].append(rejected)
        ids = [i for i in range(self.n) if i not in rejected]  # rows are in node order: canonical
        X = rows if len(ids) == self.n else rows[ids]  # order is the ids' order, no restacking
        positive = is_byz[ids]
        try:
            aggregate = self.chain(X) if ids else None
        except ValueError:  # too few valid rows for the rule this round
            aggregate = None
        kept = None
        if aggregate is None:  # no step
            history["skipped"] += 1
            history["kappa"].append(float("nan"))
        else:
            honest_rows = X[~positive]
            history["kappa"].append(kappa_hat(aggregate, honest_rows) if len(honest_rows) else float("nan"))
            self.w = apply_update(self.w, aggregate, self.tc)
            self.previous, kept = aggregate, self.chain.last_kept
        history["scores"].append(score_round(X, self.f, kept) if ids else {})  # no row, no score
        history["positive"].append(positive)
        history["accuracy"].append(accuracy(self.model, self.w, self.data.x_test, self.data.y_test, self.net))

    def record(self, wall: float, training: float) -> dict:
        """The cell's result record after its last round (``wall`` and ``training`` seconds)."""
        cell, history, n, f = self.cell, self.history, self.n, self.f
        node_steps = self.rounds * n * self.tc.local_steps
        return {
            "aggregator": cell.aggregator, "attack": cell.attack, "seed": cell.seed,
            "config": cell.config, "sweep": cell.sweep, "vectorize": self.vectorize,
            "final_accuracy": history["accuracy"][-1], "accuracy": history["accuracy"],
            "detect": summarize_detection(history["scores"], history["positive"]),
            "kappa": history["kappa"], "kappa_max": max((k for k in history["kappa"] if k == k), default=float("nan")),
            "kappa_bound": kappa_bound(n, f) if n > 2 * f else float("inf"),
            "rejected": sum(len(r) for r in history["rejected"]), "skipped_rounds": history["skipped"],
            "backdoor_asr": backdoor_success(self.attack, self.model, self.w, self.data, self.net),
            "byzantine": self.byzantine,
            "model_sha256": sha256(self.w), "wall_time": wall,
            "node_steps_per_s": node_steps / wall,
            "train_node_steps_per_s": node_steps / training if training > 0 else None,
        }


def run_cell(cell: Cell, vectorize: bool = True) -> dict:
    """Train the cell's scenario under its attack and defence; return its result record."""
    run = CellRun(cell, vectorize)
    start = time.perf_counter()
    training = 0.0  # seconds spent drawing batches and computing the nodes' rows
    for t in range(run.rounds):
        began = time.perf_counter()
        rows = run.rows(t)
        training += time.perf_counter() - began
        run.finish_round(t, rows)
    return run.record(time.perf_counter() - start, training)


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
