"""``robust bench``: run a scenario grid, append each finished cell to ``DIR/results.jsonl``,
then write the report (``summary.md`` and plots) into ``DIR``.

Ctrl-C safe: a cell's record is written (and flushed to disk) the moment it finishes, so an
interrupted run loses only the cells in flight; running the same command again skips every
cell already in ``results.jsonl``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import sys
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from nodes.coordinator.status import live_bar
from robust.allocator import reuse_freed_memory

from .cell import Cell
from evaluation.bench.drivers.inprocess import run_cell
from evaluation.reports.objective import is_text
from evaluation.reports.summary import read_results, write_report
from .scenario import cell_id, cells, load_scenario
from .tune import tune
from evaluation.peers.per_node_loop import median, paired_speed


ENGINES_SAID = {
    "local": "local driver (vectorised)", "per-node": "local driver, per node (as volunteers compute)",
    "flower": "Flower simulation (Ray), the coordinator's own ServerApp and ClientApp",
    "deploy": "real processes on loopback: SuperLink, one SuperNode per node, TLS, signed updates",
}


def record_id(cell: Cell, engine: str) -> str:
    """The id a finished cell has in results.jsonl: engines other than the default are apart,
    so running another engine into the same DIR does not skip its cells."""
    return cell_id(cell) if engine == "local" else f"{cell_id(cell)}-{engine}"


def run_one(cell: Cell, engine: str) -> dict:
    reuse_freed_memory()  # in whichever process runs the cell: this one, a --jobs worker, a Ray node's
    record = run_cell(cell, vectorize=engine == "local")
    return {"cell": record_id(cell, engine), **record}


class Progress:
    """Cells done on stderr: at a terminal a live bar (done/total, time left, the last cell's
    result, and on a cluster the cells each node has done); in a log or a pipe one plain line
    per finished cell."""

    def __init__(self, total: int, done: int) -> None:
        self.bar = live_bar("cells", stderr=True)
        self.task = self.bar.add_task("", total=total, completed=done, last="")
        self.nodes: Counter[str] = Counter()

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    @property
    def done(self) -> int:
        return int(self.bar.tasks[0].completed)

    def update(self, record: dict, node: str | None = None) -> None:
        text = is_text(record) and record.get("final_loss") is not None  # ranked by held-out loss
        last = (f"{record['aggregator']} vs {record['attack']} seed {record['seed']}: "
                + (f"held-out loss {record['final_loss']:.3f}" if text
                   else f"accuracy {100 * record['final_accuracy']:.1f}%"))
        if node is not None:
            self.nodes[node] += 1
            last += " | per node: " + ", ".join(f"{name} {count}" for name, count in sorted(self.nodes.items()))
        self.bar.update(self.task, advance=1, last=last)
        if self.bar.disable:
            print(f"{self.done}/{self.bar.tasks[0].total:.0f} cells | {last}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1 (got {args.jobs})")
    engine = "per-node" if args.no_vectorize else args.engine
    if engine in ("flower", "deploy") and args.jobs > 1:
        raise ValueError(f"--engine {engine} runs one cell at a time on every core: drop --jobs")
    if args.cluster:
        from .ray_cluster import address

        address(args.cluster)  # a bad one is refused before any cell runs
    if args.cluster and (engine in ("flower", "deploy") or args.jobs > 1):
        raise ValueError("--cluster runs cells of --engine local, one per CPU of the cluster: "
                         f"drop {'--jobs' if args.jobs > 1 else '--engine ' + engine}")
    if args.no_vectorize and args.engine != "local":
        raise ValueError(f"--no-vectorize is a mode of --engine local: drop it with --engine {args.engine}")
    scenario = load_scenario(args.config, [*(args.set or []), *([f"code={json.dumps(args.path)}"] if args.path else [])], engine)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    play = Player(args, engine)
    try:
        if args.tune:
            if args.sweep or engine != "local" or args.cluster:
                raise ValueError("--tune chooses rules on the local driver's grid: drop --sweep, --engine and --cluster")
            chosen = tune(scenario, cells, play, out, args.tune_seeds, args.tune_budget)
            todo_all = list({cell_id(c): c for keys in chosen.values() for c in cells({**scenario, **keys})}.values())
        else:
            todo_all = cells(scenario, args.sweep, args.sweep_points)
        play(todo_all, out / "results.jsonl")
    except KeyboardInterrupt:
        return 130
    if args.speed:
        write_speed(out / "speed.json", todo_all[0].config)
    paths = write_report(out / "results.jsonl", out)
    print(f"report: {out / 'summary.md'} (a page: {out / 'summary.html'}; {len(paths)} files in {out})")
    return 0


class Player:
    """Runs cells into a results file: the ones not yet in it, each record appended (flushed to
    disk) the moment its cell finishes, with a progress bar; returns the file's records. Ctrl-C
    says what is saved and raises ``KeyboardInterrupt``."""

    def __init__(self, args: argparse.Namespace, engine: str) -> None:
        self.args, self.engine = args, engine

    def __call__(self, todo_all: list[Cell], results: Path) -> list[dict]:
        args, engine = self.args, self.engine
        results.parent.mkdir(parents=True, exist_ok=True)
        finished = {r["cell"] for r in read_results(results)} if results.exists() else set()
        todo = [c for c in todo_all if record_id(c, engine) not in finished]
        print(
            f"robust bench: {len(todo_all)} cells ({len(todo_all) - len(todo)} already in {results}), "
            f"{f'Ray cluster ({args.cluster})' if args.cluster else f'{args.jobs} job(s)'}, {ENGINES_SAID[engine]}",
            file=sys.stderr,
        )
        progress = Progress(len(todo_all), len(todo_all) - len(todo))
        if results.exists() and results.stat().st_size and not results.read_bytes().endswith(b"\n"):
            with results.open("a") as sink:  # a killed run's cut-short line ends here, not in ours
                sink.write("\n")
        with results.open("a") as sink:

            def save(record: dict, node: str | None = None) -> None:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                os.fsync(sink.fileno())
                progress.update(record, node)

            try:
                with progress:
                    self.run(todo, results.parent, save)
            except KeyboardInterrupt:
                print(
                    f"\ninterrupted: {progress.done} of {len(todo_all)} cells are saved in {results}; "
                    "run the same command again to finish the rest",
                    file=sys.stderr,
                )
                raise
        return read_results(results)

    def run(self, todo: list[Cell], folder: Path, save) -> None:
        args, engine = self.args, self.engine
        if engine in ("flower", "deploy"):  # imported when used: flower_sim imports Flower and Ray
            driver = importlib.import_module(f"evaluation.bench.drivers.{'flower_sim' if engine == 'flower' else 'deploy'}")
            driver.run_cells(todo, folder / "federations",
                             lambda cell, record: save({"cell": record_id(cell, engine), **record}))
        elif args.cluster:
            from .ray_cluster import run_cells

            run_cells(todo, engine, args.cluster, run_one, save)
        elif args.jobs == 1:
            for cell in todo:
                save(run_one(cell, engine))
        else:
            _run_parallel(todo, args.jobs, engine, save)


def write_speed(path: Path, config: dict) -> None:
    """The engine's speed against the plain per-node loop on the first scenario: the training
    phase timed alternately with the loop (``evaluation.peers.per_node_loop.paired_speed``), and whole
    rounds (median over this DIR's cells) against the loop's rate."""
    records = [r for r in read_results(path.parent / "results.jsonl") if r.get("train_node_steps_per_s")]
    if not records:
        return
    speed = paired_speed(config)
    plain, training = speed["plain_loop_node_steps_per_s"], speed["engine_training_node_steps_per_s"]
    whole = median([r["node_steps_per_s"] for r in records])
    speed.update(engine_node_steps_per_s=whole, speedup=whole / plain)
    path.write_text(json.dumps(speed, indent=1) + "\n")
    print(
        f"speed: training {training:.0f} node-steps/s, {speed['training_speedup']:.1f}x a plain per-node loop "
        f"({plain:.0f}, same scenario, timed alternately); whole rounds with attack, robust rule, "
        f"detectors and evaluation {whole:.0f} ({whole / plain:.1f}x)"
    )


def _run_parallel(todo: list[Cell], jobs: int, engine: str, save) -> None:
    context = multiprocessing.get_context("spawn")  # no forked torch thread pools
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        pending = {pool.submit(run_one, cell, engine) for cell in todo}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    save(future.result())
        except KeyboardInterrupt:
            for future in pending:
                future.cancel()
            raise
