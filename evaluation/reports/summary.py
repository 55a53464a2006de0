"""The report of ``robust bench``: ``results.jsonl`` in, ``summary.md`` (and ``summary.html``) and plots out.

The records are read here and grouped over seeds by ``evaluation.reports.results``; each section of
the summary is one function. Sweep records (``--sweep``) are kept apart from the grid: they
feed the stealth frontier, with the grid's clean groups as baselines.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Sequence
from pathlib import Path

from . import plots
from .communication_section import communication_section
from .html_page import write_html
from .metrics import leaves_band
from .paging import sheet_name, sheets
from .results import (
    CLEAN, STEALTH_AUC, AccuracyRow, Group, Results, best_detector, finite, median_round, partition,
)
from .tables import format_value, num, pct, rounds, table
from .time_section import time_section
from .tune_section import tune_section

REQUIRED = ("cell", "aggregator", "attack", "seed", "config", "final_accuracy", "accuracy")


def read_results(path: str | Path) -> list[dict]:
    """The records of ``path``, one JSON object a line; a rerun cell's last record wins.

    A killed run leaves a cut-short line, and a resumed run may append its next record to
    it: such a line is skipped with a warning, keeping a whole record that follows the cut
    (the cut cell has no record, so the next run redoes it). A record without the schema's
    keys is a ``ValueError`` naming its line.
    """
    records: dict[str, dict] = {}
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            record, cut = _whole_record(line)
            if cut:
                kept = ", kept the whole record after the cut" if record else ""
                warnings.warn(f"{path} line {number}: skipped a cell cut short by a killed run{kept}")
            if record is None:
                continue
            missing = [k for k in REQUIRED if k not in record]
            if missing:
                raise ValueError(f"{path} line {number} lacks {missing}: not a robust bench record")
            records[record["cell"]] = record
    return list(records.values())


def _whole_record(line: str) -> tuple[dict | None, bool]:
    """The JSON object that ends ``line``, and whether text precedes it (the line starts with
    a cut-short record). After a cut only a whole record counts: a cut can end just after a
    nested object."""
    for start in (i for i, char in enumerate(line) if char == "{"):
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        cut = bool(line[:start].strip())
        if isinstance(record, dict) and (not cut or all(k in record for k in REQUIRED)):
            return record, cut
    return None, True


def validation_detect_round(attacked: Sequence[float], clean: Sequence[Sequence[float]]) -> int | None:
    """First round (0-based, as ``rounds_to_detect``) where ``attacked`` leaves the [min, max]
    band of the ``clean`` curves at that round (:func:`evaluation.reports.metrics.leaves_band`);
    ``None`` if it never does or if there are no clean curves."""
    return leaves_band(list(attacked), [list(c) for c in clean]) if clean else None


def _scenario_section(res: Results) -> list[str]:
    shared = [f"{k}={res.values(k)[0]}" for k in res.config_keys if k not in res.varying]
    lines = ["## Scenario", "", ", ".join(shared) or "(no shared config)", ""]
    lines += [f"- varying {k}: {', '.join(res.values(k))}" for k in res.varying]
    grid = [r for g in res.grid for r in g.records]
    aggregators = {r["aggregator"] for r in grid}
    seeds = {r["seed"] for r in grid}
    lines += [
        f"- grid: {len(grid)} cells ({len(aggregators)} aggregators x {len(res.attacks())} "
        f"attacks x {len(seeds)} seeds); sweeps: {len(res.records) - len(grid)} cells", "",
    ]
    return lines


def _accuracy_section(res: Results) -> list[str]:
    rows, m = res.accuracy_rows(), res.metric

    def cell(row: AccuracyRow, attack: str) -> str:
        group = row.cells.get(attack)
        if group is None:
            return "—"
        low = f" ({m.show(group.worst_seed)})" if len(group.records) > 1 else ""
        return m.show(group.mean) + low

    pages = sheets(list(dict.fromkeys(row.aggregator for row in rows)), res.attacks())
    lines = [
        "## Accuracy" if m.higher_is_better else "## Held-out loss", "",
        f"{m.title}, mean over seeds (worst seed in brackets). Worst case: the worst "
        "mean over the attacks other than none" + (", over the whole grid; a big grid's table is split "
        "by attack and defence family" if len(pages) > 1 else "") + ".", "",
    ]
    for number, (defences, attacks) in enumerate(pages, start=1):
        if len(pages) > 1:
            lines += [f"### {sheet_name(number, len(pages), defences, attacks).capitalize()}", ""]
        lines += table(["aggregator", *attacks, "worst case", "worst attack"], [
            [row.label, *(cell(row, a) for a in attacks),
             m.show(row.worst.mean) if row.worst else "—", row.worst.key.attack if row.worst else "—"]
            for row in rows if row.aggregator in defences
        ])
    return lines


def _worst_section(res: Results) -> list[str]:
    """Per defence, the attack that hurt it most: the grid's worst cases, ahead of its tables."""
    rows, m = [row for row in res.accuracy_rows() if row.worst], res.metric
    if not rows:
        return []

    def quarantined(group: Group) -> str:
        if "caught_round" not in group.records[0]:
            return "—"
        share, every = caught(group)
        return f"{share:g}/{every}" + (f" by round {rounds(median_round(r['caught_round'] for r in group.records))}"
                                        if share == every else "")

    return [
        "## Worst cases", "",
        f"Per defence, the attack that left the worst final {m.name} (mean over seeds, worst seed in "
        f"brackets), the damage ({m.damage_is}, {m.unit}), its best detector's mean AUC, and how "
        "many of its nodes were quarantined (mean over seeds) and, when all were, by which round (median "
        "over seeds). Defences by worst case, worst last.", "",
        *table(["defence", "worst attack", m.name, f"damage ({m.unit})", "best AUC", "quarantined"], [
            [row.label, row.worst.key.attack, f"{m.show(row.worst.mean)} ({m.show(row.worst.worst_seed)})",
             m.show_damage(res.damage(row.worst)), num(row.worst.detection and row.worst.detection.auc),
             quarantined(row.worst)]
            for row in rows
        ]),
    ]


