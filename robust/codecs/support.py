"""A support shared by every node of a round: which coordinates a task's replies carry.

The coordinator chooses it and the task announces it: the coordinates are drawn from a seed derived
from the task's run seed and number (``robust.seeds.derive(seed, number, "support")``), which
every node receives with the task, so no index travels. A reply states the seed it encoded
on (one int64, :data:`CLAIM`): the coordinator refuses a reply whose claim is not its task's
(:func:`refusal`), and anyone decoding a stored reply (the audit) draws the same coordinates
from it.

Why shared: a coordinate-wise robust rule (trimmed mean, median, NNM's distances) sees one value
per node in each coordinate. Rows each sparse on a support of their own (``topk``, ``randk``)
are 0 in most coordinates of most rows, and the rule trims the honest signal away; rows dense on
the same coordinates are a smaller dense matrix the rule defends as it defends the whole. What
a round does not send waits in the nodes' error feedback, as any biased codec's residual does.
Coordinates, not blocks of them: measured on mnist1d (d = 3,274, 25 nodes, 5 Byzantine,
``nnm+trimmed-mean``, 16 local steps, 2 seeds), a quarter of the 128-coordinate blocks a round
ended at 44% clean where a quarter of the coordinates ended at 56% (digits: alike, 96%). The
draw is a permutation of the ``d`` coordinates, made once per task (:func:`chosen` keeps the
last two): O(d) time and int64 memory, as one more row.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from robust.seeds import derive

from .base import share_of

CLAIM = "support"  # the array a reply's claim travels in
INT64 = np.dtype("<i8")
SEEDS = 2**63  # derive() gives 63-bit seeds: a claim outside [0, 2**63) is no task's


def task_seed(key: tuple, codec: str) -> int:
    """The support's seed for the task of ``key`` = ``(run seed, task number, ...)`` (the node id
    a codec key may carry is left out: every node of the task shares the support)."""
    if len(key) < 2:
        raise ValueError(f"{codec} sends the coordinates its task announces: pass key=(run seed, task number, "
                         "node id)")
    return derive(int(key[0]), int(key[1]), "support")


@functools.lru_cache(maxsize=2)
def chosen(d: int, share: float, seed: int) -> torch.Tensor:
    """The support's coordinates (int64, ascending) among ``d``, drawn from ``seed``. Cached:
    every reply to a task decodes on the same support (do not modify the result)."""
    order = torch.randperm(d, generator=torch.Generator().manual_seed(seed))
    return order[: share_of(d, share)].sort().values


def claimed(enc: dict, codec: str) -> int:
    """The seed an encoding of ``codec`` claims (its :data:`CLAIM` array, of one value, checked
    in range)."""
    seed = int(enc[CLAIM][0])
    if not 0 <= seed < SEEDS:
        raise ValueError(f"{codec} array {CLAIM!r} claims the seed {seed}, outside [0, 2**63): no task's support")
    return seed


def refusal(enc: dict, key: tuple, codec: str) -> str | None:
    """Why an encoding of ``codec`` does not answer the task of ``key`` (``None`` if its claim is
    the task's)."""
    got, want = int(enc[CLAIM][0]), task_seed(key, codec)
    if got != want:
        return (f"update encoded on another task's support (claims seed {got}, task {int(key[1])}'s is {want}): "
                "a node encodes on the coordinates its own task announces")
    return None
