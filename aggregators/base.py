"""What every aggregation rule and pre-aggregator shares: parameters, checks, the registry.

A *rule* maps a round's updates ``X`` of shape ``(n, d)`` to one ``(d,)`` aggregate; a
*pre-aggregator* maps ``X`` to new ``(n', d)`` rows handed to the next link of the chain.
Both read the rows as a source (``robust.source.Rows``: a tensor in memory or rows spooled on
disk) in column blocks: one rule, two kinds of source, the same bits from either.
Both are built from a spec component and declare their parameters as data (``params``:
``robust.registry``); the number of rows they can serve is checked before any work is done.

Some rules need more than the rows (:class:`RoundInputs`): they name the fields in ``needs``
and take ``aggregate(X, inputs)``; the chain checks the fields are given before any work.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from robust.constraints import Interval, Param
from robust.row_keeper import Keeper
from robust.registry import Component, Registry
from robust.rowstore import RowStore
from robust.source import Rows, as_rows

REGISTRY: Registry[Stage] = Registry("aggregator")
register = REGISTRY.register

SEED = Param("seed", Interval(int, 0, None), 0, "seeds the stage's random draws (with the rows' content)")


@dataclass(frozen=True)
class RoundInputs:
    """What some rules need besides the rows: each rule names the fields it reads in
    ``Stage.needs``; the others ignore them.

    ``ids``: the node id of each row of ``X``, same order as ``X`` (rules that follow a node
    across rounds key their state by it). ``w``: the flat global model ``(d,)`` the rows were
    computed from. ``reference``: the server's own update ``(d,)`` on its root data, with the
    same meaning (protocol, sign, scale) as a row (FLTrust). ``ratings``: each row's node's
    rating ``(n,)`` by what its updates did to the loss of the root data, higher is better
    (``nodes.engine.loss_ratings``).
    """

    ids: tuple[str, ...] | None = None
    w: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    ratings: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ids is not None and not isinstance(self.ids, tuple):
            if isinstance(self.ids, str) or not hasattr(self.ids, "__iter__"):
                raise ValueError(f"ids must be a sequence of node ids, one per row (got {type(self.ids).__name__})")
            object.__setattr__(self, "ids", tuple(self.ids))

    def to(self, device: torch.device | str) -> RoundInputs:
        """These inputs with ``w``, ``reference`` and ``ratings`` on ``device`` (a rule reads
        them beside its rows, on the rows' device)."""
        move = lambda v: v if v is None or not isinstance(v, torch.Tensor) else v.to(device)  # noqa: E731
        return replace(self, w=move(self.w), reference=move(self.reference), ratings=move(self.ratings))


# what each field is, for the error that asks for it
NEEDED = {
    "ids": "the node id of each row",
    "w": "the flat global model (d,) the rows were computed from",
    "reference": "the server's own update (d,) on its root data",
    "ratings": "each row's node's loss-score rating (n,)",
}
ROOT_NEEDS = frozenset({"reference", "ratings"})  # what the coordinator computes from the root data it holds
PER_NODE = frozenset({"ids", "ratings"})  # one value per node, which rows mixed by a pre-aggregator no longer have


def check_inputs(name: str, needs: frozenset[str], inputs: RoundInputs | None, n: int, d: int) -> None:
    """Raise ``ValueError`` unless every field in ``needs`` is given and well formed: ``ids``
    (checked whenever given) one distinct string per row, ``w`` and ``reference`` finite
    ``(d,)`` float tensors."""
    inputs = inputs if inputs is not None else RoundInputs()
    missing = [k for k in sorted(needs) if getattr(inputs, k) is None]
    if missing:
        what = " and ".join(NEEDED[k] for k in missing)
        given = ", ".join(f"{k}=..." for k in missing)
        raise ValueError(f"{name} needs {what}: call the chain with RoundInputs({given})")
    if inputs.ids is not None:
        ids = inputs.ids
        if len(ids) != n:
            raise ValueError(f"ids has {len(ids)} entries for n={n} rows: pass one node id per row, in the rows' order")
        odd = [type(i).__name__ for i in ids if not isinstance(i, str)]
        if odd:
            raise ValueError(f"ids must be strings (got {odd[0]}): pass each node's id as a str")
        if len(set(ids)) != n:
            repeated = sorted(k for k, c in Counter(ids).items() if c > 1)
            raise ValueError(f"ids repeats {', '.join(map(repr, repeated))}: each row must come from a different node")
    for key in sorted(needs & {"w", "reference"}):
        check_vector(name, key, getattr(inputs, key), d)
    if "ratings" in needs:
        check_vector(name, "ratings", inputs.ratings, n, "n")


def check_vector(name: str, key: str, v: object, d: int, axis: str = "d") -> None:
    """Raise ``ValueError`` unless ``v`` is a finite float32/float64 tensor of shape ``(d,)``
    (``axis``: the rows' dimension it runs along, ``d`` or ``n``)."""
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"{name}: {key} must be a torch.Tensor of shape ({axis},) (got {type(v).__name__})")
    if tuple(v.shape) != (d,):
        raise ValueError(f"{name}: {key} has shape {tuple(v.shape)}, the rows have {axis}={d}")
    if v.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name}: {key} must be float32 or float64 (got {v.dtype})")
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name}: {key} contains NaN or Inf")


