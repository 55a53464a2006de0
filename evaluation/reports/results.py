"""``robust bench`` records grouped over seeds: what the report's tables and plots read.

A record is one finished cell (aggregator x attack x seed x scenario). Records that differ
only by their seed form a :class:`Group` (mean and minimum over seeds). A group's *clean*
group has the same aggregator and scenario and attack ``none``; its *damage* is how much
worse its mean is than the clean one: in final accuracy, or for text in held-out loss
(``evaluation.reports.objective``). Sweep records (``--sweep``) are kept apart from the grid.
Rounds count from 0 as in the engine's records (``accuracy[0]``, ``rounds_to_detect``).
"Never" is ``math.inf`` wherever a median of rounds is taken, so a median that lands on an
undetected cell reads "never".
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from .objective import ACCURACY, Metric, metric_of
from .tables import show
from .target_costs import CLEAN, complete
STEALTH_AUC = 0.6  # a detector at or below this AUC is taken not to see the attack
# A cell's own axes, should the engine echo them in its config: not part of the scenario.
CELL_AXES = frozenset({"seed", "aggregator", "attack", "sweep"})

Scenario = tuple[tuple[str, str], ...]  # sorted (config key, JSON text of its value)


def finite(values: Iterable[float | None]) -> list[float]:
    """``values`` without the missing (``None``) and the NaN ones."""
    return [v for v in values if v is not None and not math.isnan(v)]


def median_round(rounds: Iterable[float | None]) -> float | None:
    """Median of rounds with ``None`` (never) as ``inf``; ``None`` when there are none."""
    values = [math.inf if r is None else r for r in rounds]
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class Detection:
    """A detector's scores pooled over cells: mean AUC and TPR at 5% FPR, median rounds."""

    name: str
    auc: float
    tpr: float
    rounds: float | None


def best_detector(records: Iterable[dict]) -> Detection | None:
    """The detector of highest mean AUC over ``records`` (NaN AUCs left out; ties to the
    first name in sorted order); ``None`` if no detector has a finite AUC."""
    scores: dict[str, list[dict]] = {}
    for record in records:
        for name, score in (record.get("detect") or {}).items():
            scores.setdefault(name, []).append(score)
    best = None
    for name in sorted(scores):
        aucs = finite(s.get("auc") for s in scores[name])
        if not aucs or (best and statistics.fmean(aucs) <= best.auc):
            continue
        tprs = finite(s.get("tpr_at_5fpr") for s in scores[name])
        best = Detection(
            name, statistics.fmean(aucs), statistics.fmean(tprs) if tprs else math.nan,
            median_round(s.get("rounds_to_detect") for s in scores[name]),
        )
    return best


@dataclass(frozen=True)
class Key:
    """What a group's records share: all but the seed."""

    aggregator: str
    attack: str
    scenario: Scenario
    sweep: tuple[str, str, float] | None  # (attack, param, value)


def key_of(record: dict) -> Key:
    """The group key of ``record``."""
    config = record["config"]
    scenario = tuple(sorted(
        (k, json.dumps(v, sort_keys=True)) for k, v in config.items() if k not in CELL_AXES
    ))
    sweep = record.get("sweep")
    sweep_key = (sweep["attack"], sweep["param"], sweep["value"]) if sweep else None
    return Key(record["aggregator"], record["attack"], scenario, sweep_key)


@dataclass
class Group:
    """The records of one cell over its seeds."""

    key: Key
    records: list[dict]
    metric: Metric = ACCURACY

    @property
    def mean(self) -> float:
        """Mean final value over seeds (accuracy, or held-out loss: :attr:`metric`)."""
        return statistics.fmean(r[self.metric.final] for r in self.records)

    @property
    def worst_seed(self) -> float:
        """The worst seed's final value."""
        return self.metric.worst(r[self.metric.final] for r in self.records)

    @property
    def curve(self) -> list[float]:
        """The metric per round, mean over seeds (as long as the shortest run)."""
        return [statistics.fmean(a) for a in zip(*(self.metric.of(r) for r in self.records))]

    @cached_property
    def detection(self) -> Detection | None:
        """Best detector over the seeds."""
        return best_detector(self.records)


