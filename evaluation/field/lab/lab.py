"""One bench cell played as a real deployment in the field lab.

The cell's federation is the deploy driver's (``evaluation.bench.drivers.federation``: the same
keys, data parts and settings, so the bits can be compared), but each process runs where the
field would put it: ``robust coordinator start`` (SuperLink, ServerApp) in the coordinator's
namespace, listening on its ends of the pairs; each volunteer's trainer and SuperNode in the
volunteer's namespace, the SuperNode reaching the coordinator through the volunteer's latency
relay and its shaped pair (``netns``, ``shaping``, ``relay``), the trainer in its CPU group
holding ``cpu / slowness`` of a CPU (``cpu``: the scenario's ``speed``).

Churn follows the scenario's chain (``evaluation.simtime.arrivals.Volunteers.online``): a
synchronous run's epoch is its round, an asynchronous run's ``floor(t / period)`` of wall
seconds since the run was submitted; a volunteer offline in an epoch is stopped (its processes
SIGTERMed, as a laptop closing), and started again with its folder (keys, work log) when back.
A coordinator that exits without a result is a crash: counted and started again (it resumes
from its checkpoint).

What is measured, per round (or buffer): its end in wall seconds since the run was submitted,
read as its record appears, and the bytes the volunteers had sent the coordinator by then (the
pairs' counters: every byte on the wire, TLS and gRPC included).
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

from nodes import checkpoint, launch
from nodes.coordinator import events
from nodes.checkpoint import RUN_ID
from robust import tls

from evaluation.bench.cell import Cell, CellSetup, cell_record
from evaluation.bench.drivers import federation
from evaluation.reports.target_costs import first_reached
from evaluation.simtime.arrivals import Volunteers

from . import netns, shaping
from evaluation.field.coordinator_process import Supervised

from .cpu import Group
from .wire_faults import Fault, build_faults
from .lab_node import Volunteer
from .observe import observe

POLL = 0.05  # seconds between looks at the round log
DEADLINE = 600.0  # a synchronous round's deadline unless the scenario gives one: only a broken node is late
PORT = 9190  # the SuperLink's, in the coordinator's namespace (each namespace has its own ports)
STOP_GRACE = 5.0  # a reply handed on this close to its node's stop may not have left: not counted lost


def people(cell: Cell, setup: CellSetup) -> Volunteers:
    """The cell's simulated volunteers (speed, link, churn), as the bench's clock sees them."""
    cfg = cell.config
    return Volunteers.of(setup.ids, cell.seed, cfg.get("speed", "uniform"), cfg.get("link", "none"),
                         cfg.get("churn", "none"))


def refusal(cell: Cell, cpu: float) -> str | None:
    """Why the lab cannot play ``cell`` as its scenario says (``None``: it can), in one line."""
    if not cell.config.get("target-accuracy"):
        return ("the lab measures the time to reach target-accuracy: give one in the scenario "
                "(e.g. target-accuracy = 0.85)")
    setup = CellSetup(cell)
    crowd = people(cell, setup)
    for node in setup.ids:
        up, down, _ = crowd.rates(node)
        reason = shaping.refusal(up / 1e6, "an upload of") or shaping.refusal(down / 1e6, "a download of")
        if reason:
            return reason
        if cpu / crowd.slowness(node) < 0.01:
            return (f"a node {crowd.slowness(node):g}x slower on a cpu share of {cpu:g} gets less than 1% of a CPU: "
                    "raise --cpu or lower the speed's factor")
    ordered = sorted(setup.ids)
    for fault in build_faults(cell.config.get("faults", "none")):
        if fault.node > len(ordered):
            return f"{fault.name}'s node={fault.node} is not among the {len(ordered)} volunteers: lower it"
        up, down, _ = crowd.rates(ordered[fault.node - 1])
        if fault.name == "slow-link" and (math.isinf(up) or math.isinf(down)):
            return (f"slow-link slows a shaped link: node {fault.node}'s is unshaped (none); give it a rate, "
                    "or play link-down")
        if fault.name == "slow-link" and min(up, down) * fault.factor / 1e6 < shaping.MIN_MBPS:
            return f"slow-link's factor={fault.factor:g} takes node {fault.node}'s link under {shaping.MIN_MBPS:g} Mbit/s"
    return None


def run_cell(cell: Cell, root: Path, cpu: float = 1.0) -> dict:
    """The cell's record (the bench's fields, ``engine = "field"``) and what the lab measured."""
    reason = refusal(cell, cpu)
    if reason:
        raise ValueError(reason)
    setup = CellSetup(cell)
    crowd = people(cell, setup)
    predicted = predict(cell)  # before the run, from the scenario and its calibration alone
    folder = root.resolve() / federation.run_id(setup)
    shutil.rmtree(folder, ignore_errors=True)  # a killed run's
    coord, folders = federation.build(setup, folder, **deployment(cell))
    net = netns.Network(setup.n)
    groups: list[Group] = []
    volunteers: list[Volunteer] = []
    try:
        for pair, node_folder, fp in zip(net.pairs, folders, setup.by_index):
            up, down, latency = crowd.rates(fp)
            shaping.shape(pair.namespace, pair.volunteer_dev, up / 1e6)
            shaping.shape(net.coordinator, pair.coordinator_dev, down / 1e6)
            groups.append(Group(pair.namespace, cpu / crowd.slowness(fp)))
            volunteers.append(Volunteer(node_folder.resolve(), fp, pair, latency * 1e3, groups[-1]))
        run = Run(cell, coord, net, volunteers, crowd)
        measured = run.play()
        shaped = {"up": {v.fp: shaping.counters(v.pair.namespace, v.pair.volunteer_dev) for v in volunteers},
                  "down": {v.fp: shaping.counters(net.coordinator, v.pair.coordinator_dev) for v in volunteers}}
        on_wire = net.traffic()
        wire = {v.fp: on_wire[v.pair.index] for v in volunteers}
    finally:
        for v in volunteers:
            v.stop()
        net.remove()
        for group in groups:
            group.remove()
    rounds, w = federation.rounds_and_model(coord)
    record = cell_record(setup, rounds, w, None, measured["wall"], None, "field",
                         kept=federation.memories(setup, folders))
    seen = observe({v.fp: v.replies(run.run_id) for v in volunteers}, rounds, run.t0, measured["times"], crowd,
                   sum(p.numel() for p in setup.model().parameters()), setup.settings.downlink, wire)
    record.update(field_costs(rounds, measured, cell.config["target-accuracy"], predicted), observed=seen,
                  lost=run.lost(rounds), crashes=run.crashes, revived=run.revived, shaping=shaped, faults=run.played,
                  events=events.read(coord),  # as the run's dashboard listed them
                  links={v.fp[:12]: [round(x, 6) for x in crowd.rates(v.fp)] for v in volunteers},
                  cpu_share={v.fp[:12]: v.group.share for v in volunteers})
    shutil.rmtree(folder, ignore_errors=True)
    return record


def deployment(cell: Cell) -> dict:
    """The coordinator's deployment settings for ``cell``: listening on its ends of the pairs, its
    deadline the scenario's (as the simulated clock has it; none given: only a broken node is late)."""
    return {"bind": "0.0.0.0", "port": PORT, "wait_nodes": DEADLINE,
            "deadline": float(cell.config.get("deadline") or DEADLINE)}


