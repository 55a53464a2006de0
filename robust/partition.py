"""Split a training set's indices among nodes, iid or with label skew.

Kinds:

- ``iid``: a seeded shuffle cut into near-equal parts.
- ``dirichlet`` (Hsu, Qi and Brown 2019, "Measuring the effects of non-identical data
  distribution for federated visual classification"): for each class ``c``, proportions
  ``q_c ~ Dir(alpha * 1_nodes)``; node ``k`` gets a share ``q_c[k]`` of class ``c``. Small
  ``alpha`` gives each node few classes; large ``alpha`` tends to iid. Draws are repeated
  (seeded, at most ``DIRICHLET_TRIES`` times) until every node has ``min_size`` samples.
- ``label-shards`` (McMahan et al. 2017, "Communication-efficient learning of deep networks
  from decentralized data"): sort by label, cut into ``nodes * shards`` shards, deal each
  node ``shards`` random shards, so it sees about ``shards`` labels.

Everything is drawn from one numpy Generator seeded with ``seed``, never from global state.

The ``flwr-*`` kinds use Flower Datasets' partitioners instead (the optional extra
``robust[flower-datasets]``, imported only when asked for), on the rows shuffled first as
``FederatedDataset`` does, with seeds derived from ``seed``:

- ``flwr-iid``: ``IidPartitioner``, contiguous near-equal cuts of the shuffled rows.
- ``flwr-dirichlet``: ``DirichletPartitioner(alpha=alpha, min_partition_size=<as dirichlet's>,
  self_balancing=False)``; it redraws at most 10 times, where ``dirichlet`` redraws 1000.
- ``flwr-shards``: ``ShardPartitioner(num_shards_per_partition=shards)``: shards of
  ``N // (nodes * shards)`` label-sorted rows, so up to ``nodes * shards - 1`` rows (more
  when shards are small) are left to no node, unlike ``label-shards``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

FLWR_KINDS = ("flwr-iid", "flwr-dirichlet", "flwr-shards")
KINDS = ("iid", "dirichlet", "label-shards", *FLWR_KINDS)
DIRICHLET_TRIES = 1000


def partition(y: torch.Tensor, nodes: int, kind: str = "iid", *, alpha: float = 1.0,
              shards: int = 2, seed: int = 0) -> list[torch.Tensor]:
    """One sorted int64 tensor of indices into ``y`` per node; the parts are disjoint.

    ``iid`` and ``label-shards`` cover every index; ``dirichlet`` does too, as each class is
    split entirely, and so do ``flwr-iid`` and ``flwr-dirichlet``; ``flwr-shards`` may not.
    ``alpha`` is used by the dirichlet kinds only, ``shards`` by the shard kinds.
    """
    _check(y, nodes, kind, alpha, shards)
    labels = y.cpu().numpy()
    rng = np.random.default_rng(seed)
    if kind in FLWR_KINDS:
        from . import flower_datasets  # lazily: datasets and pyarrow take seconds to import

        parts = flower_datasets.partition(labels, nodes, kind, alpha=alpha, shards=shards,
                                          min_size=_min_size(len(labels), nodes), seed=seed)
    elif kind == "iid":
        parts = np.array_split(rng.permutation(len(labels)), nodes)
    elif kind == "dirichlet":
        parts = _dirichlet(labels, nodes, alpha, rng)
    else:
        parts = _label_shards(labels, nodes, shards, rng)
    return [torch.from_numpy(np.sort(p).astype(np.int64)) for p in parts]


def _check(y: torch.Tensor, nodes: int, kind: str, alpha: float, shards: int) -> None:
    """Refuse parameters that cannot give every node data, saying what to change."""
    if kind not in KINDS:
        raise ValueError(f"unknown partition {kind!r}: choose one of {', '.join(KINDS)}")
    if y.ndim != 1 or y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"labels must be a 1-d integer tensor (got {y.dtype} of shape "
                         f"{tuple(y.shape)})")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a whole number >= 1 (got nodes={nodes!r})")
    if nodes > len(y):
        raise ValueError(f"{nodes} nodes cannot each get a sample of {len(y)}: use at most "
                         f"{len(y)} nodes")
    if kind in ("dirichlet", "flwr-dirichlet") and not (
            isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"{kind} alpha must be a finite number > 0 (got alpha={alpha!r}): "
                         "small (0.1) for skewed nodes, large (100) for nearly iid")
    if kind in ("label-shards", "flwr-shards"):
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"{kind} shards must be a whole number >= 1 "
                             f"(got shards={shards!r})")
        if nodes * shards > len(y):
            raise ValueError(f"{kind} needs nodes * shards <= {len(y)} samples (got "
                             f"{nodes} * {shards}): lower shards or nodes")


def _dirichlet(labels: np.ndarray, nodes: int, alpha: float,
               rng: np.random.Generator) -> list[np.ndarray]:
    """Hsu et al.'s per-class Dirichlet split, redrawn until every node has ``min_size``."""
    min_size = _min_size(len(labels), nodes)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    sizes = np.array([len(idx) for idx in by_class])
    for _ in range(DIRICHLET_TRIES):
        q = rng.dirichlet(np.full(nodes, float(alpha)), size=len(by_class))  # (classes, nodes)
        ends = np.floor(np.cumsum(q, axis=1) * sizes[:, None]).astype(np.int64)
        ends[:, -1] = sizes  # the cumulative sum can end a rounding error below 1
        counts = np.diff(ends, axis=1, prepend=0)
        if counts.sum(axis=0).min() >= min_size:
            break
    else:
        raise ValueError(f"dirichlet alpha={alpha} left a node with fewer than {min_size} "
                         f"samples in {DIRICHLET_TRIES} draws ({len(labels)} samples, {nodes} "
                         "nodes): raise alpha or use fewer nodes")
    owner = np.empty(len(labels), np.int64)
    for idx, row in zip(by_class, counts):
        owner[rng.permutation(idx)] = np.repeat(np.arange(nodes), row)
    # A stable sort by owner lists each node's indices in ascending order.
    return np.split(np.argsort(owner, kind="stable"), np.cumsum(counts.sum(axis=0))[:-1])


def _min_size(samples: int, nodes: int) -> int:
    """Two samples per node when there are enough: a node with one sample is barely a node."""
    return 2 if samples >= 2 * nodes else 1


def _label_shards(labels: np.ndarray, nodes: int, shards: int,
                  rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al.'s shards: label-sorted contiguous runs, ``shards`` per node at random."""
    runs = np.array_split(np.argsort(labels, kind="stable"), nodes * shards)
    dealt = rng.permutation(nodes * shards).reshape(nodes, shards)
    return [np.concatenate([runs[s] for s in row]) for row in dealt]
