"""``python -m evaluation.large_model``: a model of at least 100M parameters in the bench and in
a deployment on loopback, with its memory measured.

The model is ``gpt-100m`` by default (100,411,648 parameters, a 402 MB float32 row), trained as
a language model trains here (:data:`TEXT`: the standard library's source in windows of 128
bytes, 8 a step, 4 local AdamW steps a round, 8 KB of held-out text evaluated a round);
``--model`` takes a factory of ``examples/large`` too (``bignet:make``, 10.5M; ``hugenet:make``,
100.8M: the user's code, shipped to volunteers as the coordinator's app bundle; digits, 5 local
SGD steps).

- The bench: one cell (``--nodes-bench`` nodes, a fifth Byzantine playing alie against
  nnm+trimmed-mean) through ``evaluation.bench.drivers.inprocess.run_cell``, and the same cell
  with a small model of the same kind as a baseline (``gpt-tiny``, ``mlp``), in this process:
  the peak resident memory each run added (``evaluation.microbench.peak_memory``), as a
  multiple of the model (``d*4`` bytes) and of the round's update matrix (``n*d*4``), wall time
  and final accuracy.
- The deployment: ``robust coordinator start`` (SuperLink, ServerApp) and ``--volunteers``
  volunteers (``robust node join``: SuperNode, a ClientApp process per task, the node's warm
  trainer, a code bundle's own trainer) on loopback, TLS, signed updates. The resident memory
  of each process tree is sampled every half second; the report gives each round's seconds,
  the bytes of a task and of a reply as Flower deflates them for the wire, the final accuracy,
  the peak MB of the coordinator's tree and of each volunteer's, what each of a tree's parts
  held at that tree's peak, and each part's own peak (``VmHWM``). ``--timeline FILE`` writes
  every sample (each tree's parts' resident MB, one JSON line each).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from flwr.app import RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from nodes import checkpoint, commands, launch
from nodes.coordinator import audit
from nodes.coordinator.status import read_rounds
from nodes.settings import Settings
from nodes.wire import Reply, Task, reply_content, task_content
from robust import tls
from robust.user_code import use_path
from robust.data import load
from robust.gpt import is_gpt
from robust.models import build_model, training_defaults
from robust.params import flat_params, sha256

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import run_cell
from evaluation.microbench.peak_memory import peak_extra_bytes
from evaluation.bench.scenario import DEFAULTS, cells, validate
from .stress import processes, robust_cli, tree

CODE = Path(__file__).resolve().parents[2] / "examples" / "large"
MODEL, AGGREGATOR, ATTACK = "gpt-100m", "nnm+trimmed-mean", "alie"
# What each kind of model trains on here: a language model on the standard library's text in
# windows of 128 bytes, 8 a step, with its own defaults (4 local AdamW steps), evaluated each round
# on 8 KB of held-out text (its 32 KB default takes 80 s a round at 100M on one core); the image models
# of ``examples/large`` (the user's code, shipped to volunteers) on digits, 5 local SGD steps.
TEXT = {"dataset": "pystdlib:context=128,eval_bytes=8192", "batch_size": 8}
IMAGES = {"dataset": "digits", "code": str(CODE), "protocol": "delta:steps=5"}
VOLUNTEERS = 3
# seconds a round waits: the nodes are local, only a broken one is late; but 6 volunteers share 2
# cores, and at 100M parameters the alie-local one trains 4 times a round: 398-591 s measured, and
# a 600 s deadline lost its reply twice in 5 rounds
DEADLINE = 1200.0
SAMPLE = 0.5  # seconds between memory samples
MB = 2**20


def trains_with(model: str) -> dict:
    """The settings (by field name) ``model`` trains with here: :data:`TEXT` and the model's
    own defaults for a language model, :data:`IMAGES` for the others."""
    return {**TEXT, **training_defaults(model)} if is_gpt(model) else dict(IMAGES)


def baseline(model: str) -> str:
    """The small model of the same kind whose bench cell is the baseline."""
    return "gpt-tiny" if is_gpt(model) else "mlp"


def model_size(model: str) -> int:
    """Trainable parameters of ``model`` on the data set it trains on here (``d``)."""
    use_path(str(CODE))
    data = load(trains_with(model)["dataset"], seed=0)
    return flat_params(build_model(model, data.shape, data.classes)).numel()


def bench_cell(model: str, nodes: int, rounds: int) -> Cell:
    given = {key.replace("_", "-"): value for key, value in trains_with(model).items()}
    scenario = {**DEFAULTS, **given, "model": model, "nodes": nodes, "byzantine": max(1, nodes // 5),
                "rounds": rounds, "aggregators": [AGGREGATOR], "attacks": [ATTACK]}
    validate(scenario)
    return cells(scenario)[0]


def bench(model: str, nodes: int, rounds: int) -> dict:
    """One cell of ``model`` in this process: peak extra memory, seconds, accuracy."""
    cell, d = bench_cell(model, nodes, rounds), model_size(model)
    start = time.perf_counter()
    record, extra = peak_extra_bytes(lambda: run_cell(cell))
    return {"model": model, "d": d, "nodes": nodes, "byzantine": cell.config["byzantine"], "rounds": rounds,
            "engine": record["engine"], "seconds": round(time.perf_counter() - start, 1),
            "accuracy": record["final_accuracy"], "peak_extra_mb": round(extra / MB, 1),
            "x_model": round(extra / (4 * d), 1), "x_updates": round(extra / (4 * d * nodes), 2)}


def message_bytes(content: RecordDict) -> int:
    """Bytes of ``content`` as Flower pushes it: every object it deflates into (arrays in chunks)."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(content).values())


