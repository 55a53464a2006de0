"""FLDetector (Zhang, Cao, Jia & Gong, KDD 2022, "FLDetector: defending federated learning
against model poisoning attacks via detecting malicious clients").

An honest node's row moves with the model: ``x_i^t ~ x_i^{t-1} + H_t (w_t - w_{t-1})``. The
Hessian-vector product is estimated by L-BFGS from the rule's own last ``m <= window`` pairs
``s_k = w_k - w_{k-1}`` (``RoundInputs.w``) and ``y_k = F_k - F_{k-1}`` (its own outputs), in the
compact form of the paper's Algorithm 1 and its reference code, with ``v = w_t - w_{t-1}``:

    sigma = y_m.s_m / s_m.s_m,   S^T Y = L + R (L strictly lower),   D = diag(S^T Y)
    H v = sigma v - [sigma S, Y] [[sigma S^T S, L], [L^T, -D]]^+ [sigma S^T v; Y^T v]

(one float64 ``(2m+1)^2`` Gram over column blocks, O(m^2 d); the pseudo-inverse copes with
dependent pairs). Rows are linear in the gradient whatever the protocol's sign and scale
(``delta`` rows are about ``-lr K g``), so the pairs estimate the Hessian in the rows' own units
and the prediction needs no conversion. Each scored node's suspicion this round is
``d_i = ||x_i^{t-1} + H v - x_i^t|| / sum_j ||...||`` (the sum over the nodes scored this
round, the paper's normalisation) and ``s_i`` the mean of its last ``window`` values.

Detection, on the present nodes with ``window`` values of ``s`` (at least 3: the gap statistic
of 2 values is undefined): ``s`` is min-max normalised and the gap statistic (Tibshirani et al.
2001, as the reference code: ``B = 10`` uniform reference draws) picks the smallest ``k`` with
``Gap(k) >= Gap(k+1) - sd_{k+1}``; that ``k`` is 1 (no attack) iff ``Gap(1) >= Gap(2) - sd_2``,
so only ``k = 1, 2`` are computed. In one dimension the best 2-means is a split of the sorted
values, found exactly from prefix sums (the reference's k-means, without its random starts);
the reference draws come from a generator seeded with ``seed`` and the candidates' ids and
scores. With 2 clusters, the one of larger mean score is excluded this round. ``F`` is the
coordinate-wise median of the kept rows (the paper's; ``base=mean``: their mean).
``last_kept``: the rows not excluded. The paper then removes the detected nodes for good and
restarts from an earlier model: that is the flag policy's job, not the rule's.

Before enough history nothing is excluded: the first call scores nobody, a pair needs the
previous ``w`` and output (a call that leaves ``w`` unchanged adds none), a node is scored only
if it sent a row in the previous call (an absent node's stored row is dropped: an older row is
not predicted by this round's move; its score window is kept), and it is a candidate once it
has ``window`` scores. Decisions are computed on the rows sorted by node id, so they are exactly
order-invariant. A call reads the pairs once for their Gram matrix, then the rows once to keep
them (for the next call) and score them, and once more to aggregate.

Memory: ``2 window`` pair vectors, one row per node of the last call, in the rows' dtype, and
the last ``w`` and output. After ``spill(store)`` (``robust.rowstore``) every one of these
``(d,)`` vectors is a row on disk, written block by block: memory is then ``n x BLOCK`` per
source read, and the disk holds up to ``2 nodes + 2 window + 6`` rows (old and new until the
owner collects). State: ``"w"``, ``"aggregate"``, ``"pairs.s"``, ``"pairs.y"`` (oldest first),
``"row.<id>"``: the rows, or with a store their 32-byte references; ``"scores.<id>"``. Needs
``n >= 2f + 1`` with the median.
"""

from __future__ import annotations

import hashlib

import torch

from robust.constraints import Interval, OneOf, Param
from robust.geometry import weighted_sum
from robust.row_keeper import Handle, Joined, Keeper, lockstep, rows_of
from robust.seeds import generator
from robust.source import Memory, Rows