def _kappa(groups: Sequence[Group]) -> str:
    def top(field: str) -> float | None:
        return max(finite(r.get(field) for g in groups for r in g.records), default=None)

    worst, bound = top("kappa_max"), top("kappa_bound")
    if worst is None or bound is None:
        return "—"
    return f"{worst:.2f} {'≤' if worst <= bound else '>'} {bound:.2f}"


def _detect_section(res: Results) -> list[str]:
    rows, m = [], res.metric
    attacked = [g for g in res.grid if g.key.attack != CLEAN]
    for (attack, scenario), groups in partition(attacked, lambda k: (k.attack, k.scenario)).items():
        best = best_detector(r for g in groups for r in g.records)
        validation = median_round(
            validation_detect_round(g.curve, [m.of(r) for r in clean.records])
            for g in groups if (clean := res.clean(g.key))
        )
        rows.append([
            res.label(attack, scenario), m.show_damage(res.mean_damage(groups)),
            best.name if best else "—", num(best and best.auc), num(best and best.tpr),
            rounds(best and best.rounds), rounds(validation), _kappa(groups),
        ])
    header = ["attack", f"damage ({m.unit})", "best detector", "AUC", "TPR@5%FPR",
              "rounds to detect", "validation detect", "κ max vs bound"]
    return [
        "## Detectability", "",
        f"Damage: {m.damage_is} at the end, mean over aggregators and seeds. Best "
        "detector: highest mean AUC; its rounds to detect are a median over cells. Validation "
        f"detect: first round the attacked {m.name} leaves the clean runs' band (median over "
        "aggregators). Rounds count from 0. κ: largest kappa_max and kappa_bound over cells.",
        "", *table(header, rows),
    ]


def caught_damage(group: Group, clean: Group | None) -> float | None:
    """Mean over seeds of the damage the attack did (``group.metric``'s, at that round) by the
    round its last Byzantine node was quarantined, or by the end if one never was."""
    if clean is None:
        return None
    curve, gaps, m = clean.curve, [], group.metric
    for r in group.records:
        values = m.of(r)
        at = r.get("caught_round")
        at = len(values) - 1 if at is None else at
        if at < len(curve):
            gaps.append(m.cost(curve[at], values[at]))
    return statistics.fmean(gaps) if gaps else None


