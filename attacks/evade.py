"""Evade: the strongest rows that the chosen detectors still rank among the honest ones
("Subtle attackers": attacks that know the defence).

Each round the Byzantine rows are ``B(s) = r(s) + J`` along a direction ``r``:

- ``alie``: ``r(z) = mean(H) - z std(H)`` (Baruch et al., NeurIPS 2019);
- ``ipm``: ``r(eps) = -eps mean(H)`` (Xie et al., UAI 2019);
- ``sign``: ``r(s) = mean(H) - s sign(mean(H)) std(H)``: each coordinate pushed ``s`` honest
  standard deviations against the sign of the honest mean, so a coordinate's sign is flipped
  once ``s std > |mean|`` (a sign-flip, blended in coordinate-wise in units of the honest
  spread; the plain blend ``(1 - s) mean(H)`` would be ipm's line again);
- ``grad``: ``r(s) = mean(H_t) + s ||std(H_t)|| unit(Q_t mean(H_{t-1}))``, against the honest
  nodes' *fresh* gradient: ``Q_t x = x - <x, u> u`` with ``u = unit(mean(H_t))`` removes the
  part along this round's honest mean, ``H_{t-1}`` are the previous round's honest rows and
  ``||std(H)||`` is the honest rows' root-mean-square distance to their mean (``s = 1`` moves
  the colluders' mean as far as a typical honest row sits from the honest one). Under worker
  momentum each row is ``m_t = beta m_{t-1} + g_t``, so the honest mean gradient's part
  orthogonal to ``mean(H_t)`` is ``Q_t g_t = -beta Q_t mean(H_{t-1})`` whatever ``beta``: the
  push cancels the turn the fresh gradient gives the honest mean and keeps the aggregate on
  the direction it had. The momentum answers a constant push ten times over (``beta = 0.9``)
  but a fresh gradient only once, before it enters the momentum: cancelling it is what
  compounds. The push leaves every row's component along ``mean(H_t)`` alone; in a round
  whose previous one the attack did not see (the first) it does not push.

``J`` is the per-row jitter, one of

- ``jitter=gauss``: the seeded ``spread * std(H) * N(0, 1)`` of
  :meth:`OmniscientAttack.jitter_rows` (default ``spread=1``: a crafted row varies around its target
  as much as an honest row around the mean, so the colluders neither coincide nor sit
  suspiciously close to the centre). ``J`` is drawn once per round, before the search: the
  rows checked are the rows sent.
- ``jitter=own`` and ``jitter=typical`` (default): no noise, each colluder bends a real update ``o_i``
  instead, its own honest update (``own``, ``Context.own``) or, for ``typical``, one of the
  ``f`` honest rows least suspicious on their worst detector (each row of ``H`` ranked by
  every detector's score of ``H`` alone, its highest rank kept; the ``f`` lowest, ties to the
  first row, cycling if ``f > |H|``). With ``D_i = o_i - mean(H)``, ``P D_i = <D_i, u> u`` its
  part along the honest mean and ``Q D_i = D_i - P D_i`` the rest,
  ``B_i(s) = mean(H) + P D_i + (r(s) - mean(H)) + lam_i Q D_i``, ``lam_i >= 0`` the root of
  ``||B_i(s) - mean(H)|| = ||D_i||`` (when there is none, the ``lam_i >= 0`` that comes closest,
  ``max(0, -<a_i, Q D_i> / ||Q D_i||^2)`` with ``a_i = P D_i + r(s) - mean(H)``; ``lam_i = 1`` where
  ``r = mean(H)``, so ``B_i(0) = o_i`` for ``grad``, to rounding). A row keeps the distance of a real
  update to the honest mean and, for a push orthogonal to ``u`` (``grad``), its component
  along ``u``, hence its length and its cosine to the mean; the part ``lam_i Q D_i`` it keeps
  carries the honest rows' covariance (their spectral, cosine and Krum scores), where
  isotropic noise makes every row longer than an honest one. ``spread`` does not apply.
  ``typical`` hides better than ``own``: on some seeds the colluders' own updates already rank
  above the honest ones (their data are unusual), and a real row that is one detector's
  outlier fails ``quantile`` alone.

A row *passes* a detector when its score (the deployment's detectors, ``Context.detectors``, on ``[H; B(s)]``;
scores are per row and permutation-equivariant, so the engine's order does not matter) is at
most that candidate round's threshold, the ``quantile`` (default 1: the most suspicious
honest row; linear interpolation) of the honest rows' scores, and the rows together pass it
when, besides, the round's AUC of
that detector (the share of (crafted, honest) pairs where the crafted row scores higher, ties
counting half, as ``evaluation.reports.metrics.roc_auc``) is at most ``auc`` (default 0.7; 1: no bound).
A row's share in a round's AUC is the share of honest rows it outranks, so ``quantile`` bounds
(about) every chosen detector's AUC in the rounds the rows hide, and ``auc`` bounds it exactly.
``policy`` is the coordinator's per-round flag rule (``Context.flagged``: no crafted
row flagged); ``all`` asks every detector the deployment has but ``discarded``, and the policy;
``geometric`` the same but the ``loss-score`` (where the coordinator holds a root set): the
attacker who does not model what its rows do to the coordinator's held-out data.
The detectors come through the Context (attacks do not import the round engine), so a
detector's name is checked against them in the first round.

The strength is the largest ``s`` in ``[0, max]`` whose rows all pass every chosen detector,
found by ``steps`` bisection steps: ``max`` if it passes; else ``lo = 0, hi = max`` and
``mid = (lo + hi) / 2`` replaces ``lo`` if it passes, ``hi`` if not, so the rows of
``lo + max / 2^steps`` fail. Bisection assumes the rows cross the threshold once on the way
from 0 to ``max``. If even strength 0 fails, no row of the direction hides this round and the
colluders lie low: they send their own honest updates (``Context.own``). The chosen strength
(``None`` when lying low) is kept in ``last_strength``.

``grad`` remembers the honest mean of the rounds it crafted (the attack object lives for a
run; a call in the same round again gives the same rows).

Against ``mean`` defended only by the detectors, on the quick scenario (digits, 25 nodes of
which 5 Byzantine, 50 rounds, worker momentum), ``evade:detector=all,dir=grad,jitter=typical,
auc=0.7,quantile=1`` costs 19.2 pp of accuracy (seeds 0 and 1; 16.8 pp over seeds 0 to 3)
with every detector's AUC <= 0.57 (median-cosine; 0.59 over seeds 0 to 3), and ``auc=0.6``
11.5 pp at AUCs <= 0.54. The direction does it: ``sign`` and ``alie`` with the same rows cost
1.2 and 0.1 pp, ``grad`` with the Gaussian jitter 20 pp at a spectral AUC of 0.86.

The defaults (``detector=all,dir=grad,jitter=typical,auc=0.7,quantile=1``) are that strongest
measured setting, chosen on the quick scenario and the stealth grid
(``evaluation/scenarios/stealth.toml``: the worst attack for 8 of its 10 defences, never
quarantined); ``evade:detector=all`` alone plays it. The earlier defaults (``dir=alie,
jitter=gauss,quantile=0.95,auc=1``) cost 0.6 pp against ``mean`` and were seen (best
detector AUC 0.89).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from robust.constraints import Interval, OneOf, Param, Spec

from .alie import alie_rows
from .base import Context, OmniscientAttack, honest_std, register, spread_param, unit
from .ipm import ipm_rows

POLICY = "policy"
UNSCORED = "discarded"  # the rule's choice, not a score of the row
GEOMETRIC, LOSS = "geometric", "loss-score"  # every detector but the one that measures what a row does
PLAIN = "to-median"  # the flag policy's plain distance, ranked as distance-ratio ranks it: no detector
JITTERS = ("gauss", "own", "typical")


def sign_rows(H: torch.Tensor) -> Callable[[float], torch.Tensor]:
    """``s -> mean(H) - s sign(mean(H)) std(H)``, with the moments computed once."""
    mean = H.mean(dim=0)
    push = torch.sign(mean) * honest_std(H)
    return lambda s: mean - s * push


def grad_rows(H: torch.Tensor, before: torch.Tensor | None) -> Callable[[float], torch.Tensor]:
    """``s -> mean(H) + s ||std(H)|| unit(Q before)``, ``Q`` the projection orthogonal to
    ``mean(H)`` and ``before`` the previous round's honest mean (``None``: ``s -> mean(H)``)."""
    mean = H.mean(dim=0)
    if before is None:
        return lambda s: mean
    u = unit(mean)
    push = honest_std(H).norm() * unit(before - (before @ u) * u)
    return lambda s: mean + s * push


