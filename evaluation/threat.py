"""The bench's threat model, played through the round engine's hook (``nodes.engine.ThreatHook``).

Before the rule, an omniscient attacker sees the round's valid rows and replaces those of the
Byzantine nodes still asked with the rows its attack crafts from the honest ones (colluding:
one call crafts them all); the engine then validates the crafted rows like any other.
After the rule, the hook measures the damage of the round: the empirical robustness
coefficient ``kappa_hat`` of the aggregate against the honest rows. Node-side attacks need
no hook: those Byzantine nodes trained on poisoned data already.
"""

from __future__ import annotations

import math

import torch

import attacks
from attacks.base import OmniscientAttack
from robust.seeds import generator

from .metrics import kappa_hat


class ThreatModel:
    def __init__(self, attack: attacks.Attack, byzantine: set[str], seed: int) -> None:
        self.attack, self.byzantine, self.seed = attack, byzantine, seed
        self.previous: torch.Tensor | None = None  # the last aggregate, which attacks may use
        self.kappa: list[float] = []

    def _mask(self, ids: list[str]) -> torch.Tensor:
        return torch.tensor([i in self.byzantine for i in ids], dtype=torch.bool)

    def rows(self, engine, round: int, ids: list[str], X: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.attack, OmniscientAttack) or self.attack.name == "none":
            return X
        byz = self._mask(ids)
        k = int(byz.sum())
        if k == 0 or k == len(ids):
            return X
        ctx = attacks.Context(n=len(ids), generator=generator(self.seed, round, "attack"), aggregator=engine.chain,
                              previous=self.previous, own=X[byz], round=round)
        X = X.clone()
        X[byz] = self.attack(X[~byz], ctx)[:k].to(X.dtype)
        return X

    def observe(self, ids: list[str], X: torch.Tensor, aggregate: torch.Tensor | None) -> None:
        honest = X[~self._mask(ids)]
        if aggregate is None or len(honest) == 0:
            self.kappa.append(math.nan)
            return
        self.kappa.append(kappa_hat(aggregate, honest))
        self.previous = aggregate
