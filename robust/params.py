"""A model's trained parameters as one flat float vector, and back: the row a node sends.

The trained parameters are the floating-point ones that require a gradient, in
``named_parameters`` order; frozen and integer parameters, and buffers, stay the model's own
(``robust.models``).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def trained(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every parameter training changes: floating point, requiring a gradient."""
    return [(k, p) for k, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]


def flat_params(model: nn.Module) -> torch.Tensor:
    """The trained parameters as one detached 1-D tensor."""
    return torch.cat([p.detach().reshape(-1) for _, p in trained(model)])


def unflatten(vector: torch.Tensor, model: nn.Module) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` view of ``vector`` shaped like ``model``'s trained parameters."""
    params = trained(model)
    size = sum(p.numel() for _, p in params)
    if size != vector.shape[-1]:
        raise ValueError(f"vector has {vector.shape[-1]} values, the model {size}")
    out, start = {}, 0
    for name, p in params:
        out[name] = vector[start : start + p.numel()].view_as(p)
        start += p.numel()
    return out


def hash_prefix(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """What :func:`sha256` hashes before a vector's bytes: its dtype and shape (for hashes fed
    block by block, which must name the same rows)."""
    return f"{dtype}:{tuple(shape)}:".encode()


def sha256(vector: torch.Tensor) -> str:
    """SHA-256 of the vector's bytes (dtype and shape included): the model's identity."""
    v = vector.detach().cpu().contiguous()
    h = hashlib.sha256(hash_prefix(v.dtype, v.shape))
    _feed(h, v)
    return h.hexdigest()


def sha256_joined(blocks: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> str:
    """:func:`sha256` of the blocks flattened and joined, as ``dtype`` (``torch.cat``), without
    making that vector: block by block."""
    h = hashlib.sha256(hash_prefix(dtype, (sum(b.numel() for b in blocks),)))
    for block in blocks:
        _feed(h, block.detach().to("cpu", dtype).contiguous())
    return h.hexdigest()


def _feed(h, v: torch.Tensor) -> None:
    """Hash ``v``'s bytes from its own buffer (a contiguous CPU tensor; never a copy of it)."""
    h.update(memoryview(v.numpy()).cast("B"))
