"""``robust coordinator status DIR``: a run at a glance, from its folder alone; and the live bar
that long work (``robust bench`` cells, ``robust coordinator start`` rounds) shows at a terminal.

The status only reads the folder (the coordinator may be writing it, or may have died):
``coordinator.toml`` (the rounds planned), the admission list, ``rounds.jsonl``,
``result.json`` and ``failed.txt``. The round log holds the rest: each record names the
round's accepted, rejected, failed and flagged nodes, the nodes quarantined so far and the ones
convicted in it. A line cut short (being written, or by a crash) is left out, as the next
start of the coordinator drops it. The run is *running* while its SuperLink answers on its
port, as ``robust coordinator admit`` judges it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from .. import checkpoint, launch
from ..settings import Settings, coordinator_folder
from .admission import scan, short

RECENT, REJECTIONS, SPARK_WIDTH = 8, 5, 40  # accuracies listed, rejections listed, rounds in the sparkline
SPARKS = "▁▂▃▄▅▆▇█"
STYLES = {"running": "bold green", "finished": "bold blue", "failed": "bold red", "stopped": "bold yellow"}


def live_bar(unit: str, stderr: bool = False, transient: bool = False) -> Progress:
    """A bar on stdout (``stderr``: on stderr) of ``unit`` done out of the total, the time left
    and the latest result (the task's ``last`` field), for a person at a terminal; ``transient``:
    it goes when stopped, leaving only the lines printed meanwhile. When the stream is a file or
    a pipe (a log, a test) it renders nothing (its ``disable`` is set): the caller prints plain
    lines there."""
    console = Console(stderr=stderr)
    return Progress(BarColumn(), MofNCompleteColumn(), TextColumn(unit), TimeRemainingColumn(),
                    TextColumn("{task.fields[last]}", markup=False), console=console, transient=transient,
                    disable=not console.is_terminal, speed_estimate_period=24 * 3600.0,  # rate over the whole run
                    redirect_stdout=not stderr, redirect_stderr=stderr)  # the other stream may be a pipe: leave it


def read_rounds(folder: Path) -> list[dict]:
    """The records of ``folder``'s round log, without a last line cut short; never writes."""
    path = folder / checkpoint.ROUNDS
    records = []
    for number, line in enumerate(checkpoint.logged_lines(folder).decode(errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
            if record["round"] != number:
                raise ValueError(f"round {record['round']} on line {number}")
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} line {number} is not a round record ({err}): the log was changed or damaged; "
                             f"`robust audit verify {folder}` checks it") from None
        records.append(record)
    return records


def _accuracy(log: list[dict]) -> dict:
    points = [(r["round"], r["accuracy"]) for r in log if r["accuracy"] is not None]
    best = max(points, key=lambda p: p[1], default=(None, None))
    return {"first": points[0][1] if points else None, "best": best[1], "best_round": best[0],
            "last": points[-1][1] if points else None, "recent": [list(p) for p in points[-RECENT:]],
            "trend": [r["accuracy"] for r in log[-SPARK_WIDTH:]]}


def run_state(folder: Path, settings: Settings) -> tuple[str, dict]:
    """The run's state and what goes with it: the result when finished, the reason when failed."""
    if (folder / checkpoint.RESULT).exists():
        result = json.loads((folder / checkpoint.RESULT).read_text())
        return "finished", {"model_sha256": result["model_sha256"], "final_accuracy": result["final_accuracy"]}
    if (folder / checkpoint.FAILED).exists():
        return "failed", {"failure": (folder / checkpoint.FAILED).read_text().strip()}
    return ("running" if launch.answers(settings.port) else "stopped"), {}


def read(folder: Path) -> dict:
    """The status of the coordinator folder ``folder`` (or a demo's root: :func:`coordinator_folder`),
    JSON-ready; ``ValueError`` saying what to do when it is not one."""
    folder = coordinator_folder(folder)
    settings = Settings.read(folder)
    log = read_rounds(folder)
    last = log[-1] if log else {"seconds": None, "ids": [], "rejected": {}, "failed": {}}
    state, outcome = run_state(folder, settings)
    quarantined: dict[str, int] = {}
    why: dict[str, str] = {}  # what quarantined each node: flags, evidence or a conviction
    for record in log:
        for fp in record["quarantined"]:
            quarantined.setdefault(short(fp), record["round"])
        for fp, reason in record.get("why", {}).items():
            why.setdefault(short(fp), reason)
    rounds_file = folder / checkpoint.ROUNDS
    return {
        "folder": str(folder), "state": state, "round": len(log), "rounds": settings.rounds,
        "aggregator": settings.aggregator, "tolerate": settings.tolerate,
        "skipped": sum(1 for r in log if r["skipped"]),
        "last_round_seconds": last["seconds"],
        "updated_seconds_ago": round(time.time() - rounds_file.stat().st_mtime, 1) if log else None,
        "accuracy": _accuracy(log),
        "nodes": {
            "admitted": sorted(short(fp) for fp in scan(folder)[0]),
            "online": sorted(short(fp) for fp in [*last["ids"], *last["rejected"], *last["failed"]]),  # replied
            "flagged": dict(sorted(Counter(short(fp) for r in log for fp in r["flagged"]).items())),
            "quarantined": dict(sorted(quarantined.items())),
            "quarantined_by": dict(sorted(why.items())),
            "convicted": {short(fp): r["round"] for r in log for fp in r["convicted"]},
        },
        "rejections": [{"round": r["round"], "node": short(fp), "reason": reason}
                       for r in reversed(log) for fp, reason in r["rejected"].items()][:REJECTIONS],
        **outcome,
    }


def sparkline(values: list[float | None]) -> str:
    """One block per value, from the lowest (▁) to the highest (█); a gap for a missing one."""
    known = [v for v in values if v is not None]
    low, span = min(known, default=0.0), (max(known, default=0.0) - min(known, default=0.0)) or 1.0
    return "".join(" " if v is None else SPARKS[round((v - low) / span * (len(SPARKS) - 1))] for v in values)


def _headline(status: dict) -> Text:
    said = {"running": "running (its SuperLink answers)", "finished": "finished", "failed": "failed",
            "stopped": "not running" if status["round"] else "not started"}[status["state"]]
    return Text.assemble((f"coordinator {status['folder']}: ", "bold"), (said, STYLES[status["state"]]))


def render(status: dict) -> Group:
    """``status`` (from :func:`read`) as rich renderables, to read at a glance."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    done, planned = status["round"], status["rounds"]
    timing = "" if status["updated_seconds_ago"] is None else (
        f"  (last round took {status['last_round_seconds']:.1f} s, recorded {status['updated_seconds_ago']:.0f} s ago)")
    skipped = f", {status['skipped']} without a step" if status["skipped"] else ""
    grid.add_row("progress", Text(f"round {done}/{planned}{skipped}{timing}"))
    grid.add_row("rule", Text(f"{status['aggregator']} (f={status['tolerate']})"))
    acc = status["accuracy"]
    if acc["last"] is not None:
        recent = "  ".join(f"{r}: {a:.3f}" for r, a in acc["recent"])
        grid.add_row("accuracy", Text.assemble((sparkline(acc["trend"]), "cyan"),
                                               f"  first {acc['first']:.3f}, best {acc['best']:.3f} (round "
                                               f"{acc['best_round']}), last {acc['last']:.3f}"))
        grid.add_row("", Text(recent, style="dim"))
    nodes = status["nodes"]
    grid.add_row("nodes", Text(f"{len(nodes['admitted'])} admitted, {len(nodes['online'])} replied in round {done}, "
                               f"{len(nodes['flagged'])} flagged, {len(nodes['quarantined'])} quarantined, "
                               f"{len(nodes['convicted'])} convicted"))
    by = nodes["quarantined_by"]
    for name, said, style in (("flagged", "{} x{}", "yellow"), ("quarantined", "{} (round {}{})", "red"),
                              ("convicted", "{} (round {})", "bold red")):
        if nodes[name]:
            grid.add_row(name, Text(", ".join(said.format(fp, n, f", {by[fp]}" if fp in by else "")
                                              for fp, n in nodes[name].items()), style=style))
    if "model_sha256" in status:
        grid.add_row("result", Text(f"final accuracy {status['final_accuracy']:.4f}, model SHA-256 {status['model_sha256']}"))
    if "failure" in status:
        grid.add_row("failure", Text(status["failure"], style="red"))
    if status["state"] in ("stopped", "failed"):
        grid.add_row("next", Text(f"`robust coordinator start {status['folder']}` "
                                  + (f"resumes after round {done}" if done else "starts it")))
    parts = [_headline(status), grid]
    if status["rejections"]:
        table = Table(title="latest rejections", title_justify="left", title_style="bold")
        for column in ("round", "node", "reason"):
            table.add_column(column, overflow="fold")
        for item in status["rejections"]:
            table.add_row(str(item["round"]), item["node"], Text(item["reason"]))
        parts.append(table)
    return Group(*parts)


def main(folder: Path, as_json: bool) -> int:
    status = read(folder)
    if as_json:
        print(json.dumps(status))
    else:
        Console(highlight=False).print(render(status))
    return 0
