"""``robust field --config FILE --out DIR``: every cell of a scenario played in the field lab.

Before anything starts it refuses, in one line, a machine that cannot hold the lab (no root, no
namespaces) and a cell it cannot play as its scenario says; it removes what a killed lab left
behind (``robust-field-*`` namespaces and CPU groups whose lab is gone). Each cell's record goes
to ``DIR/results.jsonl`` as it ends (a re-run skips the cells already there); a table follows,
or with ``--json`` one JSON line per cell: ``time_to_target``, ``predicted_time_to_target``,
``rounds_to_target``, ``bytes_up_to_target``, ``final_accuracy``, ``lost``, ``crashes`` and the
``calibration`` the prediction used (the scenario's key: ``--set calibration='"FILE"'``).
``--calibrate FILE`` writes a calibration from the cells' observations
(``evaluation.simtime.calibration``: a synchronous scenario with unshaped links).
Ctrl-C and SIGTERM stop the cell in play and remove its namespaces and groups.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from nodes import launch

from evaluation.bench.scenario import cell_id, cells, load_scenario
from evaluation.reports.summary import read_results
from evaluation.simtime.calibration import measure

from . import cpu, netns
from .figure import plot
from .lab import refusal, run_cell

LINE = ("aggregator", "attack", "seed", "time_to_target", "predicted_time_to_target", "rounds_to_target",
        "bytes_up_to_target", "final_accuracy", "lost", "crashes", "calibration")


def main(args: argparse.Namespace) -> int:
    launch.stop_on_sigterm()
    if args.cpu <= 0:
        raise ValueError(f"--cpu must be above 0 (got {args.cpu:g}): a volunteer's share of one CPU")
    reason = netns.refusal()
    if reason:
        raise ValueError(reason)
    stale = netns.remove_stale()  # first: a scenario refused below still clears what a killed lab left
    cpu.remove_groups(netns.is_stale)
    if stale:
        print(f"removed {len(stale)} namespace(s) a stopped lab left behind: {', '.join(stale)}", file=sys.stderr)
    scenario = load_scenario(args.config, args.set or [], "field")
    todo = cells(scenario)
    for cell in todo:
        if (why := refusal(cell, args.cpu)) is not None:
            raise ValueError(why)
        if args.calibrate and (cell.config.get("link") != "none" or cell.config.get("round") == "async"):
            raise ValueError("--calibrate measures what Flower and the coordinator add: give it a synchronous "
                             "scenario with unshaped links (link = \"none\", round = \"sync\")")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {r["cell"]: r for r in read_results(results)} if results.exists() else {}
    records = []
    for k, cell in enumerate(todo, start=1):
        key = f"field-{cell_id(cell)}"
        if key in done:
            records.append(done[key])
            continue
        print(f"cell {k}/{len(todo)}: {cell.aggregator} vs {cell.attack}, seed {cell.seed}, "
              f"{cell.config['nodes']} volunteers in their namespaces ...", file=sys.stderr, flush=True)
        record = {"cell": key, **run_cell(cell, out / "federations", args.cpu)}
        with results.open("a") as sink:
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
        records.append(record)
    if args.calibrate:
        calibration = measure([r["observed"] for r in records], f"robust field --config {args.config}: "
                              f"{len(records)} cell(s), {platform.node()}, {time.strftime('%Y-%m-%d')}")
        calibration.save(Path(args.calibrate))
        print(f"calibration written to {args.calibrate}: a task adds {statistics.median(calibration.task_seconds):.2f} s "
              f"(median of {len(calibration.task_seconds)}), a round {calibration.collect_seconds + calibration.between_seconds:.2f} s, "
              f"the start {calibration.start_seconds:.2f} s; the wire carries {calibration.wire_up:.3f}x the bytes up, "
              f"{calibration.wire_down:.3f}x down", file=sys.stderr)
    picture = plot(records, out / "field.png")
    if picture:
        print(f"picture: {picture}", file=sys.stderr)
    if args.json:
        for r in records:
            print(json.dumps({**{k: r.get(k) for k in LINE}, "calibration": r["config"].get("calibration") or None}))
    else:
        print_table(records)
    return 0


def print_table(records: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="robust field: time to target on shaped links")
    for head in ("defence", "attack", "seed", "rounds", "time (s)", "predicted (s)", "MB up", "final acc", "lost", "crashes"):
        table.add_column(head, justify="left" if head in ("defence", "attack") else "right")
    for r in records:
        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)
        table.add_row(r["aggregator"], r["attack"], str(r["seed"]), num(r["rounds_to_target"], "d"),
                      num(r["time_to_target"], ".1f"), num(r.get("predicted_time_to_target"), ".1f"),
                      num(None if r["bytes_up_to_target"] is None else r["bytes_up_to_target"] / 1e6, ".2f"),
                      f"{100 * r['final_accuracy']:.1f}%", str(r["lost"]), str(r["crashes"]))
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for every column
        console = Console(width=140)
    console.print(table)
