"""The report's communication: bytes to the target accuracy against the worst case over attacks.

For a run whose cells differ in how updates travel (``protocol``, ``compression``,
``downlink``), each way of sending (one aggregator on one task, one protocol and codec) is a
row: its bytes sent up and down until the target accuracy is first reached
(``evaluation.reports.target_costs``; the worst over the attacks, mean over seeds, ``never`` if a seed of an
attack never got there), its final accuracy clean and in the worst case over attacks, the
honest nodes it quarantined, and how many times fewer bytes up it took than the *baseline*'s
clean run (the row of the same aggregator and task sent as ``momentum`` with float32 rows both
ways; its own worst case may never reach the target). The frontier plot puts bytes to target
against worst-case accuracy, one point per row (hollow: it quarantined honest nodes); the rows
that quarantined no honest node and that no such row beats on both are joined by a line.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from robust.spec import parse

from .canvas import new_figure, palette, save_png
from .results import CLEAN, AccuracyRow, Group, Results
from .tables import show, table
from .target_costs import BASELINE, mean_over_seeds

WAYS = ("protocol", "compression", "downlink")  # what a row's way of sending is


def communicating(res: Results) -> bool:
    """Whether the run compares ways of sending (and its cells count bytes)."""
    return any(k in res.varying for k in WAYS) and all("bytes" in r for r in res.records)


def _worst(values: Sequence[float | None]) -> float | None:
    """The largest; ``None`` (never) if any is."""
    return None if not values or any(v is None for v in values) else max(values)


@dataclass
class Way:
    """One aggregator on one task, sent one way: what reaching the target cost, what it kept."""

    row: AccuracyRow
    scenario: tuple
    up: float | None  # bytes up to target, worst over attacks (mean over seeds)
    down: float | None
    clean_up: float | None
    total_up: float  # bytes up over the whole run, worst over attacks
    clean: float | None  # clean final value (accuracy, or held-out loss: the report's metric)
    worst: Group | None  # the attacked group of worst mean final value
    honest_quarantined: float  # honest nodes quarantined at the end, worst over the groups (mean over seeds)

    @property
    def accuracy(self) -> float | None:
        """Worst-case final value over attacks (clean when there is no attack): accuracy, or held-out loss."""
        return self.worst.mean if self.worst else self.clean


def _cost(group: Group, field: str) -> float | None:
    return mean_over_seeds([r[field] for r in group.records])


def ways(res: Results) -> list[Way]:
    """One :class:`Way` per aggregator and scenario of the grid."""
    out = []
    for row in res.accuracy_rows():
        groups = list(row.cells.values())
        scenario = groups[0].key.scenario
        clean = row.cells.get(CLEAN)
        out.append(Way(
            row, scenario,
            up=_worst([_cost(g, "bytes_up_to_target") for g in groups]),
            down=_worst([_cost(g, "bytes_down_to_target") for g in groups]),
            clean_up=_cost(clean, "bytes_up_to_target") if clean else None,
            total_up=max(statistics.fmean(r["bytes_up"] for r in g.records) for g in groups),
            clean=clean.mean if clean else None, worst=row.worst,
            honest_quarantined=max(statistics.fmean(r["false_quarantines"] for r in g.records) for g in groups),
        ))
    return out


def baseline_of(way: Way, everything: Sequence[Way]) -> Way | None:
    """The way of the same aggregator and task sent as :data:`BASELINE`."""
    config = dict(way.scenario)
    want = {k: json.dumps(v) for k, v in BASELINE.items() if k in config}
    target = tuple(sorted({**config, **want}.items()))
    return next((w for w in everything if w.row.aggregator == way.row.aggregator and w.scenario == target), None)


def _mb(value: float | None) -> str:
    return "never" if value is None else f"{value / 1e6:.3g}"


def communication_section(res: Results) -> list[str]:
    """The summary's "Bytes to target" section (nothing when :func:`communicating` says no)."""
    if not communicating(res):
        return []
    everything, m = ways(res), res.metric
    rows = []
    for way in sorted(everything, key=lambda w: (w.row.aggregator, math.inf if w.up is None else w.up)):
        base = baseline_of(way, everything)
        ratio = f"{base.clean_up / way.up:.1f}x" if base and base.clean_up is not None and way.up else "—"
        below = (m.show_damage(m.cost(base.accuracy, way.accuracy))
                 if base and base.accuracy is not None and way.accuracy is not None else "—")
        rows.append([way.row.label, _mb(way.up), _mb(way.down), ratio, _mb(way.clean_up), _mb(way.total_up),
                     m.show(way.clean), m.show(way.accuracy), way.worst.key.attack if way.worst else "—", below,
                     f"{way.honest_quarantined:.1f}"])
    return [
        "## Bytes to target", "",
        f"Per way of sending: MB sent up and down until the target is first reached (its {m.target_is}; with "
        "`target-of = \"baseline\"` the baseline's clean value instead of the best), the worst over the "
        "attacks of the mean over seeds (never: some attack's seed never got there); x fewer: the baseline's "
        "(`momentum`, float32 both ways, same aggregator and task) MB up to target in its clean run over this "
        "one's; pp below: "
        f"how much worse the worst-case {m.name} is than the baseline's worst case ({m.unit}); honest "
        "quarantined: at the end, the most over "
        "attacks (mean over seeds).", "",
        *table(["defence (way)", "MB up to target", "MB down to target", "x fewer up", "MB up to target (clean)",
                "MB up in all", f"clean ({m.name})" if not m.higher_is_better else "clean (%)",
                "worst case (%)" if m.higher_is_better else f"worst case ({m.name})", "worst attack",
                f"{m.unit} below baseline" if m.higher_is_better else f"{m.unit} above baseline",
                "honest quarantined"], rows),
    ]


