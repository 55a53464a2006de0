"""The report's Tuning section: what ``robust bench --tune`` tried and chose
(``evaluation.bench.tune``, whose ``DIR/tune.json`` it reads)."""

from __future__ import annotations

from pathlib import Path

from evaluation.bench.tune import read_tuning

from .objective import ACCURACY, LOSS
from .tables import table


def tune_section(out_dir: str | Path) -> list[str]:
    """Every tuned rule's candidates, their worst case and worst attack, the choice beside the
    spec as written; nothing where the run was not tuned."""
    report = read_tuning(Path(out_dir))
    if report is None:
        return []
    seeds = ", ".join(map(str, report["seeds"]))
    lines = ["## Tuning", "",
             f"Each rule's hyperparameters were chosen by their worst case: the lowest final accuracy (%) over the "
             f"attacks (a text set: the highest held-out loss), averaged over the validation seeds {seeds}, never the "
             f"seeds of the tables above, which use the chosen specs. {report['seconds']:.0f} s of a "
             f"{report['budget_s']:.0f} s budget.", ""]
    for rule, entry in report["rules"].items():
        written, chosen = entry["candidates"][0]["label"], entry["chosen"]
        if len(entry["candidates"]) == 1:
            lines += [f"`{rule}`: nothing to tune", ""]
            continue
        lines += [f"`{rule}`: " + ("kept as written" if chosen == written else f"**`{chosen}`** chosen"), ""]
        rows = [_row(c, written, chosen) for c in entry["candidates"]]
        lines += table(("candidate", "worst case", "worst attack", "seconds"), rows)
    return lines


def _row(c: dict, written: str, chosen: str) -> tuple[str, str, str, str]:
    """A candidate's row: its label (marked as written, chosen), worst case, worst attack, seconds."""
    label = f"`{c['label']}`" + (" (as written)" if c["label"] == written else "") + (" **chosen**" if c["label"] == chosen else "")
    if not c["ran"]:
        return label, "not run (budget)", "—", "—"
    metric = ACCURACY if c.get("higher_is_better", True) else LOSS  # a tune.json from before the field: accuracy
    return label, metric.show(c["worst"]), f"`{c['worst_attack']}`", f"{c['seconds']:.0f}"