def wire_sizes(settings: Settings) -> dict:
    """Bytes of round 1's task and of a reply to it, for the model of ``settings``."""
    data = load(settings.dataset, seed=0)
    w = flat_params(build_model(settings.model, data.shape, data.classes, settings.seed))
    task = Task.of(settings, "large-model", 1, sha256(w))
    reply = Reply(run=task.run, round=1, base=task.base, count=1, signature=bytes(64))
    return {"task_bytes": message_bytes(task_content(task, w.numpy())),
            "reply_bytes": message_bytes(reply_content(reply, w.numpy())), "model_bytes": 4 * w.numel()}


# The coordinator's processes whose own peak the report gives: a command-line mark of each.
PARTS = {"cli": "robust.cli coordinator start", "superlink": "bin/flower-superlink",
         "serverapp": "bin/flwr-serverapp"}
# A volunteer's: its supervisor, its SuperNode (and SuperExec), the ClientApp of each task, its
# trainers (the node's and a code bundle's), and the bundle's alone.
VOLUNTEER_PARTS = {"join": "robust.cli node join", "supernode": "bin/flower-supernode",
                   "superexec": "bin/flower-superexec", "clientapp": "bin/flwr-clientapp",
                   "trainers": "nodes.volunteer.trainer", "bundle trainer": "--bundle"}


def part_of(command: str, marks: dict[str, str]) -> str:
    """The last part of ``marks`` whose mark ``command`` holds (a bundle's trainer is a trainer
    too: the more specific mark comes later), else ``other``."""
    return next((part for part, mark in reversed(marks.items()) if mark in command), "other")


class Peaks:
    """The largest resident memory (MB) of each named process tree, sampled in a thread, what
    each of its parts held at that moment (``at_peak``), and the peak (the kernel's high-water
    mark) of each named part of a tree: its processes whose command line holds the part's mark.
    With ``timeline``, every sample's resident MB of each tree's parts, one JSON line each."""

    def __init__(self, timeline: Path | None = None) -> None:
        self.roots: dict[str, int] = {}
        self.marks: dict[str, dict[str, str]] = {}  # tree -> its parts' marks
        self.mb: dict[str, float] = {}
        self.at_peak: dict[str, dict[str, float]] = {}
        self.timeline = timeline
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def watch(self, name: str, pid: int, parts: dict[str, str] | None = None) -> None:
        self.roots[name] = pid
        self.marks[name] = parts or {}

    def _sample(self) -> None:
        out = self.timeline.open("a") if self.timeline else None
        try:
            while not self._stop.wait(SAMPLE):
                self._once(processes(), out)
        finally:
            if out:
                out.close()

    def _once(self, table: dict, out) -> None:
        line = {}
        for name, root in list(self.roots.items()):
            pids = [pid for pid in tree(root, table) if pid in table]
            now: dict[str, float] = {}
            for pid in pids:
                part = part_of(table[pid].command, self.marks[name])
                now[part] = now.get(part, 0.0) + table[pid].rss_kb / 1024
            total = sum(now.values())
            if total > self.mb.get(name, 0.0):
                self.mb[name], self.at_peak[name] = total, {k: round(v, 1) for k, v in sorted(now.items())}
            for part, mark in self.marks[name].items():
                hwm = sum(table[pid].hwm_kb for pid in pids if mark in table[pid].command)
                self.mb[f"{name} {part}"] = max(self.mb.get(f"{name} {part}", 0.0), hwm / 1024)
            line[name] = {k: round(v) for k, v in now.items()}
        if out:
            out.write(json.dumps({"t": round(time.monotonic() - self._start, 1), **line}) + "\n")
            out.flush()

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else f"({path} missing)"