DIRECTIONS: dict[str, Callable[[torch.Tensor], Callable[[float], torch.Tensor]]] = {
    "alie": alie_rows, "ipm": ipm_rows, "sign": sign_rows,
}
REMEMBERING = ("grad",)  # directions built from the previous round too (see grad_rows)


def bend(mean: torch.Tensor, D: torch.Tensor, push: torch.Tensor) -> torch.Tensor:
    """``jitter=own|typical``: ``mean + P D_i + push + lam_i Q D_i`` per row of ``D`` (``(f, d)``), with
    ``P`` the projection on ``unit(mean)``, ``Q = I - P`` and ``lam_i >= 0`` the root of
    ``||P D_i + push + lam_i Q D_i|| = ||D_i||`` (if there is none, the ``lam_i >= 0`` that comes
    closest: ``max(0, -<a_i, b_i> / ||b_i||^2)``, ``a_i = P D_i + push``, ``b_i = Q D_i``)."""
    u = unit(mean)
    a = (D @ u)[:, None] * u + push  # P D_i + push
    b = D - (D @ u)[:, None] * u  # Q D_i
    bb, ab = b.square().sum(dim=1), (a * b).sum(dim=1)
    excess = a.square().sum(dim=1) - D.square().sum(dim=1)  # ||a||^2 - ||D||^2
    root = (ab.square() - bb * excess).clamp_min(0).sqrt()
    lam = torch.where(bb > 0, (root - ab) / bb.clamp_min(torch.finfo(bb.dtype).tiny), torch.zeros_like(bb))
    return mean + a + lam.clamp_min(0)[:, None] * b


