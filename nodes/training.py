"""What a volunteer computes in a round: its update from the global model and its data.

One function, :func:`local_update`, written with ``torch.func`` so that the harness can run
it per node (as a volunteer does) or ``vmap`` it over all nodes at once; both modes compute
the same mathematics.

- ``local_steps == 1`` (D-SGD): the node sends its worker momentum
  ``m <- beta m + g`` (PyTorch SGD convention) of the gradient ``g`` on one batch; the server
  steps ``w <- w - lr F(m_1..m_n)``.
- ``local_steps > 1`` (FedAvg-style): the node runs that many SGD steps with momentum
  ``beta`` from ``w`` and sends the model delta ``w_local - w``; the server steps
  ``w <- w + F(delta_1..delta_n)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad



@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    local_steps: int = 1


Params = dict[str, torch.Tensor]


def loss_fn(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model`` with parameters ``params`` on ``(x, y)``."""
    return F.cross_entropy(functional_call(model, params, (x,)), y)


def local_update(
    model: nn.Module, cfg: TrainConfig, params: Params, xs: torch.Tensor, ys: torch.Tensor,
    m: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row to send, new worker momentum)`` from the global parameters (``unflatten(w)``)
    and batches ``xs[s], ys[s]``, one per local step. Gradients stay a parameter dict until
    the row is flattened (flattening inside the transform costs more than the step itself)."""
    g_of = grad(lambda p, x, y: loss_fn(model, p, x, y))
    if cfg.local_steps == 1:
        m = cfg.momentum * m + _flat(g_of(params, xs[0], ys[0]))
        return m, m
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    local = params
    for s in range(cfg.local_steps):
        g = g_of(local, xs[s], ys[s])
        v = {k: cfg.momentum * v[k] + g[k] for k in v}
        local = {k: local[k] - cfg.lr * v[k] for k in local}
    return _flat(local) - _flat(params), m


def _flat(params: Params) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params.values()])


def apply_update(w: torch.Tensor, aggregate: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """The server's step with the robust aggregate of the rows."""
    if cfg.local_steps == 1:
        return w - cfg.lr * aggregate
    return w + aggregate
