"""A model's parameters as one flat float vector, and back: the row a node sends."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters, in ``named_parameters`` order, as one detached 1-D tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def unflatten(vector: torch.Tensor, model: nn.Module) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` view of ``vector`` shaped like ``model``'s parameters."""
    sizes = [p.numel() for p in model.parameters()]
    if sum(sizes) != vector.shape[-1]:
        raise ValueError(f"vector has {vector.shape[-1]} values, the model {sum(sizes)}")
    out, start = {}, 0
    for (name, p), size in zip(model.named_parameters(), sizes):
        out[name] = vector[start : start + size].view_as(p)
        start += size
    return out


def sha256(vector: torch.Tensor) -> str:
    """SHA-256 of the vector's bytes (dtype and shape included): the model's identity."""
    v = vector.detach().cpu().contiguous()
    h = hashlib.sha256(f"{v.dtype}:{tuple(v.shape)}:".encode())
    h.update(v.numpy().tobytes())
    return h.hexdigest()
