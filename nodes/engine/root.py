"""The coordinator's root data set (FLTrust, Cao et al., NDSS 2021): a few clean training
samples the coordinator holds, and its own update on them each round.

``root = N`` (a setting and scenario key; 0: none) draws ``N`` samples of the training set,
seeded by ``(run seed, "root")``, so the coordinator, the bench and a log's replay hold the
same ones. The reference update of a round is computed as a volunteer computes its row
(``nodes.engine.training.compute``, node id ``ROOT``): same protocol, batches and compute profile,
so it has a row's meaning, sign and scale. Under the ``momentum`` protocol the root keeps
its worker momentum from round to round, in :meth:`state` (checkpointed with the engine).
A rule that ``needs`` the reference (``fltrust``) gets it through ``aggregators.RoundInputs``.
"""

from __future__ import annotations

import torch

from robust.data import Dataset
from robust.params import sha256
from robust.seeds import generator

from ..wire import Task
from .protocol import Protocol
from .training import compute

ROOT = "root"  # the node id the root's batches and random streams are keyed by


class Root:
    def __init__(self, settings, data: Dataset) -> None:
        n = len(data.y_train)
        if settings.root > n:
            raise ValueError(f"root={settings.root} but the training set has {n} samples: lower root")
        chosen = torch.randperm(n, generator=generator(settings.seed, ROOT))[: settings.root]
        self.x, self.y, self.classes = data.x_train[chosen], data.y_train[chosen], data.classes
        self.settings = settings
        self.keeps_momentum = Protocol.of(settings).keeps_momentum
        self.m: torch.Tensor | None = None
        self.cached: tuple[int, torch.Tensor] | None = None  # (round, its reference)

    @classmethod
    def of(cls, settings, data: Dataset) -> Root | None:
        """The run's root, or ``None`` when ``root = 0``."""
        return cls(settings, data) if settings.root else None

    def update(self, round: int, w: torch.Tensor) -> torch.Tensor:
        """The reference of ``round`` from the global model ``w``: computed once per round (the
        momentum advances once), then the same tensor."""
        if self.cached is None or self.cached[0] != round:
            task = Task.of(self.settings, ROOT, round, sha256(w))
            row, m = compute(task, w, self.x, self.y, self.classes, ROOT, torch.device("cpu"), m=self.m)
            if self.keeps_momentum:
                self.m = m
            self.cached = (round, row.to(w.dtype))
        return self.cached[1]

    def state(self) -> dict:
        return {} if self.m is None else {"m": self.m}

    def load_state(self, state: dict) -> None:
        self.m, self.cached = state.get("m"), None
