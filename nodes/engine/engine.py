"""THE round engine: the one round function of the coordinator and of every bench driver.

It knows nothing of Flower or of the harness. :class:`Engine` holds a training run between
rounds (the global model ``w``, the aggregation chain and its state, the protocol's server
state, the flag policy, the round count) and :meth:`Engine.step` plays one round on the
rows the nodes sent:

    canonical order -> validate -> quorum -> threat-model hook (bench only) -> spot checks
    -> aggregate -> score -> flag -> apply -> evaluate -> record

The deployed coordinator (``nodes.coordinator.coordinator``, fed by the Flower ServerApp), the local
bench driver (vectorised or per node) and the Flower simulation driver all call it, so a
benchmark describes what users deploy. Everything runs under the run's compute profile
(``threads``) and is a function of the settings and the rows: the same rows give the same
bits whatever order they arrived in. A rule's error is never swallowed: a round makes no
step, with its reason recorded, only when it has fewer valid rows than its quorum or a
number of rows the rule declares it cannot serve (``check_n``); the hook plays only in a
round that steps.

The pieces of a round that need no model or data (:func:`canonical` order, :func:`valid`
rows, the skip rule :func:`cannot_step`, :func:`judge`, the :func:`record`) are functions that
:meth:`Engine.step` calls, and so does ``RobustStrategy`` (``nodes.strategy``), whose Flower
app holds the model.

The rule, its pre-aggregators and the detectors run on the run's ``device`` (:func:`assess`):
the rows' blocks go there as they are read, the aggregate and the scores come back to the CPU.
The model, its protocol step, its evaluation and every hash stay on the CPU: the step is one
``O(d)`` pass that a transfer would cost as much as, and the accuracy, the checkpoint and the
tasks sent then depend on the device only through the aggregate. A round on CUDA runs under
the profile's deterministic algorithms: the same bits twice on the same GPU, but not always
the CPU's (float sums run in another order there), so its record names the device
(:func:`ran_on`) and a replay elsewhere says so (:func:`replay_note`).

Rules that need more than the rows (``aggregators.RoundInputs``) get the rows' node ids, the
global model the rows were computed from, and, for ``fltrust``, the coordinator's own update on
its root data (``nodes.engine.root``), computed once per round that steps. Where it holds a root
set, the engine also measures what each row alone, at its share of the mean, does to the root
data's loss (the ``loss-score`` detector) and rates the nodes by it across rounds, the ratings
the ``loss-score`` rule reads (``nodes.engine.loss_ratings``).

Every row comes with its task (``nodes.engine.ledger.Ticket``: its number, the model it carried and
that model's version). Asynchronous rounds (``round = async``, FedBuff) and carried late
replies (``late = carry``) hold rows computed from older model versions: the engine rejects rows
staler than ``max-staleness`` and, after the threat hook and the spot checks (which see the
rows as their nodes sent them), scales the others by the ``staleness`` weight
(``nodes.engine.staleness``) before the rule. The record keeps each row's staleness: with the rows,
the schedule that makes a round a pure function. With
``lookahead``, tasks carry :meth:`Engine.task_model` (``nodes.engine.lookahead``: the model
extrapolated by the expected staleness), whose SHA-256 the record keeps as ``task_sha256``.

Spot checks (``spot-check = p``, ``nodes.engine.spotcheck``): the committed rows' hashes seed a draw
of the rows to recompute; the engine's ``verifier`` (the coordinator's, the bench's, or a
log's replay) recomputes each drawn row from that row's own task (a straggler's from the older
model it was sent) and returns the verdicts; a convicted node's row is dropped before the rule
and the node banned. Under ``momentum`` each task names the worker momentum its node continues
from (``nodes.engine.states``: the node's last row a round used), and a check recomputes from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager as ContextManager, nullcontext
from dataclasses import replace
from typing import Protocol as Interface

import torch
from torch import nn

import aggregators
from aggregators.base import ROOT_NEEDS
from robust import codecs
from robust.compute import device_name, profile, resolve_device
from robust.models import Scorer
from robust.params import flat_params, sha256, trained, unflatten
from robust.seeds import generator
from robust.source import Rows, as_rows, on_device, scaled, take, validated

from . import loss_ratings
from .detectors import score_round
from .flags import FlagPolicy
from .ledger import Ticket
from .lookahead import Lookahead
from .protocol import Protocol
from .root import Root
from .rows import rejected_rows
from .spotcheck import Verifier, draw, round_seed
from .staleness import stale_reason, weight_of
from .states import States


class ThreatHook(Interface):
    """The bench's threat model: sees a round's valid rows before the rule (and may replace
    the Byzantine ones, as an omniscient attacker would), and the aggregate after it. ``rows``
    returns the tensor it was given, unmodified, or a new one, whose rows the engine screens
    again."""

    def rows(self, engine: Engine, round: int, ids: list[str], X: torch.Tensor) -> torch.Tensor: ...

    def observe(self, ids: list[str], X: torch.Tensor, aggregate: torch.Tensor | None) -> None: ...


def judge(chain, flags: FlagPolicy, t: int, ids: list, X: torch.Tensor | Rows, rejected: dict, step: bool,
          inputs: aggregators.RoundInputs | None = None, device: torch.device | str = "cpu",
          effects: torch.Tensor | None = None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor], list]:
    """The robust core of round ``t``, the same in the engine and in ``RobustStrategy``: the
    rule's aggregate of the rows ``X`` of ``ids`` (``None`` unless the round ``step``s; a rule
    that needs them gets ``inputs``), the detectors' scores (both computed on ``device``, see
    :func:`assess`; ``effects``: the rows' loss scores, where the caller holds a root set), and
    the nodes the flag policy flags (``rejected`` ones included)."""
    aggregate, scores = assess(chain, X, step, inputs, device, effects)
    return aggregate, scores, flags.update(t, ids, scores, rejected)


def assess(chain, X: torch.Tensor | Rows, step: bool, inputs: aggregators.RoundInputs | None = None,
           device: torch.device | str = "cpu", effects: torch.Tensor | None = None
           ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The rule's aggregate of the rows ``X`` (``None`` unless ``step``) and the detectors'
    scores (none for no rows; ``effects``: the ``loss-score``), computed on ``device``: the rows'
    blocks are moved there as they are read (never the ``(n, d)`` matrix), with ``inputs``; both
    results come back to the CPU, where the protocol step, the records and the hashes read them.
    The rule's carried state stays on ``device`` between calls (``Engine.state`` hands out CPU
    copies)."""
    rows = on_device(as_rows(X), device)
    aggregate = chain(rows, None if inputs is None else inputs.to(rows.device)) if step else None
    kept = chain.last_kept if aggregate is not None else None
    scores = score_round(rows, chain.f, kept, effects) if rows.n else {}
    return (None if aggregate is None else aggregate.cpu()), {name: v.cpu() for name, v in scores.items()}


