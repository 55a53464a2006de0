"""Which samples a node trains on: counter-based draws, any number of nodes in one call.

A volunteer draws its batches for round ``t`` alone, in a fresh process; the harness draws
every node's batches of a round at once. Both call :func:`draw_batches`, so both train on
the same samples. Each draw is a pure function of ``(node key, round, step, position)``
(SplitMix64's finaliser, Steele et al. 2014, on uint64 with wrapping arithmetic), so no
generator is created per node and round, and the whole ``(nodes, steps, batch)`` draw is a
dozen array operations.

- A node with at least ``batch`` samples gets ``batch`` distinct ones per step: the
  positions with the ``batch`` smallest hashes (high 32 bits) (a uniform random ordered subset, like the
  head of a random permutation).
- A smaller node samples with replacement: ``hash mod size``.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import ArrayLike

from .seeds import derive

U64 = np.uint64
GOLDEN, MUL1, MUL2 = U64(0x9E3779B97F4A7C15), U64(0xBF58476D1CE4E5B9), U64(0x94D049BB133111EB)
HIGH, LOW = U64(0xFFFFFFFF00000000), U64(0xFFFFFFFF)


def mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array (arrays wrap silently): every input
    bit flips about half of the output bits. NumPy, not torch: microseconds per call."""
    z = z + GOLDEN
    z = (z ^ (z >> U64(30))) * MUL1
    z = (z ^ (z >> U64(27))) * MUL2
    return z ^ (z >> U64(31))


def node_key(seed: int, node: object) -> int:
    """The 63-bit batch stream of ``node`` (an index in the harness, a key fingerprint on a
    volunteer) in the run seeded ``seed``."""
    return derive(seed, node, "batch")


def draw_batches(sizes: ArrayLike, batch: int, keys: ArrayLike, round: ArrayLike, steps: int) -> torch.Tensor:
    """``(n, steps, batch)`` int64 positions: ``out[i, s]`` indexes node ``i``'s ``sizes[i]``
    samples for its local step ``s`` of round ``round`` (one round, or one per row: rows may
    be the same node in several rounds); ``keys[i]`` is :func:`node_key` of node ``i``."""
    sizes, keys = np.asarray(sizes, dtype=np.int64), np.asarray(keys, dtype=np.int64)
    rounds = np.broadcast_to(np.asarray(round, dtype=np.int64), keys.shape) if keys.ndim == 1 else None
    if sizes.ndim != 1 or sizes.shape != keys.shape or rounds is None:
        raise ValueError(f"sizes, keys and rounds must be 1-D and of one length (got {sizes.shape}, "
                         f"{keys.shape} and {np.shape(round)})")
    if batch < 1 or steps < 1 or (rounds < 0).any():
        raise ValueError(f"need batch >= 1, steps >= 1 and rounds >= 0 (got {batch}, {steps}, {round})")
    if (sizes < 1).any() or (sizes > LOW).any():
        raise ValueError(f"every node needs between 1 and 2^32 - 1 samples (sizes {sizes.tolist()})")
    width = max(int(sizes.max()), batch)
    per_round = mix(keys.astype(U64) ^ rounds.astype(U64))  # arrays wrap silently, scalars would warn
    per_step = mix(per_round[:, None] ^ np.arange(steps, dtype=U64))
    hashes = mix(per_step[:, :, None] ^ np.arange(width, dtype=U64))  # (n, steps, width)
    # the high 32 bits of a hash above the position: one plain sort orders positions by
    # hash, ties by position; padding (positions past a node's size) sorts last
    padding = np.arange(width) >= sizes[:, None, None]
    tagged = np.where(padding, HIGH, hashes & HIGH) | np.arange(width, dtype=U64)
    distinct = (np.sort(tagged, axis=2)[:, :, :batch] & LOW).astype(np.int64)
    repeated = hashes[:, :, :batch] % sizes.astype(U64)[:, None, None]
    pos = np.where((sizes >= batch)[:, None, None], distinct, repeated.astype(np.int64))
    return torch.from_numpy(pos)