def caught(group: Group) -> tuple[float, int]:
    """Byzantine nodes quarantined (mean over seeds), of how many."""
    quarantined = group.records[0]["rounds_to_quarantine"]
    share = statistics.fmean(sum(v is not None for v in r["rounds_to_quarantine"].values()) for r in group.records)
    return share, len(quarantined)


def _quarantine_section(res: Results) -> list[str]:
    """The flag policy as deployed: who it quarantined, how soon, and what it cost before."""
    groups = [g for g in res.grid if "false_quarantines" in g.records[0]]
    if not groups:
        return []
    rows = []
    for g in sorted(groups, key=lambda g: (g.key.attack != CLEAN, g.key.attack, g.key.aggregator)):
        attacked = g.key.attack != CLEAN
        rows.append([
            res.label(g.key.attack, g.key.scenario), g.key.aggregator,
            "{:g}/{}".format(*caught(g)) if attacked else "—",
            rounds(median_round(r["caught_round"] for r in g.records)) if attacked else "—",
            res.metric.show_damage(caught_damage(g, res.clean(g.key))) if attacked else "—",
            f"{statistics.fmean(r['false_quarantines'] for r in g.records):g}",
        ])
    false = sum(r["false_quarantines"] for g in groups for r in g.records)
    cells = sum(len(g.records) for g in groups)
    return [
        "## Quarantine", "",
        "The coordinator's flag policy, applied exactly as deployed: a node is flagged when its reply is "
        "rejected or its row is farther from the coordinate median than `flag-ratio` times the larger of the run's "
        "typical distance (the largest round median of those distances so far) and the node's own (the geometric "
        "mean of its distances in the rounds it was not flagged; the run's alone with `flag-own = false`), "
        "and quarantined (no longer asked) after `quarantine-after` flags, or, with `false-alarm` > 0, when its "
        "evidence over rounds (a CUSUM of how atypical its update's direction is) crosses the threshold set "
        "for that chance of ever quarantining an honest node. Caught: Byzantine nodes quarantined "
        "(mean over seeds). Caught by: round the last one was (median over seeds; rounds count from 0). "
        f"Damage before: {res.metric.damage_is} at that round ({res.metric.unit}), or at the end if one never was. "
        "False: honest nodes quarantined (mean over seeds).", "",
        f"Honest nodes quarantined over all {cells} cells: **{false}**.", "",
        *table(["attack", "aggregator", "caught", "caught by round", f"damage before ({res.metric.unit})", "false"],
               rows),
    ]


def _spot_section(res: Results) -> list[str]:
    """Spot checks as deployed: how soon recomputation convicts each attacker, at what cost."""
    groups = [g for g in res.grid if g.records[0]["config"].get("spot-check")]
    if not groups:
        return []
    rows = []
    for g in sorted(groups, key=lambda g: (g.key.attack, g.key.aggregator, g.records[0]["config"]["spot-check"])):
        p = g.records[0]["config"]["spot-check"]
        convicted = [v for r in g.records for v in r["round_convicted"].values()]
        attacked = g.key.attack != CLEAN
        rows.append([
            res.label(g.key.attack, g.key.scenario), g.key.aggregator, f"{p:g}",
            f"{statistics.fmean(r['spot_checks'] for r in g.records):.0f}",
            f"{sum(v is not None for v in convicted)}/{len(convicted)}" if attacked else "—",
            rounds(median_round(convicted)) if attacked else "—", f"{1 / p:.0f}",
            f"{sum(r['false_convictions'] for r in g.records)}",
        ])
    return [
        "## Spot checks", "",
        "Each round a share p of the accepted updates, drawn from the hash of the committed updates, is "
        "recomputed from its task; an update that differs is its author's conviction (banned at once). "
        "Convicted: Byzantine nodes convicted over all seeds. Round: median round of conviction (1-based; "
        "never-convicted nodes count as not caught), beside 1/p, the expected rounds to the first check of a "
        "node that lies every round. Checks: updates recomputed per cell (the compute cost, in node updates).", "",
        *table(["attack", "aggregator", "p", "checks", "convicted", "round", "1/p", "false convictions"], rows),
    ]


