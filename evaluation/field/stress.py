"""``robust stress``: the reliability benchmark of a real deployment on loopback.

``--nodes`` volunteers (``robust node join`` processes: SuperNode, a ClientApp process per
task) train for a coordinator (``robust coordinator start``: SuperLink, ServerApp), all over
TLS with node authentication, exactly as users run them. Some volunteers play protocol
faults (``--faults dtype-lie,decline,...``: one node each); each round a share ``--kill`` of
the volunteers is SIGKILLed mid-round (with every process it started) and started again. A
coordinator that exits without finishing is a crash: it is counted and started again (it
resumes from its checkpoint).

Per round the report counts replies *sent* (each volunteer logs every reply it hands to
its SuperNode, ``DIR/work.jsonl``), accepted, rejected (by reason), declined, *lost* (sent
before the round ended by a node not killed in it, never read as a reply: missing, or a
"node error" Flower filed in its place), late (sent after the
round ended) and killed; then coordinator crashes and the coordinator's peak memory (the
largest sum of resident memory over its processes, sampled every half second, the
SuperLink's apart).

``--light``: the volunteers are light nodes (``evaluation.field.light_nodes``): one process holds them all,
each an authenticated node speaking the whole protocol to the same coordinator, replaying a
precomputed row instead of training (the last ``max(1, nodes // 10)`` play ``--attack``,
default ``alie``; ``none``: all honest), so that
hundreds of them fit on one machine and what is measured is the coordinator. A killed light
node drops its session as a SIGKILLed SuperNode does and opens a new one.

A reply the node handed on but Flower's runtime refused (a failed push, an expired task
token: ``work.jsonl``'s ``refused_by_runtime``, or a light node's failed push) is lost with
that cause (``lost_causes``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from nodes import checkpoint, commands, launch
from nodes.checkpoint import RUN_ID
from nodes.coordinator.coordinator import COSTS
from nodes.coordinator.status import read_rounds
from nodes.settings import Settings
from nodes.volunteer.worklog import WORK_LOG
from nodes.volunteer.volunteer import check_attack
from robust import keys, tls

from .coordinator_process import Supervised
from .light_nodes import LightNode, fleet, precompute

POLL = 0.5
# seconds into a round before its planned kills: early enough to fall within any round (a
# task reaches a volunteer at its SuperNode's next poll, every 3 s, and a warm trainer answers
# in tens of ms), so every round has its kills
KILL_AFTER = 0.5
LIGHT_DEADLINE = 30.0  # seconds: a light round with a killed node waits this long
NEVER_RECEIVED = "handed to Flower, never received"


def robust_cli(args: list[str], folder: Path, log: Path) -> subprocess.Popen:
    """``robust ARGS`` as a process group of its own (so a kill reaches all it started)."""
    return launch.spawn([sys.executable, "-m", "robust.cli", *args], folder / launch.FLWR_HOME, log, own_group=True)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass(frozen=True)
class Process:
    """One process as ``/proc`` shows it: its parent, resident and peak resident memory (KiB),
    and its command line."""

    parent: int
    rss_kb: int
    hwm_kb: int  # VmHWM: the most it was ever resident, so a peak between samples is not missed
    command: str


def processes() -> dict[int, Process]:
    """Every process readable now, by pid (one pass over ``/proc``)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
            table[int(entry.name)] = Process(int(fields["PPid"]), int(fields.get("VmRSS", "0 kB").split()[0]),
                                             int(fields.get("VmHWM", "0 kB").split()[0]), command)
        except (OSError, KeyError, ValueError):
            continue
    return table


def tree(root: int, table: dict[int, Process]) -> set[int]:
    """Process ``root`` and all its descendants in ``table``."""
    found, grew = {root}, True
    while grew:
        more = {pid for pid, p in table.items() if p.parent in found} - found
        found |= more
        grew = bool(more)
    return found


def rss_mb(pids: set[int], table: dict[int, Process]) -> float:
    """Resident memory (MB) of the processes ``pids`` in ``table`` (those gone are not counted)."""
    return sum(table[pid].rss_kb for pid in pids if pid in table) / 1024


