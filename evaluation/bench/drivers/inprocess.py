"""The local driver: one benchmark cell in-process, on the serve loop and round engine the coordinator runs.

The cell's rounds are the product's serve loop (``nodes.engine.serve``) with this driver as
its transport and desk (``evaluation.bench.drivers.serving``) and simulated time as its clock:
each round the engine selects the nodes to ask (quarantined ones are not), this driver
computes their rows, and :meth:`nodes.engine.engine.Engine.step` plays the round with the threat
model's hook (``evaluation.bench.threat``). Rows are computed

- one node at a time (``vectorize=False``) by :func:`nodes.engine.training.compute`, the very
  function a volunteer calls, with the node's data, identity and momentum, so the cell ends
  with the bits a federation of real volunteers gives (``tests/test_drivers.py``); or
- all at once: hand-written batched products for ``logreg``/``mlp``
  (``evaluation.bench.drivers.batched_dense``), ``torch.func.vmap`` of ``Protocol.node_update`` for the rest;
  the same mathematics, equal to rounding (``tests/test_batched.py``). A model that draws
  random numbers as it trains (dropout) is computed node by node: each node draws from its
  own stream, as a volunteer does, which one batched call cannot reproduce. So are, in every
  round, the attackers whose training changes with the round or their memory (an attack
  that :attr:`~attacks.base.NodeAttack.trains_alone`: ``neurotoxin``, ``constrain-scale``,
  ``a3fl``, any ``stop_after``): their rows are a volunteer's bits, the honest nodes stay batched.

Batched training runs on the cell's ``device`` (the setting the coordinator's rule runs on:
``auto`` is CUDA when torch sees a GPU): the training tensors, the nodes' momenta and a copy of
the model live there, and each round's rows come back to the CPU, where the threat model, the
codecs and the engine take them (the engine moves their blocks to the device for the rule).
The per-node path is a volunteer's CPU function on every device. On CUDA the batched kernels
run under :func:`robust.compute.profile` (deterministic algorithms, no TF32): the same bits
run after run on one GPU; against the CPU's, float sums in another order make another
trajectory, with the same accuracy (``python -m evaluation.device_speed``; on an H100 the 36
digits cells of ``speed.toml``'s seed 0 ended 0.00 pp apart, none with the CPU's bits).

Batch draws are the volunteers' own (``robust.batches``, keyed by node fingerprint), drawn
for many nodes and rounds per call.
"""

from __future__ import annotations

import copy
import time
from functools import partial

import numpy as np
import torch
from torch.func import vmap

import attacks
from attacks.base import Memory, NodeAttack
from nodes.engine.engine import Engine
from nodes.engine.ledger import Ticket
from nodes.engine.protocol import Protocol
from nodes.engine.root import Root
from nodes.engine.serve import Loop
from nodes.engine.spotcheck import Verdict, referee
from nodes.engine.training import compute, estimates
from nodes.wire import Task
from robust.compute import device_name, profile
from robust.batches import draw_batches, node_key
from robust.params import unflatten
from robust.seeds import generator

from .batched_dense import DenseNet, local_updates
from evaluation.bench.cell import Cell, CellSetup, backdoor_stop, backdoor_success, cell_record
from .serving import BenchDesk, InProcess
from evaluation.reports.target_costs import with_costs
from evaluation.bench.threat import ThreatModel
from evaluation.simtime.serve_clock import SimClock
from evaluation.simtime.timeline import Timeline