def _backdoor_section(res: Results) -> list[str]:
    """What a backdoor leaves in the model: its success at the end and, for an attack that
    stops (``stop_after=R``), at round R and how many rounds after it."""
    groups = [g for g in res.grid if any(r.get("backdoor_asr") is not None for r in g.records)]
    if not groups:
        return []

    def mean(field: str, group: Group) -> float | None:
        values = finite(r.get(field) for r in group.records)
        return statistics.fmean(values) if values else None

    rows = []
    for g in sorted(groups, key=lambda g: (g.key.attack, g.key.aggregator)):
        stop = g.records[0].get("backdoor_stop_round")
        rows.append([
            res.label(g.key.attack, g.key.scenario), g.key.aggregator, res.metric.show(g.mean),
            pct(mean("backdoor_asr_at_stop", g)) if stop else "—", f"{stop:g}" if stop else "—",
            f"{len(g.records[0]['accuracy']) - stop:g}" if stop else "—", pct(mean("backdoor_asr", g)),
        ])
    return [
        "## Backdoor", "",
        "Backdoor success (%): the share of triggered test samples whose true label is not the target that "
        "the model classifies as the target (`text-backdoor`: of held-out prompts ending in the trigger after "
        "which greedy decoding writes the attacker's whole continuation), mean over seeds. An attack with "
        "`stop_after=R` turns honest "
        "after round R: its success at that round (when its nodes stop; — where the driver kept only the "
        "final model) and at the end, that many rounds later, say how long the backdoor survives honest "
        f"training. {res.metric.name.capitalize()}: final {res.metric.name} on the clean test set.", "",
        *table(["attack", "aggregator", res.metric.name, "success at stop", "stop round", "rounds after stop",
                 "success at end"], rows),
    ]


def never_quarantined(group: Group) -> bool | None:
    """Whether no Byzantine node of ``group`` was quarantined in any seed (``None``: no record of it)."""
    if "rounds_to_quarantine" not in group.records[0]:
        return None
    return all(v is None for r in group.records for v in r["rounds_to_quarantine"].values())


def stealth_rows(res: Results) -> list[tuple[str, Group | None, Group | None, Group | None]]:
    """Per defence (aggregator and scenario), the attacked group (grid or sweep) of largest
    damage among those whose best detector's AUC stayed <= ``STEALTH_AUC``, among those never
    quarantined, and among those both."""
    rows = []
    attacked = [g for g in res.groups.values() if g.key.attack != CLEAN and res.damage(g) is not None]
    for (aggregator, scenario), groups in partition(attacked, lambda k: (k.aggregator, k.scenario)).items():
        quiet = [g for g in groups if g.detection is not None and g.detection.auc <= STEALTH_AUC]
        free = [g for g in groups if never_quarantined(g)]
        best = [max(part, key=res.damage, default=None) for part in (quiet, free, [g for g in quiet if g in free])]
        rows.append((res.label(aggregator, scenario), *best))
    return sorted(rows, key=lambda row: -(res.damage(row[3]) if row[3] else -math.inf))


def _stealth_section(res: Results) -> list[str]:
    """The headline: how much harm each defence lets through unseen."""
    rows = stealth_rows(res)
    if not rows:
        return []

    def said(group: Group | None, auc: bool = False) -> str:
        if group is None:
            return "—"
        extra = f", AUC {group.detection.auc:.2f}" if auc and group.detection else ""
        return f"{res.metric.show_damage(res.damage(group))} {res.metric.unit}: {group.key.attack}{extra}"

    return [
        "## Stealth frontier", "",
        f"Per defence, the largest damage ({res.metric.damage_is} at the end, mean over seeds) any attack "
        f"of this run achieved while every detector's AUC stayed <= {STEALTH_AUC} (its best detector's mean "
        f"AUC), while none of its nodes was ever quarantined, and while both held: what a patient attacker "
        f"gets through unseen. Sweeps count as attacks. Defences by the last column, worst first.", "",
        *table(["defence", f"AUC <= {STEALTH_AUC}", "never quarantined", "both"],
                [[label, said(quiet, True), said(free), said(both, True)] for label, quiet, free, both in rows]),
        "",
    ]