def pareto(points: Sequence[tuple[float, float]], higher_is_better: bool = True) -> list[tuple[float, float]]:
    """The points no other beats on both fewer bytes (x) and a better value (y: higher accuracy,
    or lower loss), by x."""
    sign = 1 if higher_is_better else -1
    best, out = -math.inf, []
    for x, y in sorted(points, key=lambda p: (p[0], -sign * p[1])):
        if sign * y > best:
            out.append((x, y))
            best = sign * y
    return out


def short(config: dict, keys: Sequence[str]) -> str:
    """A way's ``keys`` in a few characters: ``K=16 nesterov, sign`` (``delta:steps=16,...``)."""
    shown = []
    for key in keys:
        value = json.loads(config[key]) if key in config else "—"
        parsed = parse(value)[0] if key == "protocol" and isinstance(value, str) else None
        if parsed and parsed.name == "delta":
            outer = parsed.params.get("server_momentum", 0)
            shown.append(f"K={parsed.params.get('steps', 10)}" + (" nesterov" if parsed.params.get("nesterov") else
                                                                  f" mu={outer:g}" if outer else ""))
        else:
            shown.append(f"{key}={show(value)}" if key == "downlink" else show(value))
    return ", ".join(shown)


def bytes_frontier(records: Sequence[dict], path: str | Path) -> list[Path]:
    """MB up to target (worst over attacks) against worst-case accuracy, a point per way (hollow:
    it quarantined honest nodes), one colour per aggregator and task, the frontier of the ways
    that quarantined no honest node joined and labelled; nothing when the run does not compare
    ways of sending."""
    res = Results(records)
    if not communicating(res):
        return []
    m = res.metric
    reached = [w for w in ways(res) if w.up is not None and w.accuracy is not None]
    if not reached:
        return []
    varying = [k for k in res.varying if k not in WAYS]
    compared = [k for k in WAYS if k in res.varying]
    series: dict[str, list[Way]] = {}
    for way in reached:
        config = dict(way.scenario)
        task = [f"{k}={show(json.loads(config[k]))}" for k in varying if k in config]
        series.setdefault(", ".join([way.row.aggregator, *task]), []).append(way)
    colours = palette(list(series))
    figure = new_figure(9, 6)
    ax = figure.add_subplot()
    for name, members in series.items():
        points = {id(w): (w.up / 1e6, m.scale * w.accuracy) for w in members}
        ax.scatter(*zip(*points.values()), s=30, zorder=3, label=name, edgecolors=colours[name],
                   facecolors=[colours[name] if w.honest_quarantined == 0 else "none" for w in members])
        kept = [w for w in members if w.honest_quarantined == 0]
        front = pareto([points[id(w)] for w in kept], m.higher_is_better)
        if front:
            ax.plot(*zip(*front), color=colours[name], linewidth=1)
        for way in kept:
            if points[id(way)] in front:
                ax.annotate(short(dict(way.scenario), compared), points[id(way)], textcoords="offset points",
                            xytext=(4, 3), fontsize=7, color=colours[name])
    ax.set(xscale="log", xlabel=f"MB sent up until the target {m.name} (worst over attacks)",
           ylabel=f"worst-case final {m.axis} over attacks",
           title=f"Bytes to target vs {m.name} under attack\n({'upper' if m.higher_is_better else 'lower'} left is "
                 "better; hollow: honest nodes quarantined; line: the frontier of the others)")
    ax.grid(alpha=0.3)
    ax.legend(title="defence, task", fontsize=8, loc="best")
    return [save_png(figure, path)]