def _wait_submitted(coordinator, log: Path) -> None:
    until = time.monotonic() + 300
    while b" submitted" not in log.read_bytes():
        if coordinator.poll() is not None or time.monotonic() > until:
            raise RuntimeError(f"the coordinator did not submit its run; last lines of {log}:\n{_tail(log)}")
        time.sleep(SAMPLE)


def deploy(root: Path, rounds: int, model: str = MODEL, volunteers: int = VOLUNTEERS, attack: str = "",
           quorum: int = 0, changes: dict | None = None, timeline: Path | None = None) -> dict:
    """A coordinator and ``volunteers`` volunteers training ``model`` on loopback, as users run
    them; the last one plays ``attack`` (none if empty); a round steps on ``quorum`` replies
    (0: all of them); ``changes``: other settings (``nodes.settings``, by field name);
    ``timeline``: a file for every memory sample (:class:`Peaks`)."""
    # every volunteer's task out at once (the auto window keeps 5 at 100M parameters out, and the
    # sixth volunteer would start training only once a reply is in)
    settings = Settings(**{"rounds": rounds, "model": model, **trains_with(model), "aggregator": AGGREGATOR,
                           "tolerate": 1, "quorum": quorum or volunteers, "deadline": DEADLINE,
                           "wait_nodes": DEADLINE, "in_flight": volunteers, "port": launch.free_port(),
                           **(changes or {})})
    coord, folders = commands.local_federation(root, volunteers, settings, "large-model", ("large-model",))
    shipped = coord / launch.CODE_SHA  # a code bundle the volunteers accept: the user's model, when it is one
    trust = ["--trust-code", shipped.read_text().strip()] if shipped.exists() else []
    log, procs = coord / "start.log", []
    start = time.monotonic()
    with Peaks(timeline) as peaks:
        try:
            coordinator = robust_cli(["coordinator", "start", str(coord)], coord, log)
            procs.append(coordinator)
            peaks.watch("coordinator", coordinator.pid, PARTS)
            _wait_submitted(coordinator, log)
            for i, folder in enumerate(folders, start=1):
                plays = ["--attack", attack] if attack and i == volunteers else []
                procs.append(robust_cli(["node", "join", "--coordinator", f"127.0.0.1:{settings.port}", "--ca",
                                         str(coord / "tls" / tls.CA_CERT), "--key", str(folder), "--partition",
                                         f"{i}/{volunteers}", "--data", settings.dataset, "--device", "cpu", *trust, *plays],
                                        folder, folder / "join.log"))
                peaks.watch(f"node{i}", procs[-1].pid, VOLUNTEER_PARTS)
            try:
                code = coordinator.wait(rounds * (DEADLINE + 120) + 300)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the run did not end in time; last lines of {log}:\n{_tail(log)}") from None
        finally:
            for proc in reversed(procs):
                launch.stop(proc)
    if code != 0 or not (coord / checkpoint.RESULT).exists():
        raise RuntimeError(f"the coordinator exited with code {code}; last lines of {log}:\n{_tail(log)}\n"
                           f"volunteers' logs: {root}/node*/join.log")
    records = read_rounds(coord)
    audited = time.monotonic()
    problems, _, replayed = audit.verify(coord)
    audit_seconds = round(time.monotonic() - audited, 1)
    trees = {k: v for k, v in peaks.mb.items() if k.startswith("node") and " " not in k}
    return {
        "model": model, "d": model_size(model), "volunteers": volunteers, "attack": attack,
        "seconds": round(time.monotonic() - start, 1),
        "rounds": [{"round": r["round"], "seconds": r["seconds"], "train_seconds_max": r["train_seconds_max"],
                    "accepted": r["accepted"], "asked": r["asked"], "rejected": r["rejected"], "failed": r["failed"],
                    "missing": r["missing"], "accuracy": r["accuracy"], "bytes_up": r["bytes_up"],
                    "bytes_down": r["bytes_down"], "flagged": r["flagged"], "quarantined": r["quarantined"]}
                   for r in records],
        "final_accuracy": json.loads((coord / checkpoint.RESULT).read_text())["final_accuracy"],
        "coordinator_peak_mb": round(peaks.mb.get("coordinator", 0.0), 1),
        "parts_peak_mb": {part: round(peaks.mb.get(f"coordinator {part}", 0.0), 1) for part in PARTS},
        "at_peak_mb": peaks.at_peak,
        "volunteer_peak_mb": round(max(trees.values(), default=0.0), 1),
        "volunteers_peak_mb": {k: round(v, 1) for k, v in trees.items()},
        "volunteer_parts_peak_mb": {k: round(v, 1) for k, v in peaks.mb.items() if k.startswith("node") and " " in k},
        "audit_problems": problems, "audit_replayed": replayed, "audit_seconds": audit_seconds,
        **wire_sizes(settings), "folder": str(root),
    }