def _frontier_section(res: Results) -> list[str]:
    lines = ["## Sweeps", ""]
    sweeps = partition(res.sweeps, lambda k: (k.sweep[0], k.sweep[1], k.scenario))
    for (attack, param, scenario), groups in sweeps.items():
        points = []
        for value, part in sorted(partition(groups, lambda k: k.sweep[2]).items()):
            best = best_detector(r for g in part for r in g.records)
            points.append((value, res.mean_damage(part), best))
        stealthy = [(d, v) for v, d, b in points if d is not None and b and b.auc <= STEALTH_AUC]
        if stealthy:
            damage, value = max(stealthy, key=lambda p: p[0])
            verdict = f"largest damage with best-detector AUC <= {STEALTH_AUC}: " \
                      f"{res.metric.show_damage(damage)} {res.metric.unit} at {param}={format_value(value)}"
        else:
            verdict = f"none stays below AUC {STEALTH_AUC}"
        rows = [[format_value(v), res.metric.show_damage(d), b.name if b else "—", num(b and b.auc)]
                for v, d, b in points]
        lines += [f"### {res.label(attack, scenario)}", "",
                  *table([param, f"damage ({res.metric.unit})", "best detector", "AUC"], rows), verdict, ""]
    return lines


def _speed_section(path: Path) -> list[str]:
    """The engine's speed against the plain per-node loop (``speed.json``, written by bench)."""
    if not path.exists():
        return []
    speed = json.loads(path.read_text())
    plain = speed["plain_loop_node_steps_per_s"]
    return [
        "## Speed", "",
        f"Node-steps per second against a plain per-node PyTorch loop ({plain:.0f}: each node's "
        "module, `backward()`, worker momentum, mean aggregation) on the same scenario. The training "
        "phase is timed alternately with the loop (median of 5 pairs); whole rounds are the median "
        "cell of this grid:", "",
        *table(["", "node-steps/s", "vs plain loop"], [
            ["training (batch draws, gradients, momentum): the plain loop's work",
             f"{speed['engine_training_node_steps_per_s']:.0f}", f"**{speed['training_speedup']:.1f}x**"],
            ["whole rounds: training, attack, validation, robust rule, 6 detectors, evaluation",
             f"{speed['engine_node_steps_per_s']:.0f}", f"{speed['speedup']:.1f}x"],
        ]),
    ]


def write_summary(records: Sequence[dict], out_dir: str | Path, figures: Sequence[Path] = ()) -> Path:
    """Write ``out_dir/summary.md`` (the stealth frontier and the worst cases first, then the
    scenario, accuracy, detectability, backdoor, quarantine, sweeps when there are sweep
    records, links to ``figures``); return its path."""
    res = Results(records)
    lines = ["# robust bench report", ""]
    if not res.records:
        lines += ["No finished cells yet.", ""]
    else:
        lines += _stealth_section(res)
        lines += _worst_section(res)
        lines += _scenario_section(res)
        lines += tune_section(out_dir)
        if res.grid:
            lines += _accuracy_section(res)
        if any(g.key.attack != CLEAN for g in res.grid):
            lines += _detect_section(res)
        lines += _backdoor_section(res)
        lines += _quarantine_section(res)
        lines += _spot_section(res)
        lines += time_section(res)
        lines += communication_section(res)
        if res.sweeps:
            lines += _frontier_section(res)
    lines += _speed_section(Path(out_dir) / "speed.json")
    if figures:
        lines += ["## Figures", ""]
        lines += [f"![{Path(f).stem}]({Path(f).name})" for f in figures] + [""]
    path = Path(out_dir) / "summary.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def write_report(results_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Read ``results_path``; write the plots that have data, ``summary.md`` and the same
    report as one self-contained page, ``summary.html`` (``evaluation.reports.html_page``), into
    ``out_dir``; return the written paths, summary first."""
    records = read_results(results_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = [p for plot in plots.ALL for p in plot(records, out / f"{plot.__name__}.png")]
    summary = write_summary(records, out, figures)
    return [summary, write_html(summary), *figures]
