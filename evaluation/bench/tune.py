"""Tuned defences (``robust bench --tune``): each rule's hyperparameters chosen by its worst
case over the scenario's attacks on validation seeds, within a wall-time budget, before the grid
is played on its own seeds. ByzFL's benchmark tunes each rule against its worst attack before
comparing them: a defence compared at its defaults against attacks tuned to beat it is a straw man.

**Candidates.** A rule's hyperparameters are declared as data (``Param(..., tune=True)``:
bucketing's ``s``, centered clipping's ``tau`` and ``iters``, clip's ``c``, ...). Each one's
candidates are its value in the scenario's spec (given there, else its default) times
:data:`FACTORS` (a float) or :data:`INT_FACTORS` (an integer, rounded), kept where its declared
rule accepts them. ``f``, the number of Byzantine rows the rule assumes (the scenario's
``tolerate``, by default its ``byzantine``), is one more such integer where the chain's output
depends on it (``uses_f``: trimmed mean, Krum, NNM, ...; not the mean, median or centered
clipping, where it only bounds the rows they serve), its candidates kept where the chain can
serve the scenario's ``nodes`` with them. A rule's candidates are the product of its parameters'
candidates when that is at most :data:`MAX_PRODUCT`, else the spec with one parameter moved at a
time; the spec as written comes first. Not tuned: a parameter whose default the round derives
(Multi-Krum's ``m = n - f``).

**Objective.** A candidate's cells are the scenario's grid with the rule replaced by the
candidate, every attack (``none`` included), on the validation seeds (``--tune-seeds N``:
``VALIDATION + i``, none of them a seed of the scenario). Its score is its worst case: the lowest,
over the attacks, of the final accuracy averaged over the validation seeds (on a text set the
report's metric, the highest held-out loss; a backdoor's success is not in it). The chosen candidate has the highest score; ties go to the earlier candidate, so
the spec as written stays unless another is strictly better.

**Budget.** ``--tune-budget SECONDS`` bounds the tuning's wall time. The rules with something to
tune share it: each in turn gets what is left divided by the rules left, so a rule that finishes
early leaves its time to the next. Before a candidate starts, a rule stops if its seconds so far
plus the mean seconds of its candidates would pass its share (the spec as written always runs);
the candidates not run are reported as such. A rule with one candidate (nothing to tune) plays
no tuning cell. Finished tuning cells are kept in ``DIR/tune/results.jsonl``: running the command
again reuses them.

The grid then runs with each rule replaced by its choice (its spec, and ``tolerate`` where ``f``
moved) on the scenario's own seeds, never used to choose, and ``DIR/tune.json`` keeps every
candidate's worst case and worst attack, the choice and the spec as written, which the report's
Tuning section shows.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aggregators
from aggregators.base import REGISTRY
from robust.spec import Component, format_spec, parse

from evaluation.reports.objective import metric_of

from .cell import Cell

FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # a float hyperparameter's candidates, times its value
INT_FACTORS = (0.5, 1.0, 2.0, 4.0)  # an integer's, rounded
MAX_PRODUCT = 16  # above this many combinations, each parameter is moved alone
VALIDATION = 1000  # the first validation seed
F = -1  # the axis of f among a chain's components' (their positions)
TUNE_FILE = "tune.json"


def values_of(component: Component) -> dict[str, list]:
    """Each tunable parameter of ``component`` (a rule of a chain) and its candidate values,
    the spec's own first."""
    out = {}
    for key, param in REGISTRY.lookup(component.name, str(component)).declared().items():
        given = component.params.get(key, param.default)
        if not param.tune or given is None:
            continue
        factors = INT_FACTORS if param.rule.kind is int else FACTORS
        raw = [round(given * k) if param.rule.kind is int else given * k for k in factors]
        kept = [v for v in dict.fromkeys(raw) if param.rule.accepts(v)]
        out[key] = [given, *(v for v in kept if v != given)]
    return out


def candidates(spec: str, nodes: int, f: int) -> list[tuple[str, int]]:
    """The ``(spec, f)`` pairs ``--tune`` tries for the rule ``spec`` (a chain) assuming ``f``
    Byzantine rows of ``nodes``: ``(spec, f)`` itself first (see the module for the set)."""
    chain = parse(spec)
    axes = [(i, key, values) for i, comp in enumerate(chain) for key, values in values_of(comp).items()]
    if aggregators.build(spec, f).uses_f:
        moved = (round(f * k) for k in INT_FACTORS)
        axes.append((F, "f", [f, *(v for v in dict.fromkeys(moved) if v != f)]))
    if math.prod(len(v) for _, _, v in axes) <= MAX_PRODUCT:
        combos = [{}]
        for i, key, values in axes:
            combos = [{**c, (i, key): v} for c in combos for v in values]
    else:
        combos = [{}, *({(i, key): v} for i, key, values in axes for v in values[1:])]
    written = {(i, key): values[0] for i, key, values in axes}
    out = [(spec, f)]
    for combo in combos:
        moved = {at: v for at, v in combo.items() if v != written[at]}
        if not moved:
            continue  # the spec as written
        parts = [replace(comp, params={**comp.params, **{k: v for (j, k), v in moved.items() if j == i}})
                 for i, comp in enumerate(chain)]
        candidate = (format_spec(parts), moved.get((F, "f"), f))
        try:
            aggregators.build(*candidate).check_n(nodes)
        except ValueError:  # f too large for the rows it serves (e.g. after bucketing)
            continue
        out.append(candidate)
    return list(dict.fromkeys(out))