def partition(groups: Iterable[Group], by: Callable[[Key], Hashable]) -> dict[Hashable, list[Group]]:
    """``groups`` split by ``by(group.key)``, parts and members in first-seen order."""
    parts: dict[Hashable, list[Group]] = {}
    for group in groups:
        parts.setdefault(by(group.key), []).append(group)
    return parts


@dataclass
class AccuracyRow:
    """One aggregator in one scenario: its group per attack, and the worst attacked one."""

    label: str
    aggregator: str
    cells: dict[str, Group]
    worst: Group | None


class Results:
    """All records grouped over seeds, with the scenario keys that differ between them; each
    record with what reaching its target cost (:func:`evaluation.reports.target_costs.complete`)."""

    def __init__(self, records: Sequence[dict]):
        self.metric = metric_of(records)
        self.records = complete(records, self.metric)
        grouped: dict[Key, list[dict]] = {}
        for record in self.records:
            grouped.setdefault(key_of(record), []).append(record)
        self.groups = {key: Group(key, members, self.metric) for key, members in grouped.items()}
        self.config_keys = list(dict.fromkeys(
            k for r in self.records for k in r["config"] if k not in CELL_AXES
        ))
        self.varying = [k for k in self.config_keys if len(self.values(k)) > 1]

    def values(self, key: str) -> list[str]:
        """The distinct values (as text) config ``key`` takes, ``—`` where a cell lacks it."""
        return list(dict.fromkeys(
            show(r["config"][key]) if key in r["config"] else "—" for r in self.records
        ))

    @property
    def grid(self) -> list[Group]:
        """Groups from the grid (not from a sweep)."""
        return [g for g in self.groups.values() if g.key.sweep is None]

    @property
    def sweeps(self) -> list[Group]:
        """Groups from a sweep."""
        return [g for g in self.groups.values() if g.key.sweep is not None]

    def label(self, name: str, scenario: Scenario) -> str:
        """``name``, followed by the varying scenario keys' values when there are any (a key at
        its derived default, ``null``, is left out: ``tolerate`` where the defence assumes
        ``byzantine``)."""
        config = dict(scenario)
        shown = ", ".join(
            f"{k}={show(json.loads(config[k])) if k in config else '—'}" for k in self.varying
            if k not in config or json.loads(config[k]) is not None
        )
        return f"{name} ({shown})" if shown else name

    def clean(self, key: Key) -> Group | None:
        """The clean grid group of ``key``'s aggregator and scenario."""
        return self.groups.get(Key(key.aggregator, CLEAN, key.scenario, None))

    def damage(self, group: Group) -> float | None:
        """How much worse the attacked mean is than the clean one (accuracy: a fraction; loss:
        nats); ``None`` without a clean run."""
        clean = self.clean(group.key)
        return self.metric.cost(clean.mean, group.mean) if clean else None

    def mean_damage(self, groups: Iterable[Group]) -> float | None:
        """Mean damage over the groups that have a clean run."""
        damages = finite(self.damage(g) for g in groups)
        return statistics.fmean(damages) if damages else None

    def attacks(self) -> list[str]:
        """Grid attacks, ``none`` first, the others in first-seen order."""
        seen = dict.fromkeys(g.key.attack for g in self.grid)
        return sorted(seen, key=lambda a: a != CLEAN)

    def accuracy_rows(self) -> list[AccuracyRow]:
        """One row per grid aggregator and scenario, by worst case descending (none last)."""
        rows = []
        for (aggregator, scenario), groups in partition(
            self.grid, lambda k: (k.aggregator, k.scenario)
        ).items():
            cells = {g.key.attack: g for g in groups}
            attacked = [g for a, g in cells.items() if a != CLEAN]
            worst = max(attacked, key=lambda g: self.metric.worse(g.mean), default=None)
            rows.append(AccuracyRow(self.label(aggregator, scenario), aggregator, cells, worst))
        return sorted(rows, key=lambda row: self.metric.worse(row.worst.mean) if row.worst else math.inf)