from ._columns import median_of_sorted, reduce_sorted_columns
from ._filtering import F64
from .base import SEED, RoundInputs, Rule, register

BASES = ("median", "mean")


def push(old: torch.Tensor | None, new: torch.Tensor, keep: int) -> torch.Tensor:
    """``old`` (stacked along dim 0, oldest first) with ``new`` appended, the last ``keep``
    entries only; always a new tensor (a ``state()`` handed out is never modified)."""
    if old is None:
        return new[None].clone()
    return torch.cat([old[max(0, old.shape[0] - keep + 1) :], new[None]])


def pairs_and_step(S: Rows, Y: Rows, w: torch.Tensor, prev: Rows) -> Joined:
    """The float64 rows ``[S; Y; v]`` (``(2m + 1, d)``, computed block by block) of the pairs
    ``S``, ``Y`` (``(m, d)``, oldest first) and the step ``v = w - prev`` (``prev``: one row)."""
    def block(_: int, parts: list[torch.Tensor]) -> torch.Tensor:
        s, y, now, before = parts
        return torch.cat([s.to(F64), y.to(F64), now.to(F64) - before.to(F64)])

    return Joined([S, Y, Memory(w[None]), prev], block, n=2 * S.n + 1, dtype=F64)


def hessian_coefficients(Z: Rows) -> torch.Tensor | None:
    """The L-BFGS compact-form estimate of ``H v`` as coefficients ``c`` (float64 ``(2m + 1,)``)
    of ``Z = [S; Y; v]`` (:func:`pairs_and_step`): ``H v = c @ Z``; ``None``: no estimate (an
    overflow, a vanishing step, or a pseudo-inverse that did not converge). One pass."""
    m = (Z.n - 1) // 2
    gram = torch.zeros(Z.n, Z.n, dtype=F64, device=Z.device)
    for _, block in Z.blocks():
        gram += block @ block.T
    gram = 0.5 * (gram + gram.T)
    SS, SY = gram[:m, :m], gram[:m, m : 2 * m]
    sigma = SY[-1, -1] / SS[-1, -1]
    L = SY.tril(-1)
    M = torch.cat([torch.cat([sigma * SS, L], 1), torch.cat([L.T, -torch.diag(SY.diagonal())], 1)])
    if not bool(torch.isfinite(M).all()):  # overflow or a vanishing step: no estimate this round
        return None
    try:
        q = torch.linalg.pinv(M, hermitian=True) @ torch.cat([sigma * gram[:m, -1], gram[m : 2 * m, -1]])
    except torch.linalg.LinAlgError:  # eigh did not converge: no estimate this round
        return None
    return torch.cat([-sigma * q[:m], -q[m:], sigma.reshape(1)])