@dataclass
class Volunteer:
    """A ``robust node join`` process (its warm trainer, SuperNode, ClientApps)."""

    folder: Path
    part: str
    fault: str
    fp: str = ""
    proc: subprocess.Popen | None = None
    killed: list[int] = field(default_factory=list)  # rounds in which it was killed

    def start(self, coord: Path, port: int) -> None:
        fault = ["--attack", self.fault] if self.fault else []
        self.proc = robust_cli(["node", "join", "--coordinator", f"127.0.0.1:{port}", "--ca", str(coord / "tls" / tls.CA_CERT),
                                "--key", str(self.folder), "--partition", self.part, "--device", "cpu", *fault],
                               self.folder, self.folder / "join.log")

    def restart(self, coord: Path, port: int) -> None:
        """SIGKILL it, with every process it started, and start it again."""
        kill(self.proc)
        self.start(coord, port)

    def stop(self) -> None:
        if self.proc is not None:
            launch.stop(self.proc)

    def _work(self, run: str) -> list[dict]:
        path = self.folder / WORK_LOG
        lines = path.read_text().splitlines() if path.exists() else []
        return [entry for entry in map(json.loads, lines) if entry["run"] == run]

    def sent(self, run: str) -> dict[int, float]:
        """Round -> when this node last handed a reply for it to its SuperNode."""
        return {e["round"]: e["time"] for e in self._work(run) if "refused_by_runtime" not in e}

    def refusals(self, run: str) -> dict[int, tuple[float, str]]:
        """Round -> when and why Flower's runtime refused this node's reply to it."""
        return {e["round"]: (e["time"], e["refused_by_runtime"]) for e in self._work(run) if "refused_by_runtime" in e}


@dataclass
class Light:
    """A light node (``evaluation.field.light_nodes``), driven from this process."""

    node: LightNode
    killed: list[int] = field(default_factory=list)

    @property
    def fp(self) -> str:
        return self.node.fp

    def start(self, coord: Path, port: int) -> None:
        self.node.start()

    def restart(self, coord: Path, port: int) -> None:
        self.node.kill()  # its thread opens a new session

    def stop(self) -> None:
        self.node.close()

    def sent(self, run: str) -> dict[int, float]:
        return {r: t for (of, r), t in self.node.sent.items() if of == run}

    def refusals(self, run: str) -> dict[int, tuple[float, str]]:
        return {r: (when, why) for of, r, when, why in self.node.refused if of == run}


def reason_kind(reason: str) -> str:
    """A rejection reason without its numbers: replies rejected for the same cause group together."""
    return re.sub(r"\b[0-9a-f]{12,}\b|(?<![\w.])[-+]?\d[\d.e+-]*", "#", reason.removeprefix("malformed reply: "))