def scored(detector: str) -> None:
    """Refuse ``discarded``: the rule's choice, not a score (the other names are checked
    against the deployment's detectors in the first round)."""
    if detector == UNSCORED:
        raise ValueError(f"{UNSCORED} is the rule's choice, not a score: name a detector, policy, geometric or all")


@register
class Evade(OmniscientAttack):
    name = "evade"
    jitters_in_craft = True
    params = (
        Param("detector", Spec(scored, "a detector's name (but discarded), policy, geometric or all"), "all",
              "what the rows hide from: one detector, the flag policy, or every detector (geometric: but the "
              "loss score) and the policy"),
        Param("dir", OneOf((*DIRECTIONS, *REMEMBERING)), "grad", "the direction the rows are pushed along"),
        Param("steps", Interval(int, 1, None), 12, "bisection steps on the strength"),
        Param("max", Interval(float, 0, None, "neither"), 10.0, "strengths are searched in [0, max]"),
        Param("quantile", Interval(float, 0, 1, "right"), 1.0, "the honest scores' quantile to stay under"),
        Param("auc", Interval(float, 0, 1, "right"), 0.7, "the round AUC each chosen detector may reach"),
        Param("jitter", OneOf(JITTERS), "typical", "how the rows differ: gauss, spread's seeded noise; own, the "
              "colluders' own updates bent; typical, the least suspicious honest rows bent"),
        spread_param(1.0),
    )

    def __init__(self, f: int, **params: object) -> None:
        super().__init__(f, **params)
        self.policy = self.detector in (POLICY, GEOMETRIC, "all")
        self.last_strength: float | None = None
        self.means: dict[int, torch.Tensor] = {}  # round -> honest mean (dir=grad), the last two rounds

    def direction(self, H: torch.Tensor, ctx: Context) -> Callable[[float], torch.Tensor]:
        """``s -> r(s)`` for this round (``grad`` remembers this round's honest mean)."""
        if self.dir not in REMEMBERING:
            return DIRECTIONS[self.dir](H)
        before = self.means.get(ctx.round - 1)
        if before is not None and before.shape != H.shape[1:]:
            before = None
        self.means = {r: m for r, m in self.means.items() if r == ctx.round - 1}
        self.means[ctx.round] = H.mean(dim=0)
        return grad_rows(H, before)

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        if ctx.detectors is None or (self.policy and ctx.flagged is None):
            raise ValueError(f"evade detector={self.detector} hides from the deployment's detectors and flag policy: "
                             "pass them in the Context (detectors, flagged)")
        if ctx.own is None:
            raise ValueError("evade lies low with the colluders' own updates when nothing hides: pass Context.own")
        row, h = self.direction(H, ctx), H.shape[0]
        if self.jitter != "gauss":
            mean = H.mean(dim=0)
            D = self.bases(H, ctx) - mean
            rows = lambda s: bend(mean, D, row(s) - mean)  # noqa: E731
        else:
            jitter = self.jitter_rows(H, ctx)
            rows = lambda s: row(s) + jitter  # noqa: E731
        X = torch.empty((h + self.f, H.shape[1]), dtype=H.dtype, device=H.device)
        X[:h] = H  # the one copy of H: a candidate only rewrites the Byzantine rows
        X[h:] = rows(0.0)
        names = self.names(ctx.detectors(X))

        def passes(s: float) -> bool:
            X[h:] = rows(s)
            scores = ctx.detectors(X)
            if self.policy and bool(ctx.flagged(scores)[h:].any()):
                return False
            return all(self.below(scores[name], h) for name in names)

        self.last_strength = self.strength(passes)
        return ctx.own if self.last_strength is None else rows(self.last_strength)

    def bases(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The ``(f, d)`` rows ``jitter=own|typical`` bends: the colluders' own updates, or the
        ``f`` honest rows least suspicious on their worst detector (the module docstring)."""
        if self.jitter == "own":
            return ctx.own.to(H.dtype)
        scores = ctx.detectors(H)
        seen = [k for k in sorted(scores) if k != PLAIN and not (self.detector == GEOMETRIC and k == LOSS)]
        worst = torch.stack([scores[k].argsort(stable=True).argsort() for k in seen]).amax(dim=0)
        order = worst.argsort(stable=True)
        return H[order[torch.arange(self.f) % H.shape[0]]]

    def names(self, scores: dict[str, torch.Tensor]) -> list[str]:
        """The detectors this attack hides from, among the deployment's ``scores``."""
        known = sorted(k for k in scores if k not in (UNSCORED, PLAIN))
        if self.detector == "all":
            return known
        if self.detector == GEOMETRIC:
            return [k for k in known if k != LOSS]
        if self.detector == POLICY:
            return []
        if self.detector not in known:
            raise ValueError(f"evade detector must be one of {', '.join(known)}, policy, geometric or all "
                             f"(got detector={self.detector!r})")
        return [self.detector]

    def below(self, score: torch.Tensor, h: int) -> bool:
        """Whether every crafted row's ``score`` (rows ``h:``) is at most the honest rows' ``quantile``
        and the crafted rows' AUC against the honest ones at most ``auc``."""
        crafted, honest = score[h:], score[:h]
        if not bool((crafted <= torch.quantile(honest, self.quantile)).all()):
            return False
        if self.auc >= 1:
            return True
        above = (crafted[:, None] > honest[None, :]).sum() + 0.5 * (crafted[:, None] == honest[None, :]).sum()
        return float(above) <= self.auc * crafted.numel() * honest.numel()

    def strength(self, passes: Callable[[float], bool]) -> float | None:
        """The module docstring's bisection: the largest passing strength it finds, ``None``
        if strength 0 fails."""
        if not passes(0.0):
            return None
        if passes(self.max):
            return self.max
        lo, hi = 0.0, self.max
        for _ in range(self.steps):
            mid = (lo + hi) / 2
            if passes(mid):
                lo = mid
            else:
                hi = mid
        return lo