def print_report(report: dict) -> None:
    if report["bench"]:
        print("\nbench (one cell in this process; extra = peak resident memory the run added)")
        print("| model | d | nodes (f) | engine | peak extra MB | x model | x n*d*4 | seconds | accuracy |")
        print("|---|---|---|---|---|---|---|---|---|")
        for b in report["bench"]:
            print(f"| {b['model']} | {b['d']:,} | {b['nodes']} ({b['byzantine']}) | {b['engine']} | {b['peak_extra_mb']:.0f} "
                  f"| {b['x_model']:.1f} | {b['x_updates']:.2f} | {b['seconds']:.1f} | {b['accuracy']:.3f} |")
    dep = report["deploy"]
    print(f"\ndeployment: coordinator + {dep['volunteers']} volunteers on loopback, {dep['model']} (d = {dep['d']:,}), "
          f"{dep['attack'] or 'no'} attacker, "
          f"task {dep['task_bytes'] / MB:.1f} MB, reply {dep['reply_bytes'] / MB:.1f} MB (model {dep['model_bytes'] / MB:.1f} MB)")
    print("| round | accepted | seconds | slowest training s | MB up | MB down | flagged | quarantined | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in dep["rounds"]:
        print(f"| {r['round']} | {r['accepted']}/{r['asked']} | {r['seconds']:.1f} | {r['train_seconds_max']:.1f} "
              f"| {r['bytes_up'] / MB:.0f} | {r['bytes_down'] / MB:.0f} | {len(r['flagged'])} | {len(r['quarantined'])} "
              f"| {r['accuracy']:.3f} |")
    print(f"peak resident MB: coordinator tree {dep['coordinator_peak_mb']:.0f}, largest volunteer tree "
          f"{dep['volunteer_peak_mb']:.0f} ({', '.join(f'{k} {v:.0f}' for k, v in dep['volunteers_peak_mb'].items())}); "
          f"final accuracy {dep['final_accuracy']:.3f}; {dep['seconds']:.0f} s")
    print("peak MB of each process (VmHWM; the ClientApps of a task at once): coordinator "
          + ", ".join(f"{k} {v:.0f}" for k, v in dep["parts_peak_mb"].items()) + "; "
          + ", ".join(f"{k} {v:.0f}" for k, v in dep["volunteer_parts_peak_mb"].items()))
    print("at each tree's peak, its parts' resident MB: " + "; ".join(
        f"{tree} " + ", ".join(f"{part} {mb:.0f}" for part, mb in parts.items()) for tree, parts in dep["at_peak_mb"].items()))
    verdict = "; ".join(dep["audit_problems"]) or ("passes, every round replayed" if dep["audit_replayed"] else "passes")
    print(f"robust audit verify: {verdict} ({dep['audit_seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A model of over 10M parameters in the bench and in a deployment on "
                                            "loopback, its memory measured.")
    p.add_argument("--nodes-bench", type=int, default=10, metavar="N", help="nodes of the bench cell (default 10)")
    p.add_argument("--rounds", type=int, default=3, metavar="R", help="rounds of the bench cells and the deployment (default 3)")
    p.add_argument("--keep", metavar="DIR", help="run the deployment in DIR and keep it (default: a temporary folder)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--model", default=MODEL, help=f"a built-in model or a factory of examples/large (default {MODEL}; "
                   "hugenet:make has 100.8M parameters, bignet:make 10.5M)")
    p.add_argument("--timeline", metavar="FILE", help="write every memory sample (each process tree's parts) as JSON lines")
    p.add_argument("--volunteers", type=int, default=VOLUNTEERS, metavar="N", help=f"volunteers deployed (default {VOLUNTEERS})")
    p.add_argument("--attack", default="", help="an attack the last volunteer plays (e.g. alie-local; default none)")
    p.add_argument("--quorum", type=int, default=0, metavar="Q", help="replies a round steps on (default: every volunteer's)")
    p.add_argument("--no-bench", action="store_true", help="the deployment only")
    args = p.parse_args(argv)
    if args.nodes_bench < 3 or args.rounds < 1:
        p.error("--nodes-bench must be >= 3 and --rounds >= 1")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="robust-large-model-"))
    root.mkdir(parents=True, exist_ok=True)
    report = {"bench": [] if args.no_bench else [bench(m, args.nodes_bench, args.rounds) for m in (baseline(args.model), args.model)],
              "deploy": deploy(root.resolve(), args.rounds, args.model, args.volunteers, args.attack, args.quorum,
                               timeline=Path(args.timeline).resolve() if args.timeline else None)}
    if not args.keep:  # a failed run keeps its folder: the error names the logs in it
        shutil.rmtree(root, ignore_errors=True)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