def ran_on(device: torch.device) -> str:
    """The device a round ran on, as its record names it (``""`` for the CPU: its records say
    nothing, as before there was a choice): ``cuda/<GPU name>``, whose bits a replay needs."""
    return "" if device.type == "cpu" else device_name(device)


def replay_note(records: list[dict], device: torch.device) -> str:
    """What a replay on ``device`` of a run whose ``records`` ran elsewhere must say (``""``
    when every round ran on a device like this one)."""
    here = ran_on(device) or "cpu"
    there = sorted({r.get("device") or "cpu" for r in records} - {here})
    if not there:
        return ""
    why = " (torch sees no GPU here)" if device.type == "cpu" and not torch.cuda.is_available() else ""
    return (f"the run ran on {', '.join(there)}, this replay on {here}{why}: bits differ across devices, so its "
            "rounds need not match the log; replay on the run's kind of device to check them bit for bit")


def canonical(ids: list, X: torch.Tensor | Rows) -> tuple[list, torch.Tensor | Rows]:
    """The rows ``X`` of ``ids`` sorted by node identity: a rule's input, and so its bits, do
    not depend on the order the replies arrived in."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order == list(range(len(ids))):
        return ids, X
    return [ids[i] for i in order], take(X, order)


def valid(ids: list, X: torch.Tensor | Rows, max_norm: float, rejected: dict) -> tuple[list, torch.Tensor | Rows]:
    """The rows that can be used (a source comes back marked ``validated``; one marked already,
    such as a coordinator's spool of rows checked one by one as they arrived, is not read
    again); the others go to ``rejected`` with their reason."""
    bad = {} if isinstance(X, Rows) and X.validated else rejected_rows(X, max_norm)
    if bad:
        rejected.update({ids[i]: reason for i, reason in bad.items()})
        keep = [i for i in range(len(ids)) if i not in bad]
        ids, X = [ids[i] for i in keep], take(X, keep)
    return ids, (validated(X) if isinstance(X, Rows) else X)


def cannot_step(chain, quorum: int, n: int) -> str:
    """Why a round with ``n`` valid rows makes no step ("" if it does): below the ``quorum``,
    or a number of rows the rule refuses (MDA above its subset limit)."""
    if n < quorum:
        return f"{n} valid rows, quorum is {quorum}: no step"
    try:
        chain.check_n(n)
    except ValueError as err:
        return f"no step: {err}"
    return ""


def record(t: int, asked: list, ids: list, rejected: dict, failed: dict, flags: FlagPolicy, flagged: list,
           skipped: str, aggregate: torch.Tensor | None, scores: dict[str, torch.Tensor], model: dict,
           rows: dict) -> dict:
    """Round ``t``'s record (JSON-ready), the same for every driver and ``RobustStrategy``:
    ``model`` says what the round made of the model (its SHA-256, its accuracy where a driver
    has test data), ``rows`` what a driver knows of the rows beyond their ids (their tasks,
    spot checks, staleness). ``typical`` is the flag policy's run-wide typical distance
    after the round (``nodes.engine.flags``), ``own`` the flagged nodes' own where that was
    higher. With a ``false_alarm`` target, ``evidence`` holds the threshold ``h`` and the CUSUM
    ``S`` of each node scored this round (``nodes.engine.evidence``), and ``loss_evidence`` the
    same of the loss score's with ``loss-evidence`` on."""
    return {
        "round": t, "asked": len(asked), "accepted": len(ids), "ids": ids,
        "rejected": dict(sorted(rejected.items())), "failed": dict(sorted(failed.items())),
        "missing": sorted(set(asked) - set(ids) - set(rejected) - set(failed)), "flagged": flagged,
        "quarantined": sorted(flags.quarantined),
        "why": {node: flags.why[node] for node, r in sorted(flags.quarantined.items()) if r == t},
        "typical": flags.typical,
        # the flagged nodes judged against their own typical distance, the run's being lower
        "own": {node: own for node in flagged if (own := flags.level(node)) > flags.typical},
        "skipped": skipped, **model, "aggregate_sha256": None if aggregate is None else sha256(aggregate), **rows,
        "scores": {name: s.tolist() for name, s in scores.items()},
        **{key: {"h": cusum.h, "S": {node: cusum.S[node] for node in ids if node in cusum.S}}
           for key, cusum in flags.cusums()},
    }


