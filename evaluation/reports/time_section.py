"""The report's time and bytes: what slow, vanishing, far-away volunteers cost (issue 11).

Every local cell records its simulated clock (``evaluation.simtime.timeline``): the time of each
round (``times``), the bytes sent up and down to then (``bytes``, ``bytes_down_by_round``),
and in total ``sim_seconds``, ``bytes_up``, ``bytes_down``. Time to target is the first
simulated second at which a cell's accuracy reaches its bar (``evaluation.reports.target_costs``: ``target``
x the best clean final accuracy of its task, or an absolute ``target-accuracy``; for text, its
held-out loss falls to its bar: ``evaluation.reports.objective``), so every round mode, codec and
speed is measured against one bar.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from .canvas import new_figure, palette, save_png
from .paging import attack_family, page_paths, pages
from .results import CLEAN, Group, Results
from .tables import num, show, table
from .target_costs import KEYS, mean_over_seeds


def timed(res: Results) -> bool:
    """Whether the run has a clock worth reporting: some cell not synchronous, uncompressed,
    uniform and link-free."""
    defaults = {"round": "sync", "compression": "none", "downlink": "none", "speed": "uniform", "link": "none",
                "churn": "none", "deadline": 0.0}
    return any("times" in r and any(r["config"].get(k, v) != v for k, v in defaults.items()) for r in res.records)


def _label(group: Group, varying: Sequence[str]) -> str:
    """The group's volunteer keys that differ across the run (its round mode, codec, speed...)."""
    config = dict(group.key.scenario)
    shown = [f"{k}={show(json.loads(config[k]))}" for k in KEYS if k in config and k in varying]
    return ", ".join(shown) or "—"


def time_section(res: Results) -> list[str]:
    """The summary's "Time and bytes" section (nothing when :func:`timed` says no)."""
    if not timed(res):
        return []
    rows = []
    for group in sorted(res.grid, key=lambda g: (g.key.aggregator, g.key.attack != CLEAN, g.key.attack)):
        if "times" not in group.records[0]:
            continue
        ttt = mean_over_seeds([r["time_to_target"] for r in group.records])
        rows.append([group.key.aggregator, group.key.attack, _label(group, res.varying), res.metric.show(group.mean),
                     num(statistics.fmean(r["sim_seconds"] for r in group.records)),
                     "never" if ttt is None else num(ttt),
                     f"{statistics.fmean(r['bytes_up'] for r in group.records) / 1e6:.2f}",
                     f"{statistics.fmean(r['bytes_down'] for r in group.records) / 1e6:.2f}"])
    return [
        "## Time and bytes", "",
        "Simulated clock (speed, link, churn; `step-seconds` per local step). Time to target: first simulated "
        f"second at which {res.metric.target_is} (mean over seeds; never if a seed never did). Bytes: the "
        "encoded replies (up) and the float32 models (down), MB, mean over seeds. Asynchronous cells aggregate as many replies as their "
        "synchronous twin.", "",
        *table(["aggregator", "attack", "volunteers", res.metric.axis, "sim seconds", "time to target",
                 "MB up", "MB down"], rows),
        "",
    ]


def accuracy_vs_time(records: Sequence[dict], path: str | Path) -> list[Path]:
    """Per attack, accuracy against simulated time (top) and against bytes sent up (bottom),
    one line per round mode / codec / volunteers (mean over seeds; asynchronous dashed); many
    attacks on several pages."""
    res = Results(records)
    if not timed(res):
        return []
    labels = sorted({f"{g.key.aggregator}: {_label(g, res.varying)}" for g in res.grid})
    colours = palette(labels)
    columns = pages(res.attacks(), attack_family, limit=6)
    out = []
    for number, (attacks, page) in enumerate(zip(columns, page_paths(path, len(columns))), start=1):
        figure = new_figure(4.2 * len(attacks) + 2.5, 6.8)
        axes = figure.subplots(2, len(attacks), squeeze=False)
        for column, attack in enumerate(attacks):
            for group in (g for g in res.grid if g.key.attack == attack and "times" in g.records[0]):
                label = f"{group.key.aggregator}: {_label(group, res.varying)}"
                times = [statistics.fmean(t) for t in zip(*(r["times"] for r in group.records))]
                sent = [statistics.fmean(b) / 1e6 for b in zip(*(r["bytes"] for r in group.records))]
                curve = [res.metric.scale * a for a in group.curve][: len(times)]
                style = {"label": label, "color": colours[label],
                         "linestyle": "--" if '"async"' in dict(group.key.scenario).get("round", "") else "-"}
                axes[0][column].plot(times[: len(curve)], curve, **style)
                axes[1][column].plot(sent[: len(curve)], curve, **style)
            ylabel = res.metric.axis if column == 0 else ""
            axes[0][column].set(title=attack, xlabel="simulated seconds", ylabel=ylabel)
            axes[1][column].set(xlabel="MB sent up", xscale="log", ylabel=ylabel)
            for ax in (axes[0][column], axes[1][column]):
                ax.grid(alpha=0.3)
        lines = {line.get_label(): line for ax in axes.flat for line in ax.get_lines()}
        figure.legend(lines.values(), lines.keys(), title="defence: volunteers", loc="outside right upper",
                      fontsize="small")
        more = f" (page {number} of {len(columns)})" if len(columns) > 1 else ""
        figure.suptitle(f"{res.metric.name.capitalize()} against simulated time and bytes, mean over seeds{more}")
        out.append(save_png(figure, page))
    return out