class Stage(Component):
    """Base of rules and pre-aggregators; ``f`` is the number of Byzantine rows tolerated.
    ``needs`` names the :class:`RoundInputs` fields the stage reads (pre-aggregators: none)."""

    is_rule: ClassVar[bool]
    needs: ClassVar[frozenset[str]] = frozenset()
    uses_f: ClassVar[bool] = True  # whether its output depends on f (False: f only bounds the n it serves)
    keeper: Keeper | None = None  # where a stage that carries (d,) rows across calls keeps them (robust.row_keeper)

    def check_n(self, n: int) -> None:
        """Raise ``ValueError`` if this stage cannot serve ``n`` rows with its ``f``."""

    def state(self) -> dict[str, torch.Tensor]:
        """What this stage carries from one call to the next (checkpointed with the model)."""
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state` returned."""

    def spill(self, store: RowStore) -> None:
        """Keep the ``(d,)`` rows this stage carries across calls in ``store`` from now on (the
        rows it holds are written there); a stage without a ``keeper`` carries none."""
        if self.keeper is not None:
            state = self.state()
            self.keeper.spill(store)
            self.load_state(state)

    def kept_rows(self, nodes: int) -> int:
        """The most ``(d,)`` rows its keeper holds at once (old and new while a call runs) for
        ``nodes`` nodes."""
        return 0

    def _require(self, ok: bool, formula: str, n: int) -> None:
        if not ok:
            raise ValueError(
                f"{self.name} needs n {formula} (got n={n}, f={self.f}): lower f or add nodes"
            )


class Rule(Stage):
    """A final aggregation rule: ``(n, d) -> (d,)``.

    Rules that select rows (Krum, Multi-Krum, Bulyan, MDA, CAF) record in ``last_kept`` which
    rows of their last input they used (bool ``(n,)``), so detectors can score "discarded".
    A rule with ``needs`` implements ``aggregate(X, inputs)`` (a :class:`RoundInputs`, its
    fields checked by the chain); the others ``aggregate(X)``.
    """

    is_rule = True
    last_kept: torch.Tensor | None = None

    def aggregate(self, X: Rows) -> torch.Tensor:
        raise NotImplementedError


class PreAggregator(Stage):
    """A transformation applied before the rule: ``(n, d) -> (rows(n), d)``, same ``f``.
    Its output is a lazy source (``robust.source.Transformed``): a block of it is computed
    when the next stage reads it, so a chain holds no intermediate ``(n, d)`` matrix."""

    is_rule = False
    keeps_rows: ClassVar[bool] = True  # output row i still stands for input row i alone

    def rows(self, n: int) -> int:
        """How many rows this stage outputs for ``n`` input rows."""
        return n

    def transform(self, X: torch.Tensor | Rows) -> torch.Tensor | Rows:
        """The transformed rows: a tensor for a tensor, a lazy source for a source."""
        out = self.transformed(as_rows(X))
        return out.tensor() if isinstance(X, torch.Tensor) else out

    def transformed(self, X: Rows) -> Rows:
        """The transformed rows of the source ``X``, as a lazy source (what the chain calls)."""
        raise NotImplementedError


def check_updates(X: torch.Tensor | Rows) -> None:
    """Raise ``ValueError`` unless ``X`` is a finite float32/float64 matrix with n, d >= 1
    (a source marked ``validated`` is not read again)."""
    if not isinstance(X, (torch.Tensor, Rows)):
        raise ValueError(f"updates must be a torch.Tensor of shape (n, d) (got {type(X).__name__})")
    if len(X.shape) != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"updates must have shape (n, d) with n, d >= 1 (got {tuple(X.shape)})")
    if X.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"updates must be float32 or float64 (got {X.dtype}): convert with X.float()")
    if isinstance(X, Rows):
        if X.validated:
            return
        finite = torch.ones(X.n, dtype=torch.bool, device=X.device)
        for _, block in X.blocks():
            finite &= torch.isfinite(block).all(dim=1)
        bad = (~finite).nonzero().flatten().tolist()
    else:
        # A row sum is finite only if the row is (inf and nan propagate); it may also overflow
        # for finite huge values, so only the rows it flags are checked exactly.
        suspects = (~torch.isfinite(X.sum(dim=1))).nonzero().flatten().tolist()
        bad = [i for i in suspects if not bool(torch.isfinite(X[i]).all())]
    if bad:
        raise ValueError(f"rows {bad} contain NaN or Inf: reject those updates before aggregation")