def sample(pool: list, k: int, *seed: object) -> list:
    """``k`` of ``pool`` in sorted order, drawn by a generator seeded with ``seed``; all of
    ``pool`` when ``k >= len(pool)``."""
    pool = sorted(pool)
    if k >= len(pool):
        return pool
    order = torch.randperm(len(pool), generator=generator(*seed))
    return sorted(pool[i] for i in order[:k].tolist())


class Engine:
    def __init__(self, settings, model: nn.Module, x_test: torch.Tensor, y_test: torch.Tensor,
                 hook: ThreatHook | None = None, verifier: Verifier | None = None, root: Root | None = None) -> None:
        s = self.settings = settings
        self.model, self.x_test, self.y_test, self.hook = model, x_test, y_test, hook
        if s.spot_check and verifier is None:
            raise ValueError(f"spot-check={s.spot_check:g} needs a verifier to recompute updates (a driver's error)")
        self.verifier = verifier
        self.w = flat_params(model)
        self.scorer = Scorer(model)
        self.chain = aggregators.build(s.aggregator, s.tolerate)
        if self.chain.needs & ROOT_NEEDS and root is None:
            raise ValueError(f"{s.aggregator} needs the coordinator's root data: build the engine with "
                             "nodes.engine.root.Root.of(settings, data) (a driver's error)")
        self.root = root
        self.ratings = None if root is None else loss_ratings.Ratings()  # the nodes' loss-score ratings
        self.protocol = Protocol.of(s)
        self.flags = FlagPolicy(s.flag_ratio, s.quarantine_after, s.false_alarm, s.rounds, s.flag_own,
                                loss=s.loss_evidence)
        self.quorum = s.quorum_needed
        self.device = resolve_device(s.device)  # the rule's and the detectors'; the model stays on the CPU
        self.weight = weight_of(s.staleness)
        self.buffer: torch.Tensor | None = None  # the protocol's outer momentum
        self.lookahead = Lookahead() if s.lookahead and s.round == "async" else None
        self.downlink = None if s.downlink == "none" else codecs.build(s.downlink)
        self._sent: tuple[int, torch.Tensor, str] | None = None  # (round, model, SHA-256) tasks carry
        # momentum work is checked from the momentum each task names (nodes.engine.states)
        self.states = States(self.w.numel()) if s.spot_check and self.protocol.keeps_momentum else None
        self.round = 0  # rounds finished
        # ``clock(phase)``: a context manager timing the step's phases ("spot checks", "loss score", "rule",
        # "evaluation"), the coordinator's (its records' ``costs``); none in the bench
        self.clock: Callable[[str], ContextManager] = lambda phase: nullcontext()

    @property
    def w(self) -> torch.Tensor:
        """The global model, flat; :attr:`base` is its SHA-256, kept with it (checking a reply
        against the base must not re-hash the model)."""
        return self._w

    @w.setter
    def w(self, value: torch.Tensor) -> None:
        self._w, self.base = value, sha256(value)
        # the model's trained parameters are views of it: the engine holds the model once (its
        # structure serves unflatten and the drivers; nothing trains it in place)
        for (_, param), view in zip(trained(self.model), unflatten(value, self.model).values()):
            if view.dtype == param.dtype and view.device == param.device:
                param.data = view

    def task_model(self) -> tuple[torch.Tensor, str]:
        """The model a task sent now carries (float32), and its SHA-256: :attr:`w` (:attr:`base`);
        with ``lookahead`` the model extrapolated by the expected staleness (``nodes.engine.lookahead``);
        with ``downlink = fp16`` rounded to half precision (``fp16``'s codec: saturating, round to
        nearest even), as it travels."""
        if self.lookahead is None and self.downlink is None:
            return self.w, self.base
        if self._sent is None or self._sent[0] != self.round:
            w = self.w if self.lookahead is None else self.lookahead.predict(self.w)
            if self.downlink is not None:
                w = self.downlink.decode(self.downlink.encode(w, ()), w.numel())
            self._sent = (self.round, w, sha256(w))
        return self._sent[1], self._sent[2]

    def named_state(self, node: str) -> str:
        """The momentum ``node``'s next task continues from (``nodes.engine.states``; ``""``: the
        run names none, the node carries its own)."""
        return "" if self.states is None else self.states.named(node)

    @property
    def done(self) -> bool:
        return self.round >= self.settings.rounds

    def select(self, candidates: list[str]) -> list[str]:
        """The nodes asked next round, in canonical order: the candidates not quarantined, or
        a seeded sample of ``per_round`` of them."""
        pool = set(candidates) - set(self.flags.quarantined)
        return sample(pool, self.settings.per_round or len(pool), self.settings.seed, self.round + 1, "select")

    def inputs(self, ids: list[str]) -> aggregators.RoundInputs:
        """What a rule may need besides the rows of ``ids`` in round ``self.round + 1``."""
        reference = self.root.update(self.round + 1, self.w) if "reference" in self.chain.needs else None
        ratings = self.ratings.ordinals(ids) if "ratings" in self.chain.needs else None
        return aggregators.RoundInputs(ids=tuple(ids), w=self.w, reference=reference, ratings=ratings)

    def loss_effects(self, X: Rows) -> torch.Tensor | None:
        """What each row of ``X`` alone, at its share of the mean, does to the loss of the root
        samples, the ``loss-score`` (``nodes.engine.loss_ratings``); ``None`` without a root set."""
        if self.root is None:
            return None
        return loss_ratings.effects(self.scorer, self.protocol, self.root, self.w, self.buffer, X)

    def evaluate(self) -> tuple[float, float]:
        """The model's ``(accuracy, loss)`` on the test set (a text set: next-token accuracy and
        the held-out loss)."""
        return self.scorer.evaluate(self.w, self.x_test, self.y_test)

    def ticket(self, node: str) -> Ticket:
        """The task of a node asked this round with the current task model (a synchronous
        round's fresh row)."""
        w, base = self.task_model()
        return Ticket(node, self.round + 1, self.round, base, w)

    def step(self, asked: list[str], ids: list[str], X: torch.Tensor, rejected: dict[str, str] | None = None,
             failed: dict[str, str] | None = None, tasks: Mapping[str, Ticket] | None = None) -> dict:
        """Play round ``self.round + 1`` on the rows ``X`` (one per node of ``ids``, any order)
        of the ``asked`` nodes; ``rejected`` replies (bad content) count as flags, ``failed``
        ones (lost, declined) do not; ``tasks``: the task each row answers (a fresh one of this
        round, :meth:`ticket`, where none is given). Returns the round's record (JSON-ready)."""
        t, rejected = self.round + 1, dict(rejected or {})
        if X.dtype != self.w.dtype or tuple(X.shape) != (len(ids), self.w.numel()):
            raise ValueError(f"rows of {X.dtype} {tuple(X.shape)} for {len(ids)} nodes: the engine takes "
                             f"{self.w.dtype} ({len(ids)}, {self.w.numel()}) (a driver's error, not a node's)")
        tasks = {i: (tasks or {}).get(i) or self.ticket(i) for i in ids}
        staleness = {i: tasks[i].staleness(self.round) for i in ids} if self.settings.stale_rows else None
        with profile(self.settings.threads):
            ids, X = valid(*canonical(ids, as_rows(X)), self.settings.max_norm, rejected)
            if staleness is not None:
                ids, X = self._fresh_enough(ids, X, staleness, rejected)
            skipped = cannot_step(self.chain, self.quorum, len(ids))
            if self.hook is not None and not skipped:  # an attack crafts only for a round that steps
                given = X.tensor()
                played = self.hook.rows(self, t, ids, given)
                if played is not given:  # rows the hook crafted are screened as any node's; its own rows were
                    ids, X = valid(ids, as_rows(played), self.settings.max_norm, rejected)
                    skipped = cannot_step(self.chain, self.quorum, len(ids))  # crafted rows may have been rejected
            verdicts, convicted = [], []
            if self.settings.spot_check and not skipped:
                with self.clock("spot checks"):
                    ids, X, verdicts, convicted = self._spot_check(t, ids, X, tasks, rejected)
                skipped = cannot_step(self.chain, self.quorum, len(ids))
            used = X  # as the nodes sent them
            if staleness is not None:
                X = scaled(X, torch.tensor([self.weight(staleness[i]) for i in ids], dtype=X.dtype))
            effects = None
            if self.root is not None and X.n:
                with self.clock("loss score"):
                    effects = self.loss_effects(X)
                    self.ratings.update(ids, effects)
            inputs = None if skipped or not self.chain.needs else self.inputs(ids)
            # only the rule and the detectors run under the device's profile: CUDA's deterministic mode is
            # process-wide and would change the CPU algorithms of a spot check's recomputation or the root update
            with self.clock("rule"), profile(self.settings.threads, self.device):
                aggregate, scores, flagged = judge(self.chain, self.flags, t, ids, X, rejected, not skipped, inputs,
                                                   self.device, effects)
            if aggregate is not None:
                if self.states is not None:
                    self.states.keep(ids, used)
                w_old = self.w
                with self.clock("rule"):
                    self.w, self.buffer = self.protocol.apply(self.w, aggregate, self.buffer)
                if self.lookahead is not None:
                    self.lookahead.observe(w_old, self.w, [staleness[i] for i in ids] if staleness else [])
            if self.hook is not None:
                self.hook.observe(ids, X.tensor(), aggregate)
            self.round = t
            with self.clock("evaluation"):
                acc, loss = self.evaluate()
        rows = {
            **({"task_sha256": self.task_model()[1]} if self.lookahead is not None or self.downlink is not None else {}),
            "spot": [v.record() for v in verdicts], "convicted": convicted,
            **({"staleness": {i: int(staleness[i]) for i in sorted({*ids, *convicted})}}
               if staleness is not None else {}),
        }
        device = ran_on(self.device)
        return record(t, asked, ids, rejected, failed or {}, self.flags, flagged, skipped, aggregate, scores,
                      {"accuracy": acc, "loss": loss, "model_sha256": self.base,
                       **({"device": device} if device else {})}, rows)

    def _spot_check(self, t: int, ids: list[str], X: Rows, tasks: Mapping[str, Ticket],
                    rejected: dict[str, str]) -> tuple[list[str], Rows, list, list[str]]:
        """Draw round ``t``'s checks from its committed rows, ask the verifier to recompute each
        from its own task, and ban the convicted: ``(ids, X without their rows, verdicts, convicted)``."""
        seed = round_seed(self.settings.seed, t, ids, X.sha256s())
        drawn = draw(seed, ids, self.settings.spot_check)
        if not drawn:
            return ids, X, [], []
        index = {fp: i for i, fp in enumerate(ids)}
        verdicts = self.verifier(t, {fp: (self._from_state(tasks[fp]), X.row(index[fp])) for fp in drawn})
        convicted = sorted({fp for v in verdicts for fp in v.guilty})
        for v in verdicts:
            for fp in v.guilty:
                self.flags.convict(fp, t, {"author": v.author, "verifier": v.verifier, "distance": v.distance})
                if fp in index:
                    what = "its update" if fp == v.author else f"its check of {v.author[:12]}'s update"
                    ruling = next((d for d in v.disputes if d["node"] == fp), None)
                    rejected[fp] = (f"convicted in a dispute over {what}: {ruling['reason']}" if ruling else
                                    f"convicted: {what} differs from the coordinator's recomputation"
                                    + (f" (relative distance {v.distance:.3g})" if fp == v.author else ""))
        keep = [i for i, fp in enumerate(ids) if fp not in convicted]
        return [ids[i] for i in keep], X.take(keep), verdicts, convicted

    def _from_state(self, ticket: Ticket) -> Ticket:
        """``ticket`` with the momentum its task continued from, where the run names one (a node
        has one training task out, and only its own used row moves its named momentum)."""
        return ticket if self.states is None else replace(ticket, start=self.states.start(ticket.node))

    def _fresh_enough(self, ids: list[str], X: Rows, staleness: dict[str, int], rejected: dict[str, str]
                      ) -> tuple[list[str], Rows]:
        """The rows no staler than ``max-staleness``; the others go to ``rejected``."""
        stale = {i: reason for i in ids if (reason := stale_reason(staleness[i], self.settings.max_staleness))}
        if not stale:
            return ids, X
        rejected.update(stale)
        keep = [k for k, i in enumerate(ids) if i not in stale]
        return [ids[k] for k in keep], X.take(keep)

    def state(self) -> dict:
        """What a checkpoint keeps: :meth:`load_state` resumes to the same bits."""
        chain = {k: v.cpu() for k, v in self.chain.state().items()}  # a checkpoint loads on any machine
        state = {"w": self.w, "round": self.round, "chain": chain, "flags": self.flags.state()}
        if self.buffer is not None:
            state["buffer"] = self.buffer
        if self.root is not None:
            state["root"] = self.root.state()
            state["ratings"] = self.ratings.state()
        if self.lookahead is not None:
            state["lookahead"] = self.lookahead.state()
        if self.states is not None:
            state["states"] = self.states.state()
        return state

    def load_state(self, state: dict) -> None:
        self.w, self.round = state["w"], int(state["round"])
        self.chain.load_state({k: v.to(self.device) for k, v in state["chain"].items()})  # beside the rows
        self.flags.load_state(state["flags"])
        self.buffer = state.get("buffer")
        if self.root is not None:
            self.root.load_state(state.get("root", {}))
            self.ratings.load_state(state.get("ratings", {}))
        if self.lookahead is not None:
            self.lookahead.load_state(state.get("lookahead", {}))
        if self.states is not None:
            self.states.load_state(state.get("states", {}))
        self._sent = None
