"""A node's committed trajectory: the hash of its state after each local step, as one root.

Under ``delta:steps=K`` a node's state is its local parameters and its local optimiser's state.
State ``s_i`` (:func:`state`) is the float32 vector ``[local_i, v_i]`` on the CPU (with
``inner=adamw``: ``[local_i, m_i, v_i]``), ``s_0 = [w, 0]`` (the task's base model, no momentum),
and ``s_K`` gives the row: ``row = local_K - w``. The node
commits to

    h_i = SHA-256(s_i)  (``robust.params.sha256``: dtype, shape and bytes),
    root = SHA-256("robust-trajectory/v1" | h_0 | ... | h_K)        (:func:`root`)

with its reply. A hash list rather than a Merkle tree: a dispute (``nodes.engine.referee``)
settles every step, so all ``K + 1`` hashes travel anyway (32 bytes each) and a tree's
inclusion proofs would save nothing.

The node keeps only the hashes. When a dispute asks for its states it recomputes them from the
task, bit for bit on its own hardware (same process, same profile), rather than keeping them on
disk: at 100M parameters one state is 800 MB (parameters and momentum, float32), so
``delta:steps=16`` would keep 13.6 GB per task for a dispute that comes to one task in
hundreds; recomputing costs one more training of the task, and only when disputed. Hashing
costs ``K + 1`` SHA-256 passes over the state per task (measured in ``docs/disputes.md``).
"""

from __future__ import annotations

import hashlib

import torch

from robust.params import sha256_joined

VERSION = b"robust-trajectory/v1"


def state(local: dict[str, torch.Tensor], optimiser: tuple[dict[str, torch.Tensor], ...],
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The state ``[local, *optimiser]`` (SGD's ``v``, or AdamW's ``m, v``) as one CPU vector
    (float32 unless said; a fresh tensor)."""
    blocks = (local, *optimiser)
    return torch.cat([p.detach().reshape(-1) for block in blocks for p in block.values()]).to("cpu", dtype)


def root(hashes: list[str]) -> str:
    """The commitment to the state hashes ``h_0 .. h_K``."""
    h = hashlib.sha256(VERSION)
    for one in hashes:
        h.update(b"|" + one.encode())
    return h.hexdigest()


def start(w: torch.Tensor, width: int = 2) -> torch.Tensor:
    """``s_0 = [w, 0, ...]`` (``width`` blocks: ``Protocol.width``): where every honest trajectory
    of a task on base ``w`` begins."""
    w = w.detach().to("cpu", torch.float32)
    return torch.cat([w, torch.zeros((width - 1) * w.numel())])


class Recorder:
    """``on_state`` for ``Protocol.node_update``: hashes each state, and keeps those asked for
    (``keep``: a set of steps, or ``True`` for all)."""

    def __init__(self, keep: set[int] | bool = False) -> None:
        self.keep = keep
        self.hashes: list[str] = []
        self.states: dict[int, torch.Tensor] = {}

    def __call__(self, step: int, local: dict[str, torch.Tensor], optimiser: tuple[dict[str, torch.Tensor], ...]
                 ) -> None:
        # hashed block by block (sha256 of state(...), without making it): a state is joined only if kept
        self.hashes.append(sha256_joined([p for block in (local, *optimiser) for p in block.values()]))
        if self.keep is True or (self.keep and step in self.keep):
            self.states[step] = state(local, optimiser)

    @property
    def root(self) -> str:
        return root(self.hashes)
