"""Evidence over time: a node's per-round suspicion accumulated by a CUSUM (Page, 1954).

A patient attacker stays under any per-round threshold; what gives it away is that it is a
little suspicious *every* round. Each round, each accepted node's ``median-cosine`` score
(``nodes.engine.detectors``: how far its update's direction is from the round's coordinate median,
two-sided, in cosine units) becomes a robust z-score relative to the round's spread,

    z_i = (s_i - median_j s_j) / max(1.4826 * MAD_j s_j, FLOOR),     clipped to [-2K, 2K],

and accumulates into the node's one-sided CUSUM

    S_i <- max(0, S_i + z_i - K),

which quarantines the node when ``S_i > h``. ``K`` is the reference: the per-round excess an
attacker must keep up to be caught (honest heterogeneity rarely stays above it). The cap ``2K``
bounds one round's evidence, and ``h >= K``, so one extreme round alone never quarantines.

``FLOOR`` (0.1, in cosine units) is the smallest spread the z is taken relative to. The
scores are cosines, already on an absolute scale, and a round's MAD can collapse far below
any honest heterogeneity: late in training, or when colluders sit on the median (``mimic``
sends five copies of one honest row) and so shrink the MAD of everyone else's gap. Without
the floor such a round turns an honest gap of 0.27 into z = 10.8 (quick scenario, MAD 0.02):
the attacker would frame honest nodes. With it, a gap counts as atypical only if it is
several times 0.1 above the typical one; a sign-flipped or IPM row's gap is about 1 (its
cosine to the median is negative while honest rows' is about 0.3), z about 8-11.

``K = 6``: on non-IID data honest directions are persistent outliers. On the quick scenario
(no quarantine) an honest node's z, floored, reaches about 7 for several consecutive rounds
(under Krum late in training an honest node points against the median for 20 rounds). With a
reference of 6 such a node gains little and rarely two rounds running, while a row pointing
against the median (floored z 8-12) gains 2-6 per round, so crosses ``h`` in two to four.

``h`` comes from the target ``false_alarm``: the probability that an honest node is ever
quarantined over ``rounds`` rounds. It is the ``1 - false_alarm`` quantile of ``max_t S_t``
over ``PATHS`` simulated honest paths (seeded: the same ``h`` everywhere) under a null that
is heavy-tailed and persistent, as honest scores are: ``z`` is an AR(1) process,
``z_t = rho z_{t-1} + sqrt(1 - rho^2) e_t``, its innovations ``e`` a Student-t with 3 degrees
of freedom scaled by its MAD (the floor only shrinks z, so the null is conservative). A
node's direction is persistent (non-IID data, the momentum protocol): on the quick scenario
the honest z's lag-1 correlation is 0.79-0.96. ``rho`` is measured on the run itself: the
pooled lag-1 correlation of every node's z from one round to the next (Byzantine nodes
included, whose persistence only raises ``h``), rounded up to a multiple of 0.05; until
``MIN_PAIRS`` pairs are seen it is ``RHO_PRIOR``. ``h`` is recomputed when that value changes.
For a stricter target (0.001) the quantile, not the one-round bound, sets ``h``.

**The loss score's evidence** (``loss-evidence``, which needs a root set, ``root = N``): a second
CUSUM of the same form accumulates the ``loss-score`` (``nodes.engine.loss_ratings``: what the
row, at its share of the mean, does to the root samples' loss), one-sided as the score is: a
label-flipper's update raises the held-out loss a little every round, which no geometric score
sees (its direction and size are ordinary). The two streams share the ``false_alarm`` target
(each is calibrated to half of it: the chance that an honest node is quarantined by either stays
within it). Its z has no floor but :data:`TINY` (its unit, nats of loss, moves with the model).
``LOSS_K = 4``: chosen on the digits quick grid (5 rules x 7 attacks x 2 seeds, ``root = 100``)
with each round's effects recorded and the CUSUM replayed, the largest flipper count at which no
honest node is quarantined (reference 3: 13 of 50, 4: 15, 5: 17 and 1 honest node, 6: 17 and 4).
In the bench it quarantines 12 of those 50 flippers by rounds 35-49 and no honest node; on
mnist1d, not used to choose, no flipper, and 8 honest nodes in ALIE cells, whose identical, most
helpful rows shrink the others' spread: hence off by default
(``docs/measurements/attacks.md#the-loss-score-as-evidence``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

K = 6.0
PATHS = 10_000
T3_MAD = 0.7649  # the median absolute deviation of a Student-t with 3 degrees of freedom
RHO_PRIOR, RHO_STEP, MIN_PAIRS = 0.95, 0.05, 30
GRID = (*(k * RHO_STEP for k in range(round(RHO_PRIOR / RHO_STEP))), RHO_PRIOR)  # the rho a run can measure
FLOOR = 0.1  # the smallest spread of the cosine gaps a z is taken relative to (see the module)
LOSS_K = 4.0  # the loss score's reference (see the module)
TINY = 1e-12  # the spread below which no round's scores are divided


@dataclass(frozen=True)
class Stream:
    """A score the evidence accumulates: the detector it reads (``nodes.engine.detectors``), its
    reference ``k`` (its z is capped at ``2 k``), and the smallest spread its z is taken
    relative to (at least :data:`TINY`)."""

    score: str
    k: float = K
    floor: float = TINY


DIRECTION = Stream("median-cosine", floor=FLOOR)
LOSS = Stream("loss-score", k=LOSS_K)


def robust_z(scores: torch.Tensor, stream: Stream = DIRECTION) -> torch.Tensor:
    """``(s - median) / max(1.4826 MAD, floor)`` clipped to ``[-2 k, 2 k]``, the floor and ``k``
    the ``stream``'s (the floor at least :data:`TINY`: a round whose scores all equal the median
    divides by no zero)."""
    s = scores.to(torch.float64)
    med = s.median()
    mad = torch.clamp_min(1.4826 * (s - med).abs().median(), max(stream.floor, TINY))
    return ((s - med) / mad).clamp(-2 * stream.k, 2 * stream.k)


def threshold(false_alarm: float, rounds: int, rho: float, k: float = K) -> float:
    """``h``: an honest node's CUSUM of reference ``k`` exceeds it within ``rounds`` rounds with
    probability ``false_alarm`` under the AR(1) null of correlation ``rho`` (see the module), and
    never for one round alone. The values of ``rho`` a run can measure (:data:`GRID`) are simulated
    together, once per process for each target and run length."""
    if not 0 < false_alarm < 1 or rounds < 1 or not 0 <= rho < 1:
        raise ValueError(f"false_alarm must be in (0, 1), rounds >= 1, rho in [0, 1) (got {false_alarm}, {rounds}, {rho})")
    return thresholds(false_alarm, rounds, GRID if rho in GRID else (rho,), k)[rho]


@lru_cache(maxsize=64)
def thresholds(false_alarm: float, rounds: int, rhos: tuple[float, ...], k: float = K) -> dict[float, float]:
    """:func:`threshold` for each of ``rhos``, simulated in one pass: every ``rho`` sees the
    same innovations, and each path's arithmetic is elementwise, so a value does not depend
    on which others are simulated with it."""
    g = torch.Generator().manual_seed(0)
    r = torch.tensor(rhos, dtype=torch.float64)[:, None]
    c = torch.tensor([(1 - rho**2) ** 0.5 for rho in rhos], dtype=torch.float64)[:, None]
    z = S = torch.zeros(len(rhos), PATHS, dtype=torch.float64)
    peak = torch.zeros(len(rhos), PATHS, dtype=torch.float64)
    for t in range(rounds):
        normal = torch.randn(PATHS, generator=g, dtype=torch.float64)
        chi2 = torch.randn(PATHS, 3, generator=g, dtype=torch.float64).square().sum(dim=1)
        e = normal / (chi2 / 3).sqrt() / (1.4826 * T3_MAD)
        z = e.expand(len(rhos), PATHS) if t == 0 else r * z + c * e
        S = (S + z.clamp(-2 * k, 2 * k) - k).clamp_min(0)
        torch.maximum(peak, S, out=peak)
    return {rho: max(float(torch.quantile(peak[i], 1 - false_alarm)), k) for i, rho in enumerate(rhos)}


class Cusum:
    """Every node's CUSUM ``S`` of one :class:`Stream`, and the pooled lag-1 moments of the
    nodes' z (for ``rho``); :meth:`update` returns the nodes whose evidence crossed ``h``."""

    def __init__(self, false_alarm: float, rounds: int, stream: Stream = DIRECTION) -> None:
        self.false_alarm, self.rounds, self.stream = false_alarm, rounds, stream
        self.S: dict[str, float] = {}
        self.last: dict[str, float] = {}  # each node's z in the last round it was scored
        self.moments = [0.0] * 6  # pairs (a = z before, b = z after): count, sum a, sum b, sum a^2, sum b^2, sum ab

    @property
    def rho(self) -> float:
        """The persistence the threshold assumes: measured, rounded up to ``RHO_STEP``."""
        n, sa, sb, saa, sbb, sab = self.moments
        if n < MIN_PAIRS:
            return RHO_PRIOR
        var_a, var_b = saa / n - (sa / n) ** 2, sbb / n - (sb / n) ** 2
        corr = (sab / n - sa * sb / n**2) / (var_a * var_b) ** 0.5 if var_a > 0 and var_b > 0 else 1.0
        return min(RHO_PRIOR, max(0.0, math.ceil(round(corr / RHO_STEP, 9)) * RHO_STEP))

    @property
    def h(self) -> float:
        return threshold(self.false_alarm, self.rounds, self.rho, self.stream.k)

    def update(self, ids: list[str], scores: torch.Tensor) -> list[str]:
        """Add one round: ``scores`` are the stream's score of the accepted rows ``ids``."""
        if len(ids) < 3:  # no spread to stand out from
            return []
        for node, z in zip(ids, robust_z(scores, self.stream).tolist()):
            if node in self.last:
                a = self.last[node]
                for i, v in enumerate((1.0, a, z, a * a, z * z, a * z)):
                    self.moments[i] += v
            self.last[node] = z
            self.S[node] = max(0.0, self.S.get(node, 0.0) + z - self.stream.k)
        h = self.h
        return sorted(node for node in ids if self.S[node] > h)

    def state(self) -> dict:
        return {"S": dict(self.S), "last": dict(self.last), "moments": list(self.moments)}

    def load_state(self, state: dict) -> None:
        self.S = {str(k): float(v) for k, v in state.get("S", {}).items()}
        self.last = {str(k): float(v) for k, v in state.get("last", {}).items()}
        self.moments = [float(v) for v in state.get("moments", [0.0] * 6)]
