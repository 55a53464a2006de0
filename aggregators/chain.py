"""A spec chain: pre-aggregators applied in order, then one rule."""

from __future__ import annotations

import torch

from robust.rowstore import RowStore
from robust.source import Rows, as_rows
from robust.spec import format_spec, parse

from .base import PER_NODE, REGISTRY, PreAggregator, Rule, RoundInputs, Stage, check_inputs, check_updates


class Chain:
    """``agg(X)`` or ``agg(X, RoundInputs(...))``: ``X`` of shape ``(n, d)`` -> aggregate of
    shape ``(d,)``, same dtype/device. ``X`` is a tensor or a source (``robust.source.Rows``,
    e.g. rows spooled on disk); both give the same bits.

    Built by :func:`aggregators.build`. The input is validated (finite float matrix), the row
    count is checked against every stage and the :class:`RoundInputs` fields the rule
    ``needs`` against the rows before any work; the input is never modified. Only the rule
    reads ``inputs``; rules that need none ignore them.
    """

    def __init__(self, stages: list[Stage], spec: str) -> None:
        self.stages = stages
        self.spec = spec
        self.f = stages[-1].f

    @property
    def pre(self) -> list[PreAggregator]:
        return self.stages[:-1]  # type: ignore[return-value]

    @property
    def rule(self) -> Rule:
        return self.stages[-1]  # type: ignore[return-value]

    @property
    def uses_f(self) -> bool:
        """Whether the chain's output depends on ``f`` (a stage's does)."""
        return any(stage.uses_f for stage in self.stages)

    @property
    def needs(self) -> frozenset[str]:
        """The :class:`RoundInputs` fields a call must give (the rule's)."""
        return self.rule.needs

    def check_n(self, n: int) -> None:
        """Raise ``ValueError`` if ``n`` rows cannot be served, naming the stage at fault."""
        rows = n
        for stage in self.stages:
            try:
                stage.check_n(rows)
            except ValueError as err:
                if rows != n:
                    raise ValueError(f"{err} [n={rows} is what reaches {stage.name} from {n} rows]") from None
                raise
            if isinstance(stage, PreAggregator):
                rows = stage.rows(rows)

    def least_n(self, limit: int = 100_000) -> int:
        """The fewest rows this chain can serve (``ValueError`` if none up to ``limit``)."""
        for n in range(1, limit + 1):
            try:
                self.check_n(n)
                return n
            except ValueError:
                continue
        raise ValueError(f"{self.spec} serves no number of rows up to {limit}")

    def __call__(self, X: torch.Tensor | Rows, inputs: RoundInputs | None = None) -> torch.Tensor:
        check_updates(X)
        self.check_n(X.shape[0])
        check_inputs(self.rule.name, self.needs, inputs, *X.shape)
        X = as_rows(X)
        for stage in self.pre:
            X = stage.transformed(X)
        if self.needs:
            return self.rule.aggregate(X, inputs)  # type: ignore[call-arg]
        return self.rule.aggregate(X)

    @property
    def last_kept(self) -> torch.Tensor | None:
        """Which input rows the last call used, when the rule selects rows and no
        pre-aggregator mixed them (``None`` otherwise)."""
        if not all(stage.keeps_rows for stage in self.pre):
            return None
        return self.rule.last_kept

    def state(self) -> dict[str, torch.Tensor]:
        """Every stage's carried state, keyed ``"<position>.<name>"``: tensors only."""
        return {f"{i}.{k}": v for i, stage in enumerate(self.stages) for k, v in stage.state().items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for i, stage in enumerate(self.stages):
            prefix = f"{i}."
            stage.load_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def spill(self, store: RowStore) -> None:
        """Every stage keeps the ``(d,)`` rows it carries across calls in ``store`` from now on
        (``Stage.spill``); the owner removes the rows no checkpoint names (``RowStore.collect``)."""
        for stage in self.stages:
            stage.spill(store)

    def kept_rows(self, nodes: int) -> int:
        """The most ``(d,)`` rows the stages keep at once for ``nodes`` nodes."""
        return sum(stage.kept_rows(nodes) for stage in self.stages)

    def __repr__(self) -> str:
        return f"aggregators.build({self.spec!r}, f={self.f})"


def build(spec: str, f: int) -> Chain:
    """Build the chain described by ``spec`` (e.g. ``"bucketing:s=2+centered-clipping:tau=10"``)."""
    components = parse(spec)
    stages: list[Stage] = []
    for position, comp in enumerate(components):
        cls = REGISTRY.lookup(comp.name, spec)
        last = position == len(components) - 1
        if last and not cls.is_rule:
            raise ValueError(
                f"{spec!r} ends with the pre-aggregator {comp.name!r}: end it with a rule, "
                f"e.g. '{spec}+trimmed-mean'"
            )
        if not last and cls.is_rule:
            raise ValueError(
                f"{comp.name!r} is a final rule but is followed by more stages in {spec!r}: "
                "only pre-aggregators (" + ", ".join(k for k, c in sorted(REGISTRY.entries.items()) if not c.is_rule)
                + ") may come before the rule"
            )
        if last and cls.needs & PER_NODE and not all(s.keeps_rows for s in stages):  # type: ignore[attr-defined]
            mixers = ", ".join(k for k, c in sorted(REGISTRY.entries.items()) if not c.is_rule and not c.keeps_rows)
            raise ValueError(
                f"{spec!r}: {comp.name} tracks each node across rounds, so no pre-aggregator that mixes "
                f"rows ({mixers}) may come before it"
            )
        stages.append(cls(f, **comp.params))
    return Chain(stages, format_spec(components))