class BatchDraws:
    """Every node's sample indices of a round, drawn as each volunteer draws its own, several
    rounds per call (a few MB at most): the draw's cost is per call, not per sample."""

    BUDGET = 1 << 23  # hashes per call

    def __init__(self, parts: list[torch.Tensor], protocol: Protocol, keys: list[int]) -> None:
        self.sizes = np.array([p.numel() for p in parts])
        self.table = torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)  # (n, largest part)
        self.keys, self.protocol = np.array(keys), protocol
        width = max(int(self.sizes.max()), protocol.batch_size)
        self.chunk = max(1, min(16, self.BUDGET // (len(parts) * protocol.steps * width)))
        self.first, self.drawn = -1, torch.empty(0)

    def __call__(self, t: int) -> torch.Tensor:
        """``(n, local steps, batch size)`` indices into the training tensors for round ``t``."""
        if not self.first <= t < self.first + len(self.drawn):
            n, rounds = len(self.sizes), np.arange(t, t + self.chunk)
            pos = draw_batches(np.tile(self.sizes, self.chunk), self.protocol.batch_size,
                               np.tile(self.keys, self.chunk), np.repeat(rounds, n), self.protocol.steps)
            table = self.table.repeat(self.chunk, 1)
            self.first, self.drawn = t, table.gather(1, pos.flatten(1)).view(self.chunk, n, *pos.shape[1:])
        return self.drawn[t - self.first]


class CellRun:
    """One cell between rounds: its federation built once, the engine, the nodes' state."""

    def __init__(self, cell: Cell, vectorize: bool = True) -> None:
        self.setup = setup = CellSetup(cell)
        self.vectorize, self.ids = vectorize, setup.ids
        self.threat = ThreatModel(cell.attack, setup.byzantine, cell.seed)
        self.engine = Engine(setup.settings, setup.model(), setup.data.x_test, setup.data.y_test, self.threat,
                             self._verify if setup.settings.spot_check else None, Root.of(setup.settings, setup.data))
        self.protocol = self.engine.protocol
        self.index = {fp: i for i, fp in enumerate(self.ids)}
        # where the batched kernels train (the per-node path is a volunteer's CPU function)
        self.device = self.engine.device if vectorize else torch.device("cpu")
        self.momenta = torch.zeros(len(self.ids), self.engine.w.numel(), device=self.device)
        # where the engine names the momentum each task continues from (nodes.engine.states): each
        # node's momentum after its last row a round used, which it continues from, as a volunteer does
        self.kept = None if self.engine.states is None else self.momenta.clone()
        self.records: list[dict] = []
        self.training = 0.0  # seconds spent computing the nodes' rows
        self.checks = 0  # spot checks recomputed
        attack = setup.attack
        # the attackers computed node by node even when vectorised (see the module's docstring)
        self.alone = [bool(setup.attack_of(fp)) and isinstance(attack, NodeAttack) and attack.trains_alone
                      for fp in self.ids]
        if vectorize:
            plain = self.protocol.inner == "sgd" and not self.protocol.clip  # what the hand-written kernels do
            self.net = DenseNet.of(self.engine.model) if plain else None
            # the vmap path's model: the engine's own on the CPU, a copy (buffers too) elsewhere
            self.model = (self.engine.model if self.device.type == "cpu"
                          else copy.deepcopy(self.engine.model).to(self.device))
            self.xs, self.ys, parts = self._poisoned([setup.parts[fp] for fp in self.ids])
            self.xs, self.ys = self.xs.to(self.device), self.ys.to(self.device)
            self.draws = BatchDraws(parts, self.protocol, [node_key(cell.seed, fp) for fp in self.ids])
        self.last: dict[int, Memory] = {}  # a remembering node-side attacker's previous round
        self.keeping: dict[int, dict] = {}  # what an attacker's poisoning kept this round (a3fl's trigger), till _forge
        self._local: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stop = backdoor_stop(setup)  # the round a backdoor's nodes attack last, if before the end
        self.asr_at_stop: float | None = None
        self.timeline = Timeline(cell.config, self.ids, cell.seed, setup.settings, self.protocol.steps,
                                 self.engine.w.numel())
        self.threat.timeline = self.timeline
        config, settings = cell.config, setup.settings
        self.timeline.measure(lambda: compute(self.task(), self.sent, *self.local(0), setup.data.classes,
                                              self.ids[0], torch.device("cpu")),
                              (config["model"], config["dataset"], setup.data.x_train.shape, settings.batch_size,
                               settings.protocol, settings.threads))
        self.desk, self.transport = BenchDesk(self), InProcess(self)
        clock = SimClock(self.timeline, settings.asynchronous, settings.deadline, self.ids, self.transport.bytes.pop)
        self.loop = Loop(self.transport, self.desk, clock)
        self.ready: list[dict] = []  # async: buffers aggregated but not yet returned by play_round

    def local(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Node ``i``'s own copy of its data, as a volunteer holds it (the per-node driver)."""
        if i not in self._local:
            data, part = self.setup.data, self.setup.parts[self.ids[i]]
            self._local[i] = data.x_train[part].clone(), data.y_train[part].clone()
        return self._local[i]

    def _forge(self, idx: list[int], rows: torch.Tensor, task: Task, before: torch.Tensor | None,
               w: torch.Tensor | None = None) -> torch.Tensor:
        """The rows the asked nodes ``idx`` send for ``task``, computed from ``w`` (the global
        model if ``None``: the round's task model) and their momenta ``before`` it: a node-side
        attacker's ``forge`` of its own (with its own honest estimates, as a volunteer's)."""
        attack, t, w = self.setup.attack, task.round, self.sent if w is None else w
        byz = [j for j, i in enumerate(idx) if self.setup.attack_of(self.ids[i])]
        if not isinstance(attack, NodeAttack) or not byz:
            return rows
        sent = rows
        for j in byz:
            honest, last = rows[j].clone(), self.last.get(idx[j])
            if attack.active(t):
                own = None
                if attack.estimates:
                    x, y = self.local(idx[j])
                    own = estimates(task, w, x, y, self.setup.data.classes, self.ids[idx[j]], torch.device("cpu"),
                                    before[j], attack.estimates)
                forged = attack.forge(honest, None if last is None else last.row, own)
                if forged is not honest:  # under `momentum` the rows *are* the momenta: forge into a copy
                    sent = rows.clone() if sent is rows else sent
                    sent[j] = forged
            if attack.remembers:
                self.last[idx[j]] = Memory.after(t, w, honest, self.keeping.pop(idx[j], {}), last)
        return sent

    def _poisoned(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Training tensors with the Byzantine nodes' poisoned copies appended (a node-side
        attack poisons as the volunteer does), and every node's indices into them."""
        setup, data = self.setup, self.setup.data
        xs, ys, parts = [data.x_train], [data.y_train], list(parts)
        start = len(data.y_train)
        for i, fp in enumerate(self.ids):
            if setup.attack_of(fp) and not self.alone[i]:  # the node's own attack (its rank set: dba's part)
                px, py = attacks.build(setup.attack_of(fp), 1).poison(
                    data.x_train[parts[i]], data.y_train[parts[i]], data.classes, generator(self.setup.cell.seed, fp, "poison"))
                xs.append(px)
                ys.append(py)
                parts[i] = torch.arange(start, start + len(py))
                start += len(py)
        return torch.cat(xs), torch.cat(ys), parts

    def _verify(self, t: int, rows: dict[str, tuple[Ticket, torch.Tensor]]) -> list[Verdict]:
        """Spot checks, as the coordinator referees them: each drawn node's own task (a
        straggler's: the older model it was sent) recomputed by a volunteer's own function, on
        its data, without any attack (under ``momentum``, from the momentum its task named); bit
        for bit against the per-node driver's rows, within the tolerance against the batched
        kernels'."""
        data, verdicts = self.setup.data, []
        for fp, (ticket, row) in rows.items():
            part, task = self.setup.parts[fp], Task.of(self.setup.settings, "bench", ticket.number, ticket.base)
            honest, _ = compute(task, ticket.model, data.x_train[part], data.y_train[part], data.classes, fp,
                                torch.device("cpu"), "", ticket.start)
            verdicts.append(referee(fp, row, not self.vectorize, honest))
        self.checks += len(rows)
        return verdicts

    def task(self) -> Task:
        return Task.of(self.setup.settings, "bench", self.engine.round + 1, self.engine.task_model()[1])

    @property
    def sent(self) -> torch.Tensor:
        """The model this round's tasks carry (``Engine.task_model``: the global model, or as the
        ``downlink`` rounds it)."""
        return self.engine.task_model()[0]

    def rows(self, asked: list[str]) -> torch.Tensor:
        """The rows of the ``asked`` nodes (canonical order) this round; their momenta advance."""
        idx = [self.index[fp] for fp in asked]
        if not idx:  # every node quarantined
            return torch.empty(0, self.engine.w.numel())
        if self.kept is not None:
            self.momenta[idx] = self.kept[idx]
        task, before = self.task(), self._before(idx)
        if not self.vectorize:
            return self._forge(idx, self._per_node(idx, task), task, before)
        alone = torch.tensor([self.alone[i] for i in idx])
        if not alone.any():
            return self._forge(idx, self._batched(idx), task, before)
        rows = torch.empty(len(idx), self.engine.w.numel())
        if not alone.all():
            rows[~alone] = self._batched([i for i, a in zip(idx, alone.tolist()) if not a])
        rows[alone] = self._per_node([i for i, a in zip(idx, alone.tolist()) if a], task)
        return self._forge(idx, rows, task, before)

    def row(self, node: str, task: Task, w: torch.Tensor) -> torch.Tensor:
        """One node's row for ``task`` carrying model ``w`` (an asynchronous driver's), as a
        volunteer computes it."""
        i = self.index[node]
        return self._forge([i], self._per_node([i], task, w), task, self._before([i]), w)[0]

    def _before(self, idx: list[int]) -> torch.Tensor | None:
        """Nodes ``idx``'s momenta before their rows advance them, if an attacker needs them to
        compute its :attr:`~attacks.base.NodeAttack.estimates` (a copy)."""
        return self.momenta[idx] if getattr(self.setup.attack, "estimates", 0) else None

    def _per_node(self, idx: list[int], task: Task, w: torch.Tensor | None = None) -> torch.Tensor:
        """Nodes ``idx``'s rows for ``task`` from model ``w`` (the round's task model if ``None``), each
        by a volunteer's own function; their momenta advance."""
        outs, w = [], self.sent if w is None else w
        for i in idx:
            x, y = self.local(i)
            self.keeping[i] = {}
            outs.append(compute(task, w, x, y, self.setup.data.classes, self.ids[i], torch.device("cpu"),
                                self.setup.attack_of(self.ids[i]), self.momenta[i], self.last.get(i),
                                kept=self.keeping[i]))
        self.momenta[idx] = torch.stack([m for _, m in outs]).to(self.device)
        return torch.stack([row for row, _ in outs])

    def _batched(self, idx: list[int]) -> torch.Tensor:
        """Nodes ``idx``'s rows in one batched call on the cell's device (back on the CPU); their
        momenta advance."""
        everyone = len(idx) == len(self.ids)
        with profile(self.setup.settings.threads, self.device):
            pos = self.draws(self.engine.round + 1)
            pos = (pos if everyone else pos[idx]).to(self.device)
            m = self.momenta if everyone else self.momenta[idx]
            sent = self.sent.to(self.device)
            if self.net is not None:  # flat samples by index_select: 3x faster than indexing by a 3-d idx
                x = self.xs.flatten(1).index_select(0, pos.flatten()).view(*pos.shape, -1)
                y = self.ys.index_select(0, pos.flatten()).view(pos.shape)
                rows, m = local_updates(self.net, self.protocol, sent, x, y, m)
            else:
                batched = vmap(partial(self.protocol.node_update, self.model), in_dims=(None, 0, 0, 0))
                try:
                    rows, m = batched(unflatten(sent, self.model), self.xs[pos], self.ys[pos], m)
                except RuntimeError as err:
                    if "random" not in str(err):
                        raise
                    # the model draws random numbers (dropout): each node draws its own stream,
                    # as a volunteer does, which one batched call cannot; compute node by node
                    self.vectorize = False
                    return self._per_node(idx, self.task())
            if everyone:
                self.momenta = m
            else:
                self.momenta[idx] = m
        return rows.cpu()

    def play_round(self) -> dict | None:
        """The next round's record, played on the product's serve loop (``nodes.engine.serve``,
        see :mod:`evaluation.bench.drivers.serving`): a synchronous round (the task ledger plus a
        barrier), or the next buffer of asynchronous replies (``round = async``: a reply that
        fills several buffers at once has them all aggregated, as a deployment does, and they
        are returned one a call); ``None`` once the run is done or no buffer can fill any more."""
        if self.ready:
            return self.ready.pop(0)
        if self.engine.done:
            return None
        if not self.setup.settings.asynchronous:
            return self.loop.play_round(False)
        self.ready = self.loop.next_buffers()
        return self.ready.pop(0) if self.ready else None

    def add(self, record: dict) -> None:
        """Keep round ``record`` with its simulated time."""
        traffic = self.timeline.traffic
        record["time"], record["bytes_up"], record["bytes_down"] = (self.timeline.now, traffic.bytes_up,
                                                                   traffic.bytes_down)
        self.records.append(record)
        if self.kept is not None and record["aggregate_sha256"] is not None:  # the rows used: named from now on
            used = [self.index[fp] for fp in record["ids"]]
            self.kept[used] = self.momenta[used]
        if self.engine.round == self.stop:  # the backdoor's last attacked round: how much it holds now
            self.asr_at_stop = backdoor_success(self.setup, self.engine.w, self.memories)

    @property
    def memories(self) -> list[Memory]:
        """What each remembering attacker kept of its last round, in canonical order."""
        return [self.last[i] for i in sorted(self.last)]

    @property
    def mode(self) -> str:
        """How the rows were computed: ``local`` (batched), ``per-node``, or batched with the
        attackers that train alone computed per node."""
        if not self.vectorize:
            return "per-node"
        return "local, attackers per node" if any(self.alone) else "local"

    def record(self, wall: float) -> dict:
        """The cell's result record, with its simulated clock and bytes per round; against an
        absolute ``target-accuracy``, what reaching it cost (``evaluation.reports.target_costs``)."""
        record = {**cell_record(self.setup, self.records, self.engine.w, self.threat.kappa, wall, self.training,
                                self.mode, self.asr_at_stop, self.memories),
                  "device": device_name(self.device),  # where the batched kernels trained
                  **self.timeline.record(), "times": [r["time"] for r in self.records],
                  "bytes": [r["bytes_up"] for r in self.records],
                  "bytes_down_by_round": [r["bytes_down"] for r in self.records]}
        bar = self.setup.cell.config.get("target-accuracy")
        return with_costs(record, bar) if bar else record


def run_cell(cell: Cell, vectorize: bool = True) -> dict:
    """Train the cell's scenario under its attack and defence; return its result record."""
    run = CellRun(cell, vectorize)
    start = time.perf_counter()
    while run.play_round() is not None:
        pass
    return run.record(time.perf_counter() - start)
