"""The field lab's picture: each cell's rounds as deployed (wall seconds) beside the calibrated
clock's prediction of the same rounds, accuracy against time, the target as a line."""

from __future__ import annotations

import json
from pathlib import Path

from evaluation.reports.canvas import new_figure, save_png


def label(record: dict, records: list[dict]) -> str:
    """What tells ``record`` apart from the other cells: the scenario keys whose values differ."""
    keys = sorted({k for r in records for k in r["config"]})
    differ = [k for k in keys if len({json.dumps(r["config"].get(k)) for r in records}) > 1 and k != "calibration"]
    return ", ".join(f"{k}={record['config'].get(k)}" for k in differ) or record["aggregator"]


def plot(records: list[dict], path: Path) -> Path | None:
    """Accuracy against seconds, deployed (solid) and predicted (dashed), one colour a cell;
    ``None`` when no record holds rounds."""
    records = [r for r in records if r.get("times")]
    if not records:
        return None
    figure = new_figure(7.5, 4.2)
    axes = figure.add_subplot()
    for k, r in enumerate(records):
        colour = f"C{k}"
        axes.plot(r["times"], [100 * a for a in r["accuracy"]], "o-", color=colour, label=f"{label(r, records)}: deployed")
        if r.get("predicted_times"):
            axes.plot(r["predicted_times"], [100 * a for a in r["accuracy"][: len(r["predicted_times"])]], "x--",
                      color=colour, label="predicted")
    axes.axhline(100 * records[0]["target_accuracy"], color="grey", linewidth=0.8)
    axes.set_xlabel("seconds since the run was submitted")
    axes.set_ylabel("test accuracy (%)")
    axes.set_title("the field lab: deployed (solid) and the calibrated clock's prediction (dashed)")
    axes.legend(fontsize=7, loc="lower right")
    return save_png(figure, path)