class Stress:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        faults = [f for f in (getattr(args, "faults", "") or "").split(",") if f]
        light = getattr(args, "light", False)
        if len(faults) > args.nodes:
            raise ValueError(f"--faults names {len(faults)} faulty nodes, --nodes is {args.nodes}: one fault per node")
        if getattr(args, "attack", None) and not light:
            raise ValueError("--attack is what light nodes replay (--light); real volunteers play --faults")
        if faults and light:
            raise ValueError("--faults are played by real volunteers: light nodes (--light) replay rows, "
                             "Byzantine ones included (--attack)")
        for fault in faults:
            check_attack(fault)
        if not 0 <= args.kill < 1:
            raise ValueError(f"--kill {args.kill}: give the share of volunteers killed each round, in [0, 1)")
        n, self.args, self.root = args.nodes, args, root
        # a round with a killed node waits out its deadline: light nodes answer in milliseconds
        deadline = args.deadline or (LIGHT_DEADLINE if light else max(60.0, 6.0 * n))
        self.settings = Settings(rounds=args.rounds, model="logreg", aggregator="trimmed-mean", tolerate=max(1, n // 5),
                                 protocol="delta:steps=2", deadline=deadline, wait_nodes=max(120.0, 5.0 * n),
                                 port=launch.free_port())
        self.coord, folders = commands.local_federation(root, n, self.settings, "stress", ("stress", args.seed))
        self.run_id = (self.coord / RUN_ID).read_text().strip()
        if light:
            attack = getattr(args, "attack", None) or "alie"
            byzantine = 0 if attack == "none" else max(1, n // 10)
            private = [keys.load_private(f) for f in folders]
            rows = precompute(self.settings, self.run_id, private, byzantine, attack)
            self.volunteers: list[Volunteer | Light] = [
                Light(node) for node in fleet(private, rows, f"127.0.0.1:{self.settings.port}", self.coord / "tls" / tls.CA_CERT)]
        else:
            self.volunteers = [Volunteer(f, f"{i}/{n}", faults[i - 1] if i <= len(faults) else "")
                               for i, f in enumerate(folders, start=1)]
            for v in self.volunteers:
                v.fp = keys.fingerprint(keys.load_private(v.folder).public_key())
        self.rng = random.Random(args.seed)
        self.crashes, self.ended = 0, {}  # round -> when its record appeared
        self.peak_mb = {"coordinator": 0.0, "superlink": 0.0}

    def run(self) -> dict:
        started = time.monotonic()
        coordinator = Supervised(self.coord)
        for v in self.volunteers:
            v.start(self.coord, self.settings.port)
        round_started, plan = time.monotonic(), self._plan_kills()
        try:
            while True:
                done = len(read_rounds(self.coord))
                if self._note_ended(done):
                    round_started, plan = time.monotonic(), self._plan_kills()
                if plan and time.monotonic() - round_started > min(KILL_AFTER, self.settings.deadline / 8):
                    for v in plan:  # mid-round: its ClientApp is training (or waiting for its task)
                        v.restart(self.coord, self.settings.port)
                        v.killed.append(done + 1)
                    plan = []
                self.sample(coordinator.proc.pid)
                if coordinator.finished():
                    self._note_ended(len(read_rounds(self.coord)))  # its record came as the coordinator finished
                    break
                time.sleep(POLL)
        finally:
            for v in self.volunteers:
                if isinstance(v, Light):
                    v.node.close(wait=False)  # every light node at once; joined below
            for v in self.volunteers:
                v.stop()
            coordinator.stop()
            self.crashes = coordinator.crashes
        return self._report(time.monotonic() - started)

    def _note_ended(self, done: int) -> bool:
        """Note when the rounds up to ``done`` were first seen ended; whether one was new."""
        new = range(len(self.ended) + 1, done + 1)
        for r in new:
            self.ended[r] = time.time()
        return bool(new)

    def sample(self, root: int) -> None:
        """Note the resident memory of the coordinator's processes: the SuperLink's, and the rest's."""
        table = processes()
        pids = tree(root, table) & set(table)
        link = {pid for pid in pids if "flower-superlink" in table[pid].command}
        for name, group in (("superlink", link), ("coordinator", pids - link)):
            self.peak_mb[name] = max(self.peak_mb[name], rss_mb(group, table))

    def _plan_kills(self) -> list[Volunteer | Light]:
        k = round(self.args.kill * len(self.volunteers))
        return self.rng.sample(self.volunteers, k) if k else []

    def _report(self, seconds: float) -> dict:
        sent = {v.fp: v.sent(self.run_id) for v in self.volunteers}
        refused = {v.fp: v.refusals(self.run_id) for v in self.volunteers}
        rounds, causes = [], Counter()
        for record in read_rounds(self.coord):
            r, end = record["round"], self.ended.get(record["round"], math.inf)
            killed = {v.fp for v in self.volunteers if r in v.killed}
            handed = ({fp for fp, rs in sent.items() if r in rs and rs[r] <= end}
                      | {fp for fp, rs in refused.items() if r in rs and rs[r][0] <= end})
            late = {fp for fp, rs in sent.items() if r in rs and rs[r] > end}
            # never read as a reply: silent, or failed in Flower's hands ("node error": its runtime said so)
            unread = set(record["missing"]) | {fp for fp, why in record["failed"].items() if why.startswith("node error")}
            lost = (handed - killed) & unread
            causes.update(refused[fp][r][1] if r in refused[fp] else NEVER_RECEIVED for fp in lost)
            declined = [fp for fp, why in record["failed"].items() if why.startswith("declined")]
            received = record["asked"] - len(unread)  # the replies the coordinator read
            # while replies flow: from the round's start (its end less its seconds, as this process saw
            # them: up to POLL late) to the last reply handed on in time
            last = max((rs[r] for fp, rs in sent.items() if fp in handed and r in rs and rs[r] <= end), default=end)
            flow = last - (end - record["seconds"]) if math.isfinite(end) else record["seconds"]
            rounds.append({
                "round": r, "asked": record["asked"], "sent": len(handed), "received": received, "accepted": record["accepted"],
                "rejected": dict(Counter(reason_kind(why) for why in record["rejected"].values())),
                "declined": len(declined), "failed": len(record["failed"]) - len(declined),
                "lost": len(lost), "late": len(late & set(record["missing"])),
                "killed": len(killed), "rested": len(record.get("rested", [])), "seconds": record["seconds"],
                "flow_seconds": round(flow, 3), "replies_per_s": round(received / flow, 1) if flow > 0 else 0.0,
                "costs": record.get("costs", {}),
            })
        result = json.loads((self.coord / checkpoint.RESULT).read_text())
        return {
            "nodes": len(self.volunteers), "light": isinstance(self.volunteers[0], Light), "rounds": rounds,
            "lost": sum(r["lost"] for r in rounds), "lost_causes": dict(causes),
            "sent": sum(r["sent"] for r in rounds), "accepted": sum(r["accepted"] for r in rounds),
            "rejected": sum(sum(r["rejected"].values()) for r in rounds), "crashes": self.crashes,
            "replies_per_s": round(sum(r["received"] for r in rounds) / max(sum(r["flow_seconds"] for r in rounds), 1e-9), 1),
            "coordinator_peak_mb": round(self.peak_mb["coordinator"], 1),
            "superlink_peak_mb": round(self.peak_mb["superlink"], 1),
            "seconds": round(seconds, 1), "final_accuracy": result["final_accuracy"], "folder": str(self.root),
        }


def _cell(r: dict, column: str) -> str:
    if column == "rejected":
        return str(sum(r["rejected"].values()))
    if column in COSTS:
        return f"{r['costs'].get(column, 0.0):.2f}"
    return f"{r[column]:.1f}" if column in ("seconds", "replies_per_s") else str(r[column])


def _counts(title: str, column: str, counts: Counter) -> object:
    from rich.table import Table

    table = Table(title=title)
    table.add_column(column)
    table.add_column("replies", justify="right")
    for reason, n in counts.most_common():
        table.add_row(reason, str(n))
    return table


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    kind = "light nodes" if report["light"] else "volunteers"
    table = Table(title=f"robust stress: {report['nodes']} {kind} on loopback (send, check, engine, audit: the "
                        "coordinator's own seconds)")
    columns = ("round", "asked", "sent", "accepted", "rejected", "declined", "failed", "lost", "late", "killed",
               "rested", "seconds", "replies_per_s", *COSTS)
    for name in columns:
        table.add_column(name.replace("replies_per_s", "replies/s"), justify="right")
    reasons: Counter = Counter()
    for r in report["rounds"]:
        reasons.update(r["rejected"])
        table.add_row(*(_cell(r, c) for c in columns))
    console = Console(width=max(Console().width, 170))
    console.print(table)
    if reasons:
        console.print(_counts("rejected replies, by reason", "reason", reasons))
    if report["lost_causes"]:
        console.print(_counts("lost replies, by cause", "cause", Counter(report["lost_causes"])))
    console.print(f"replies sent {report['sent']}, accepted {report['accepted']}, rejected {report['rejected']}, "
                  f"lost {report['lost']}; {report['replies_per_s']:.1f} replies/s through the coordinator; "
                  f"coordinator crashes {report['crashes']}; peak memory: SuperLink {report['superlink_peak_mb']:.0f} MB, "
                  f"the rest of the coordinator {report['coordinator_peak_mb']:.0f} MB; final accuracy "
                  f"{report['final_accuracy']:.3f}; {report['seconds']:.0f} s; files in {report['folder']}")


def main(args: argparse.Namespace) -> int:
    if args.nodes < 3 or args.rounds < 1:
        raise ValueError("stress needs --nodes >= 3 and --rounds >= 1")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="robust-stress-"))
    root.mkdir(parents=True, exist_ok=True)
    report = Stress(args, root).run()
    print_report(report)
    if args.json:
        print(json.dumps(report))
    return 0 if report["lost"] == 0 and report["crashes"] == 0 else 1