def two_means(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of ``z`` ``(B, m)``, sorted, ``m >= 2``: the least within-cluster sum of
    squares of a split into two runs, and the size of the left run (ties: the smallest)."""
    m = z.shape[1]
    z = z - z.mean(dim=1, keepdim=True)  # the sums of squares below cancel less
    c1, c2 = z.cumsum(1), z.square().cumsum(1)
    k = torch.arange(1, m, dtype=F64, device=z.device)
    left = c2[:, :-1] - c1[:, :-1].square() / k
    right = (c2[:, -1:] - c2[:, :-1]) - (c1[:, -1:] - c1[:, :-1]).square() / (m - k)
    sse = (left + right).clamp_min(0.0)
    best = sse.argmin(dim=1)
    return sse.gather(1, best[:, None])[:, 0], best + 1


def two_clusters(s: torch.Tensor, gen: torch.Generator, refs: int = 10) -> int:
    """0 if the gap statistic picks one cluster for the values ``s`` (``m >= 3``), else the
    number of values (in sorted order) of the lower of the two. Computed on the CPU, wherever
    ``s`` is (a few values per node): CUDA has no deterministic float ``cumsum``."""
    s = s.cpu()
    lo, hi = s.min(), s.max()
    if hi == lo:
        return 0
    z = ((s - lo) / (hi - lo)).sort().values[None]
    ref = torch.rand(refs, s.shape[0], generator=gen, dtype=F64, device="cpu").sort(dim=1).values
    sse1 = lambda t: (t - t.mean(dim=1, keepdim=True)).square().sum(dim=1)  # noqa: E731
    (w2, split), (r2, _) = two_means(z), two_means(ref)
    gap1 = torch.log(sse1(ref).mean()) - torch.log(sse1(z)[0])
    gap2 = torch.log(r2.mean()) - torch.log(w2[0])  # +inf when the data split exactly
    sd2 = (1.0 + 1.0 / refs) ** 0.5 * torch.log(r2).std(correction=0)
    return int(split[0]) if bool(gap1 < gap2 - sd2) else 0


@register
class FLDetector(Rule):
    name = "fldetector"
    uses_f = False
    needs = frozenset({"ids", "w"})

    params = (
        Param("window", Interval(int, 1, None), 10, "how many rounds of history are used", tune=True),
        Param("base", OneOf(BASES), "median", "the rule run on the rows it keeps"),
        SEED,
    )

    def __init__(self, f: int, **params: object) -> None:
        super().__init__(f, **params)
        self.keeper = Keeper()
        self.reset()

    def check_n(self, n: int) -> None:
        if self.base == "median":
            self._require(n >= 2 * self.f + 1, ">= 2f + 1", n)

    def kept_rows(self, nodes: int) -> int:
        return 2 * nodes + 2 * self.window + 6

    def reset(self) -> None:
        """Forget all history: the next call is a first call."""
        self.w: Handle | None = None
        self.out: Handle | None = None
        self.S: list[Handle] = []
        self.Y: list[Handle] = []
        self.rows: dict[str, Handle] = {}
        self.scores: dict[str, torch.Tensor] = {}

    def state(self) -> dict[str, torch.Tensor]:
        keep = self.keeper.state
        state = {k: keep(v) for k, v in (("w", self.w), ("aggregate", self.out)) if v is not None}
        if self.S:
            state["pairs.s"], state["pairs.y"] = (torch.stack([keep(v) for v in vs]) for vs in (self.S, self.Y))
        state.update({f"row.{k}": keep(v) for k, v in self.rows.items()})
        state.update({f"scores.{k}": v for k, v in self.scores.items()})
        return state

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.reset()
        load = self.keeper.load
        self.w, self.out = (None if k not in state else load(state[k]) for k in ("w", "aggregate"))
        self.S, self.Y = ([load(v) for v in state.get(k, ())] for k in ("pairs.s", "pairs.y"))
        self.rows = {k[4:]: load(v) for k, v in state.items() if k.startswith("row.")}
        self.scores = {k[7:]: v for k, v in state.items() if k.startswith("scores.")}

    def aggregate(self, X: Rows, inputs: RoundInputs) -> torch.Tensor:
        n, d = X.shape
        ids = inputs.ids
        if self.w is not None and self.keeper.size(self.w)[0] != d:
            raise ValueError(
                f"fldetector last saw d={self.keeper.size(self.w)[0]} coordinates, now d={d}: "
                "build a new aggregator (or reset()) for a new model"
            )
        order = sorted(range(n), key=ids.__getitem__)
        w = inputs.w.detach()
        prev = None if self.w is None else self.keeper.source([self.w], X.device)
        self.rows = self._keep_and_score(X, ids, order, w, prev)
        kept = torch.ones(n, dtype=torch.bool, device=X.device)
        full = [i for i in order if ids[i] in self.scores and self.scores[ids[i]].numel() == self.window]
        if len(full) >= 3:
            s = torch.stack([self.scores[ids[i]].mean() for i in full])
            digest = hashlib.sha256(repr([ids[i] for i in full]).encode() + s.cpu().numpy().tobytes()).hexdigest()
            lower = two_clusters(s, generator("aggregator", self.name, self.seed, digest))
            if lower:
                ranked = torch.sort(s, stable=True).indices.tolist()
                kept[[full[j] for j in ranked[lower:]]] = False
        self.last_kept = kept
        selected = None if bool(kept.all()) else kept.nonzero().flatten()
        if self.base == "median":
            out = reduce_sorted_columns(X, median_of_sorted, selected)
        else:
            out = weighted_sum(X, kept.to(F64) / int(kept.sum()))
        if prev is not None and self.out is not None and moved(w, prev):
            s_new, y_new = self._pair(w, prev, out)
            self.S, self.Y = (self.S + [s_new])[-self.window :], (self.Y + [y_new])[-self.window :]
        self.w, self.out = self.keeper.keep(w), self.keeper.keep(out)
        return out

    def _keep_and_score(self, X: Rows, ids: tuple[str, ...], order: list[int], w: torch.Tensor,
                        prev: Rows | None) -> dict[str, Handle]:
        """Keep this call's rows (the rows of absent nodes are dropped) and append to each node
        scored this call (one that sent a row in the last call too) its normalised prediction
        error ``||x_i^{t-1} + H v - x_i^t||``: one pass over ``X``, the last rows and the pairs."""
        scored = [i for i in order if ids[i] in self.rows] if prev is not None and self.S else []
        Z = pairs_and_step(*(self.keeper.source(p, X.device) for p in (self.S, self.Y)), w, prev) if scored else None
        coef = None if Z is None else hessian_coefficients(Z)
        extra = [] if coef is None else [self.keeper.source([self.rows[ids[i]] for i in scored], X.device), Z]
        sq = torch.zeros(len(scored), dtype=F64, device=X.device)
        finite = torch.ones((), dtype=torch.bool, device=X.device)
        with self.keeper.writing(len(order), X.d, X.dtype, X.device) as new:
            for _, (block, *more) in lockstep(X, *extra):
                new.add(rows_of(block, order))
                if more:
                    error, hv = more[0].to(F64), coef @ more[1]
                    finite &= torch.isfinite(hv).all()
                    error += hv
                    error -= rows_of(block, scored).to(F64)
                    sq += error.square().sum(dim=1)
        if coef is not None and bool(finite):
            self._score([ids[i] for i in scored], sq)
        return {ids[i]: h for i, h in zip(order, new.handles)}

    def _score(self, nodes: list[str], sq: torch.Tensor) -> None:
        """Append each node's share of the prediction errors (``sq``: their squares) to its window."""
        dist = torch.nan_to_num(sq.sqrt(), nan=torch.finfo(F64).max, posinf=torch.finfo(F64).max)
        top = dist.max()
        dist = dist / top if top > 0 else dist  # first by the max: the sum cannot overflow
        total = dist.sum()
        dist = dist / total if total > 0 else dist
        for j, node in enumerate(nodes):
            self.scores[node] = push(self.scores.get(node), dist[j], self.window)

    def _pair(self, w: torch.Tensor, prev: Rows, out: torch.Tensor) -> list[Handle]:
        """The new pair ``s = w - w_prev``, ``y = F - F_prev`` (float64 differences, in the
        rows' dtype), written block by block."""
        with self.keeper.writing(2, out.shape[0], out.dtype, out.device) as new:
            for _, (now, before, F, F_prev) in lockstep(Memory(w[None]), prev, Memory(out[None]),
                                                        self.keeper.source([self.out], out.device)):
                new.add(torch.cat([now.to(F64) - before.to(F64), F.to(F64) - F_prev.to(F64)]).to(out.dtype))
        return new.handles


def moved(w: torch.Tensor, prev: Rows) -> bool:
    """Whether ``w - prev`` (float64) has a nonzero value (a call that leaves ``w`` unchanged adds no pair)."""
    return any(bool((now.to(F64) - before.to(F64) != 0).any()) for _, (now, before) in lockstep(Memory(w[None]), prev))