def predict(cell: Cell) -> list[float] | None:
    """The simulated clock's time of each round's end, with the cell's ``calibration`` (``None``
    without one): its per-node local driver run, in this process."""
    if not cell.config.get("calibration"):
        return None
    from evaluation.bench.drivers.inprocess import run_cell as simulate

    return [round(t, 3) for t in simulate(cell, vectorize=False)["times"]]


def field_costs(rounds: list[dict], measured: dict, bar: float, predicted: list[float] | None) -> dict:
    """Time, rounds and uplink bytes to the first round at ``bar``, and per round; the predicted
    time of that same round (or buffer) count."""
    at = first_reached([r["accuracy"] for r in rounds], bar)
    times, sent = measured["times"], measured["bytes"]
    return {"times": times, "bytes": sent, "target_accuracy": bar, "predicted_times": predicted,
            "rounds_to_target": None if at is None else at + 1,
            "time_to_target": None if at is None else times[at],
            "predicted_time_to_target": None if at is None or predicted is None or at >= len(predicted) else predicted[at],
            "bytes_up_to_target": None if at is None else sent[at]}


class Run:
    """The processes of one cell's deployment, watched until the coordinator has its result."""

    def __init__(self, cell: Cell, coord: Path, net: netns.Network, volunteers: list[Volunteer], crowd: Volunteers) -> None:
        self.coord, self.net, self.volunteers, self.crowd = coord, net, volunteers, crowd
        self.asynchronous = cell.config.get("round") == "async"
        self.crashes = self.revived = 0
        self.run_id = (coord / RUN_ID).read_text().strip()
        self.ca = coord / "tls" / tls.CA_CERT
        self.t0 = math.nan
        self.ended: list[float] = []  # wall time of each round's end
        self.sent: list[int] = []  # uplink bytes by then
        ordered = sorted(volunteers, key=lambda v: v.fp)  # faults name nodes as links do: in sorted id order
        self.faults = [(fault, ordered[fault.node - 1]) for fault in build_faults(cell.config.get("faults", "none"))]
        self.played: list[dict] = []  # each fault: what, whom, when it began and ended (wall seconds)

    def play(self) -> dict:
        for v in self.volunteers:
            if self.crowd.online(v.fp, 0):
                v.warm()
        coordinator = Supervised(self.coord, netns.inside(self.net.coordinator))
        self.t0 = time.time()
        try:
            self._churn(0)
            while True:
                self._note_rounds()
                self._churn(len(self.ended) if not self.asynchronous else self.crowd.epoch_at(time.time() - self.t0))
                self._faults(time.time() - self.t0)
                if coordinator.finished():
                    self._note_rounds()
                    break
                time.sleep(POLL)
                launch.raise_if_terminated()
        finally:
            coordinator.stop()
            self.crashes = coordinator.crashes
        return {"wall": time.time() - self.t0, "times": [round(t, 3) for t in self.ended], "bytes": self.sent}

    def _note_rounds(self) -> None:
        path = self.coord / checkpoint.ROUNDS
        done = path.read_bytes().count(b"\n") if path.exists() else 0
        if done > len(self.ended):
            now, total = time.time() - self.t0, sum(up for up, _ in self.net.traffic().values())
            self.ended += [now] * (done - len(self.ended))
            self.sent += [total] * (done - len(self.sent))

    def _churn(self, epoch: int) -> None:
        """Start the volunteers online in ``epoch``, stop the others; start again one whose
        process exited (``robust node join``'s supervisor does that for a volunteer)."""
        for v in self.volunteers:
            online = self.crowd.online(v.fp, epoch)
            if online and v.running and v.exited():
                v.stop()
                self.revived += 1
            if online and not v.running:
                v.start(PORT, self.ca)
            elif not online and v.running:
                v.stop(churned=True)

    def _faults(self, now: float) -> None:
        """Begin the faults due by ``now`` and end those whose time is up."""
        for k, (fault, v) in enumerate(self.faults):
            if k == len(self.played) and now >= fault.after:
                self.played.append({"fault": fault.spec, "node": v.fp[:12], "began": round(now, 3), "ended": None})
                self._fault(fault, v, begin=True)
                events.note(self.coord, f"{fault.spec} began", v.fp)  # the operator's dashboard shows it
                if not fault.seconds:
                    self.played[k]["ended"] = self.played[k]["began"]
            elif k < len(self.played) and self.played[k]["ended"] is None and now >= fault.after + fault.seconds:
                self._fault(fault, v, begin=False)
                events.note(self.coord, f"{fault.spec} ended", v.fp)
                self.played[k]["ended"] = round(now, 3)

    def _fault(self, fault: Fault, v: Volunteer, begin: bool) -> None:
        pair, coordinator = v.pair, self.net.coordinator
        if fault.name == "link-down":
            for namespace, dev in ((coordinator, pair.coordinator_dev), (pair.namespace, pair.volunteer_dev)):
                netns.ip("-n", namespace, "link", "set", dev, "down" if begin else "up")
        elif fault.name == "slow-link":
            up, down, _ = self.crowd.rates(v.fp)
            share = fault.factor if begin else 1.0
            shaping.reshape(pair.namespace, pair.volunteer_dev, up * share / 1e6)
            shaping.reshape(coordinator, pair.coordinator_dev, down * share / 1e6)
        elif fault.name == "restart" and v.running:
            v.stop(churned=True)
            v.start(PORT, self.ca)

    def lost(self, rounds: list[dict]) -> int:
        """Finished replies that never counted: handed to a volunteer's SuperNode while the run
        went on, not just before churn or a fault stopped the volunteer, and never read by the
        coordinator (accepted, rejected, or failed for a reason of its own), though it could be
        in, up its node's link, by the run's end. An asynchronous run's last buffer closes with
        other replies in flight: those not in by the buffer before it are moot, not lost."""
        last = self.ended[-2] if self.asynchronous and len(self.ended) > 1 else self.ended[-1] if self.ended else 0.0
        end = self.t0 + last
        out = 0
        for v in self.volunteers:
            handed = [e for e in v.replies(self.run_id)
                      if e["time"] + self.crowd.upload_seconds(v.fp, e["bytes"]) <= end
                      and not any(0 <= stop - e["time"] <= STOP_GRACE for stop in v.stopped_at)]
            read = sum(v.fp in r["ids"] or v.fp in r["rejected"]
                       or (v.fp in r["failed"] and not r["failed"][v.fp].startswith("node error")) for r in rounds)
            out += max(0, len(handed) - read)
        return out