@dataclass
class Candidate:
    """One candidate, a rule's ``spec`` assuming ``f``, and its cells as run: each attack's final
    value of the report's metric (``evaluation.reports.objective``: accuracy, or a text set's
    held-out loss), the mean over the validation seeds. ``tolerate``: the scenario key that sets
    ``f`` (``None``: the scenario's own)."""

    spec: str
    f: int
    tolerate: int | None = None
    values: dict[str, float] = field(default_factory=dict)
    higher_is_better: bool = True
    seconds: float = 0.0
    ran: bool = False

    @property
    def label(self) -> str:
        return self.spec if self.tolerate is None else f"{self.spec} (f={self.f})"

    @property
    def worst_attack(self) -> str | None:
        sign = -1 if self.higher_is_better else 1
        return max(self.values, key=lambda a: sign * self.values[a]) if self.values else None

    @property
    def worst(self) -> float | None:
        return self.values[self.worst_attack] if self.values else None

    def score(self, records: Sequence[dict]) -> None:
        """Keep each attack's final value of the metric, averaged over the seeds, of this
        candidate's ``records`` (among others)."""
        mine = [r for r in records if r["aggregator"] == self.spec and r["config"].get("tolerate") == self.tolerate]
        metric = metric_of(mine)
        by_attack: dict[str, list[float]] = {}
        for r in mine:
            by_attack.setdefault(r["attack"], []).append(r[metric.final])
        self.values = {attack: statistics.fmean(v) for attack, v in by_attack.items()}
        self.higher_is_better = metric.higher_is_better


def choose(tried: Sequence[Candidate]) -> Candidate:
    """The candidate of the highest worst case; ties to the earlier (the spec as written first,
    which is also the choice where none ran: a rule with nothing to tune)."""
    ran = [c for c in tried if c.ran]
    return max(ran, key=lambda c: (c.worst if c.higher_is_better else -c.worst, -ran.index(c))) if ran else tried[0]


def validation_seeds(scenario: dict, count: int) -> list[int]:
    """``count`` validation seeds from :data:`VALIDATION`; refused where one is a seed of the grid."""
    if count < 1:
        raise ValueError(f"--tune-seeds must be >= 1 (got {count})")
    seeds = list(range(VALIDATION, VALIDATION + count))
    if clash := sorted(set(seeds) & {int(s) for s in scenario["seeds"]}):
        raise ValueError(f"the scenario's seeds {clash} are validation seeds of --tune: the report must be on seeds "
                         f"never used to choose; use seeds below {VALIDATION}")
    return seeds


def tune(scenario: dict, grid: Callable[[dict], list[Cell]], play: Callable[[list[Cell], Path], list[dict]],
         out: Path, seeds: int, budget: float, clock: Callable[[], float] = time.monotonic) -> dict[str, dict]:
    """Choose every rule of ``scenario`` (module docstring): ``grid(scenario)`` makes the cells,
    ``play(cells, results)`` runs the ones not yet in the file ``results`` and returns its
    records. Returns each rule as written -> the scenario keys of its choice (``aggregators`` and
    ``tolerate``); writes ``out/tune.json``."""
    if budget <= 0:
        raise ValueError(f"--tune-budget must be > 0 seconds (got {budget:g})")
    validation = {**scenario, "seeds": validation_seeds(scenario, seeds)}
    start, report, chosen = clock(), {"budget_s": budget, "seeds": validation["seeds"], "rules": {}}, {}
    own = scenario.get("tolerate")
    f = int(scenario["byzantine"] if own is None else own)
    rules = {rule: [Candidate(spec, g, own if g == f else g) for spec, g in candidates(rule, int(scenario["nodes"]), f)]
             for rule in scenario["aggregators"]}
    tuned = [rule for rule, tried in rules.items() if len(tried) > 1]  # a rule with nothing to tune is not played
    for rule, tried in rules.items():
        share = (budget - (clock() - start)) / (len(tuned) - tuned.index(rule)) if rule in tuned else 0.0
        began_rule = clock()
        for candidate in tried if rule in tuned else ():
            ran = [c for c in tried if c.ran]
            if ran and clock() - began_rule + statistics.fmean(c.seconds for c in ran) > share:
                break
            began = clock()
            keys = {"aggregators": [candidate.spec], "tolerate": candidate.tolerate}
            records = play(grid({**validation, **keys}), out / "tune" / "results.jsonl")
            candidate.score(records)
            candidate.seconds, candidate.ran = clock() - began, True
        best = choose(tried)
        chosen[rule] = {"aggregators": [best.spec], "tolerate": best.tolerate}
        report["rules"][rule] = {"chosen": best.label, "candidates": [{**asdict(c), "label": c.label, "worst": c.worst,
                                                                      "worst_attack": c.worst_attack} for c in tried]}
    report["seconds"] = clock() - start
    (out / TUNE_FILE).write_text(json.dumps(report, indent=1))
    return chosen


def read_tuning(out: Path) -> dict | None:
    """``out/tune.json`` if a ``--tune`` run wrote it."""
    path = Path(out) / TUNE_FILE
    return json.loads(path.read_text()) if path.exists() else None
