"""Lookahead for asynchronous rounds (``lookahead = true``; DANA, Hakimi et al., 2019, "Taming
momentum in a distributed asynchronous environment").

A task sent now is aggregated ``tau`` versions later, into a model that has moved on; its
update was computed at the wrong point. DANA sends instead the model the run is expected to
reach by then, extrapolated along the server's momentum. Here the momentum is the exponential
average of the global model's own steps (robust to one noisy buffer; no extra optimizer
state is needed whatever the protocol):

    v <- BETA v + (1 - BETA) (w_new - w_old)        after every step (v = the first step at first)
    w_sent = w + tau_hat v,                          tau_hat = the mean staleness of the last step's rows

``tau_hat`` is measured on the run: the expected staleness is what the schedule has just
shown. Both are functions of the schedule and the rows, checkpointed with the engine: the
sent model (and so each task's base SHA-256) is replayed bit for bit. Before the first step
the sent model is the current one.
"""

from __future__ import annotations

import torch

BETA = 0.5


class Lookahead:
    def __init__(self) -> None:
        self.velocity: torch.Tensor | None = None
        self.tau = 0.0  # the expected staleness

    def observe(self, w_old: torch.Tensor, w_new: torch.Tensor, staleness: list[int]) -> None:
        """One step of the run, from ``w_old`` to ``w_new``, on rows of these ``staleness``."""
        step = w_new - w_old
        self.velocity = step if self.velocity is None else BETA * self.velocity + (1 - BETA) * step
        self.tau = sum(staleness) / len(staleness) if staleness else 0.0

    def predict(self, w: torch.Tensor) -> torch.Tensor:
        """The model to send: ``w + tau_hat v`` (``w`` itself before any step)."""
        return w if self.velocity is None or self.tau == 0 else w + self.tau * self.velocity

    def state(self) -> dict:
        return {"velocity": self.velocity, "tau": self.tau}

    def load_state(self, state: dict) -> None:
        self.velocity, self.tau = state.get("velocity"), float(state.get("tau", 0.0))
