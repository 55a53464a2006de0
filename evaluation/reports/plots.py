"""Plots of ``robust bench`` records, drawn on matplotlib's Agg canvas (``evaluation.reports.canvas``).

Each function writes its PNGs (one, or a big grid's pages) and returns their paths: none
when the records hold nothing it can plot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .communication_section import bytes_frontier
from .canvas import new_figure, palette, save_png
from .paging import page_paths, sheet_title, sheets
from .results import CLEAN, STEALTH_AUC, Group, Results, partition
from .tables import format_value
from .time_section import accuracy_vs_time


def heatmap(records: Sequence[dict], path: str | Path) -> list[Path]:
    """Aggregator x attack grid of mean final accuracy, rows by worst case as in the summary;
    a big grid on several pages (``evaluation.reports.paging``)."""
    res = Results(records)
    rows, m = res.accuracy_rows(), res.metric
    pages = sheets(list(dict.fromkeys(row.aggregator for row in rows)), res.attacks())
    every = [m.scale * group.mean for row in rows for group in row.cells.values()]
    scale = {"vmin": min(every, default=0), "vmax": max(every, default=100)}  # one scale on every page
    out = []
    for number, ((defences, attacks), page) in enumerate(zip(pages, page_paths(path, len(pages))), start=1):
        shown = [row for row in rows if row.aggregator in defences]
        values = np.array([[m.scale * row.cells[a].mean if a in row.cells else math.nan for a in attacks]
                           for row in shown])
        label_width = max(len(row.label) for row in shown)
        figure = new_figure(2.5 + 0.08 * label_width + 1.1 * len(attacks), 1.9 + 0.45 * len(shown))
        ax = figure.add_subplot()
        image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis" if m.higher_is_better else "viridis_r",
                          aspect="auto", **scale)
        for (i, j), value in np.ndenumerate(values):
            dark = math.isnan(value) or image.norm(value) < 0.5
            ax.text(j, i, "—" if math.isnan(value) else f"{value:.1f}" if m.higher_is_better else f"{value:.3f}",
                    ha="center", va="center",
                    color="white" if dark else "black", fontsize=9)
        ax.set_xticks(range(len(attacks)), attacks, rotation=30, ha="right")
        ax.set_yticks(range(len(shown)), [row.label for row in shown])
        ax.set(xlabel="attack", ylabel="aggregator", title=sheet_title(
            f"{m.title}, mean over seeds", number, len(pages), defences, attacks))
        figure.colorbar(image, ax=ax, label=f"final {m.axis}")
        out.append(save_png(figure, page))
    return out


def _panel_pages(res: Results, groups: Sequence[Group], path: str | Path):
    """For each page of ``groups``' defence x attack grid: its number, the page count, its
    panels (one per aggregator and scenario, in first-seen order), its attacks and its path."""
    panels = partition(groups, lambda k: (k.aggregator, k.scenario))
    attacks = [a for a in res.attacks() if any(g.key.attack == a for g in groups)]
    pages = sheets(list(dict.fromkeys(aggregator for aggregator, _ in panels)), attacks)
    for number, ((defences, shown), page) in enumerate(zip(pages, page_paths(path, len(pages))), start=1):
        kept = {key: [g for g in members if g.key.attack in shown]
                for key, members in panels.items() if key[0] in defences}
        yield number, len(pages), defences, shown, {k: v for k, v in kept.items() if v}, page


def _grid_of(figure: Figure, count: int, width: float, height: float, **shared) -> list[Axes]:
    columns = min(3, count)
    rows = math.ceil(count / columns)
    figure.set_size_inches(width * columns + 2.2, height * rows + 0.9)
    axes = list(figure.subplots(rows, columns, squeeze=False, **shared).flat)
    for ax in axes[count:]:
        ax.set_visible(False)
    return axes


def accuracy_curves(records: Sequence[dict], path: str | Path) -> list[Path]:
    """One panel per aggregator (and scenario), one line per attack: accuracy per round; a
    big grid on several pages."""
    res = Results(records)
    out = []
    for number, count, defences, attacks, panels, page in _panel_pages(res, res.grid, path):
        figure = new_figure(1, 1)
        axes = _grid_of(figure, len(panels), 4.2, 3.2, sharey=True)
        colours = palette(attacks)
        for i, (ax, ((aggregator, scenario), groups)) in enumerate(zip(axes, panels.items())):
            for group in groups:
                curve = group.curve
                clean = group.key.attack == CLEAN  # wide and underneath: visible where lines overlap
                ax.plot(range(len(curve)), [res.metric.scale * a for a in curve], label=group.key.attack,
                        color=colours[group.key.attack], linewidth=3 if clean else 1.5,
                        zorder=1 if clean else 2)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set(title=res.label(aggregator, scenario), xlabel="round",
                   ylabel=res.metric.axis if i % 3 == 0 else "")
            ax.grid(alpha=0.3)
        lines = {line.get_label(): line for ax in axes for line in ax.get_lines()}
        figure.legend(lines.values(), lines.keys(), title="attack", loc="outside right upper")
        figure.suptitle(sheet_title(f"Test {res.metric.name} per round, mean over seeds", number, count, defences,
                                    attacks))
        out.append(save_png(figure, page))
    return out


def _point(res: Results, group: Group) -> tuple[float, float] | None:
    """(best detector's mean AUC, damage: pp, or nats for text) of ``group``, if both are known."""
    damage = res.damage(group)
    if damage is None or group.detection is None:
        return None
    return group.detection.auc, res.metric.scale * damage


def _damage_axes(figure: Figure, title: str, res: Results) -> Axes:
    ax = figure.add_subplot()
    ax.axvline(STEALTH_AUC, color="grey", linestyle="--", label=f"AUC {STEALTH_AUC}")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set(xlim=(-0.02, 1.02), title=title, xlabel="best detector AUC (mean over seeds)",
           ylabel=f"damage ({res.metric.damage_is}, {res.metric.unit})")
    ax.grid(alpha=0.3)
    return ax


def damage_vs_detectability(records: Sequence[dict], path: str | Path) -> list[Path]:
    """Each attacked (aggregator, attack): damage against its best detector's AUC, one panel
    per defence, one marker colour per attack (a legend, no labels to overlap); a big grid on
    several pages, on one damage scale."""
    res = Results(records)
    attacked = [g for g in res.grid if g.key.attack != CLEAN and _point(res, g)]
    if not attacked:
        return []
    top = max(_point(res, g)[1] for g in attacked)
    bottom = min(0.0, min(_point(res, g)[1] for g in attacked))
    markers = "osD^vP*Xhp<>"
    out = []
    for number, count, defences, attacks, panels, page in _panel_pages(res, attacked, path):
        figure = new_figure(1, 1)
        axes = _grid_of(figure, len(panels), 4.2, 3.4)
        figure.suptitle(sheet_title("Damage vs detectability per defence (upper left: harmful and stealthy)",
                                    number, count, defences, attacks))
        colours = palette(attacks)
        for i, (ax, ((aggregator, scenario), groups)) in enumerate(zip(axes, panels.items())):
            ax.axvline(STEALTH_AUC, color="grey", linestyle="--")
            ax.axhline(0, color="grey", linewidth=0.8)
            pad = 0.05 * (top - bottom) or 1.0
            ax.set(xlim=(-0.02, 1.02), ylim=(bottom - pad, top + pad), title=res.label(aggregator, scenario))
            ax.title.set_fontsize(9)
            ax.grid(alpha=0.3)
            if i % 3 == 0:
                ax.set_ylabel(f"damage ({res.metric.unit})")
            if i >= len(panels) - 3:
                ax.set_xlabel("best detector AUC")
            for group in groups:
                j = attacks.index(group.key.attack)
                ax.scatter(*_point(res, group), color=colours[group.key.attack], marker=markers[j % len(markers)],
                           s=45, zorder=3, label=group.key.attack)
        handles = {h.get_label(): h for ax in figure.axes for h in ax.collections}
        figure.legend(handles.values(), handles.keys(), title="attack", loc="outside right upper", fontsize=8)
        out.append(save_png(figure, page))
    return out


def stealth_frontier(records: Sequence[dict], path: str | Path) -> list[Path]:
    """Sweep records: damage against best AUC, one line per swept attack and aggregator,
    each point marked with its parameter value."""
    res = Results(records)
    lines = {}
    for (attack, param, aggregator, scenario), groups in partition(
        res.sweeps, lambda k: (k.sweep[0], k.sweep[1], k.aggregator, k.scenario)
    ).items():
        points = sorted((g.key.sweep[2], p) for g in groups if (p := _point(res, g)))
        if points:
            lines[res.label(f"{attack} / {aggregator}", scenario)] = (param, points)
    if not lines:
        return []
    figure = new_figure(8, 5.5)
    ax = _damage_axes(figure, "Stealth frontier: damage vs detectability along each sweep", res)
    for label, (param, points) in lines.items():
        ax.plot(*zip(*(p for _, p in points)), marker="o", label=label)
        for value, point in points:
            ax.annotate(f"{param}={format_value(value)}", point, textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.legend(title="attack / aggregator", loc="best", fontsize=8)
    return [save_png(figure, path)]


ALL = (heatmap, accuracy_curves, damage_vs_detectability, stealth_frontier, accuracy_vs_time, bytes_frontier)
