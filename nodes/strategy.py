"""``RobustStrategy``: Flower's ``FedAvg`` with robust aggregation, for users' own Flower apps.

Their ClientApps reply with trained weights, as for FedAvg. Each training round,
:meth:`RobustStrategy.aggregate_train` turns every reply into a row, the update
``w_reply - w_sent`` of the model's float arrays, and plays the round engine's own pieces on
the rows (``nodes.engine``: canonical order, validation, the skip rule of quorum and rule size,
the rule, the detectors and the flag policy, the record), then the ``delta`` protocol's step
(``nodes.engine.protocol``: ``w + server_lr F``, or outer momentum). What is its own is Flower's side:
replies into rows (a malformed reply rejected with its reason and flagged, an error reply
recorded without a flag: a crash is not a lie) and rows back into the model's arrays. Whatever
nodes send, the run goes on: a round without enough valid rows makes no step and says why.
Quarantined nodes are not asked. :attr:`RobustStrategy.history` has the engine's record of
each round.

Float16, float32 and float64 arrays are aggregated, as FedAvg does; every array comes back in
its own shape and dtype. Rows are float32 whatever the model's dtypes, as in the engine: one
dtype for every rule, detector and check. A row is an update, so float32 rounds it relative to
the update, not to the weights; the step is added to the weights in float64 when the model has
a float64 array (float32 otherwise, which holds float16 values exactly), then each array is
rounded to its dtype. Arrays of other dtypes (BatchNorm's ``num_batches_tracked``) keep the
values sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import sample_nodes

import aggregators
from aggregators.base import ROOT_NEEDS
from robust.compute import profile
from robust.constraints import Flag, Interval, Param, table

from .engine.engine import canonical, cannot_step, judge, record, sample, valid
from .engine.flags import FlagPolicy
from .engine.protocol import Protocol
from .settings import RUN
from .wire import HEADER_CAP

PARAMS = table(
    *(RUN[k] for k in ("aggregator", "tolerate", "protocol", "max-norm", "flag-ratio", "quarantine-after",
                       "false-alarm", "seed", "threads")),
    Param("weighted", Flag(), False, "weigh each update by its reply's sample count (a lying node can inflate it)"),
    Param("fraction-train", Interval(float, 0, 1), 1.0, "share of the nodes not quarantined asked to train"),
    Param("fraction-evaluate", Interval(float, 0, 1), 1.0, "share of the nodes not quarantined asked to evaluate"),
    Param("min-train-nodes", Interval(int, 0, None), 2, "fewest nodes asked to train"),
    Param("min-evaluate-nodes", Interval(int, 0, None), 2, "fewest nodes asked to evaluate"),
    Param("min-available-nodes", Interval(int, 0, None), 2, "nodes to wait for before a round"),
)

FLOATS = tuple(np.dtype(name) for name in ("float16", "float32", "float64"))  # the dtypes aggregated


def _flat(arrays: dict[str, np.ndarray], keys: list[str], dtype: torch.dtype) -> torch.Tensor:
    """The arrays ``keys`` of ``arrays``, flattened into one ``(d,)`` tensor of ``dtype``."""
    return torch.cat([torch.from_numpy(arrays[k]).reshape(-1).to(dtype) for k in keys])


@dataclass(frozen=True)
class Sent:
    """The model sent in a round: its arrays, and its float ones flattened (``w``), in float64
    if one is float64 and in float32 otherwise: every value exactly, and the step added at the
    model's own precision."""

    arrays: dict[str, np.ndarray]
    floats: list[str]  # the keys of the arrays that are aggregated, in the record's order
    w: torch.Tensor

    @classmethod
    def of(cls, record: ArrayRecord) -> Sent:
        arrays = {key: array.numpy() for key, array in record.items()}
        floats = [key for key, a in arrays.items() if a.dtype in FLOATS]
        if not floats:
            raise ValueError("the model sent has no float16, float32 or float64 array: RobustStrategy aggregates "
                             "float weights")
        dtype = torch.float64 if any(arrays[k].dtype == np.float64 for k in floats) else torch.float32
        return cls(arrays, floats, _flat(arrays, floats, dtype))

    def update(self, content: RecordDict) -> torch.Tensor | str:
        """The reply's row, ``w_reply - w`` in float32 (``(d,)``), or why the reply cannot be
        read (the engine judges the row's values)."""
        records = list(content.array_records.values())
        if len(records) != 1:
            return f"{len(records)} ArrayRecords in the reply, expected 1"
        record = records[0]
        missing, extra = [k for k in self.arrays if k not in record], [k[:40] for k in record if k not in self.arrays]
        if missing or extra:
            differences = [f"{what} {keys[:3]}{' ...' if len(keys) > 3 else ''}"
                           for what, keys in (("missing", missing), ("unexpected", extra)) if keys]
            return f"arrays differ from the model sent: {', '.join(differences)}"
        values = {}
        for key, sent in self.arrays.items():
            value = _decode(key, record[key], sent)
            if isinstance(value, str):
                return value
            values[key] = value
        return (_flat(values, self.floats, self.w.dtype) - self.w).to(torch.float32)

    def record(self, w: torch.Tensor) -> ArrayRecord:
        """The model with float values ``w``, each array rounded to its own dtype in its own
        shape (a scalar stays 0-dim), the others as sent."""
        pieces = dict(zip(self.floats, torch.split(w, [self.arrays[k].size for k in self.floats])))
        return ArrayRecord({key: Array(pieces[key].numpy().astype(a.dtype).reshape(a.shape) if key in pieces else a)
                            for key, a in self.arrays.items()})


def _decode(key: str, array: Array, sent: np.ndarray) -> np.ndarray | str:
    """A reply's array ``key``, read only if its bytes can hold the array sent, or why not."""
    if len(array.data) > sent.nbytes + HEADER_CAP:
        return f"array {key!r} is {len(array.data)} bytes, the model's takes at most {sent.nbytes + HEADER_CAP}"
    try:
        value = array.numpy()
    except Exception as err:  # noqa: BLE001 - untrusted bytes: any parser failure is a rejection
        return f"array {key!r} is not a numpy array ({type(err).__name__})"
    if value.dtype != sent.dtype:
        return f"array {key!r} is {value.dtype}, expected {sent.dtype}"
    if value.shape != sent.shape:
        return f"array {key!r} has shape {value.shape}, expected {sent.shape}"
    return value


def sample_count(content: RecordDict, key: str) -> float | str:
    """The reply's sample count (its one ``key`` metric, a number > 0), or why it has none."""
    values = [record[key] for record in content.metric_records.values() if key in record]
    if len(values) != 1:
        return f"one {key!r} metric expected in the reply, found {len(values)}"
    value = values[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return f"{key!r} is {str(value)[:40]}, not a number > 0"
    return float(value)


class RobustStrategy(FedAvg):
    """FedAvg's workflow with a robust aggregator, reply validation and the flag policy.

    ``aggregator`` is a spec of ``aggregators`` (``nnm+trimmed-mean``, ``krum``...), built
    for ``tolerate`` Byzantine replies per round; a round steps with at least the fewest valid
    updates the rule serves; ``protocol`` is the server's step, a ``delta`` spec
    (``delta:server_lr=0.5,server_momentum=0.9``: its ``steps`` are the ClientApps' own
    business); ``max_norm`` bounds an update's L2 norm;
    ``flag_ratio``, ``flag_own``, ``quarantine_after`` and ``false_alarm`` are the flag policy's (its
    evidence over rounds is calibrated to :meth:`start`'s ``num_rounds``); ``weighted`` weighs the
    updates by their ``weighted_by_key`` metric (rows scaled by ``n c_i / sum c`` before the
    rule, so ``mean`` gives the weighted mean); ``seed`` draws the nodes asked when a
    fraction is below 1; ``threads`` is the compute profile of the aggregation. Every other
    keyword goes to :class:`FedAvg`.
    """

    def __init__(self, aggregator: str = RUN["aggregator"].default, tolerate: int = RUN["tolerate"].default, *,
                 protocol: str = RUN["protocol"].default, max_norm: float = RUN["max-norm"].default,
                 flag_ratio: float = RUN["flag-ratio"].default, flag_own: bool = RUN["flag-own"].default,
                 quarantine_after: int = RUN["quarantine-after"].default,
                 false_alarm: float = RUN["false-alarm"].default, weighted: bool = False,
                 seed: int = RUN["seed"].default, threads: int = RUN["threads"].default, **fedavg: object) -> None:
        super().__init__(**fedavg)
        self.aggregator, self.tolerate, self.max_norm, self.weighted = aggregator, tolerate, max_norm, weighted
        self.flag_ratio, self.quarantine_after, self.seed, self.threads = flag_ratio, quarantine_after, seed, threads
        self.false_alarm, self.protocol, self.flag_own = false_alarm, protocol, flag_own
        for p in PARAMS.values():
            try:
                setattr(self, p.attr, p.check(getattr(self, p.attr)))
            except ValueError as err:  # its message names the key: name the Python argument
                raise ValueError(f"RobustStrategy: {str(err).replace(p.key, p.attr)}") from None
        try:
            self.chain = aggregators.build(self.aggregator, self.tolerate)
        except ValueError as err:
            raise ValueError(f"RobustStrategy: {err}") from None
        if self.chain.needs & ROOT_NEEDS:
            raise ValueError(f"RobustStrategy: {self.aggregator} needs what the server computes on root data, which a "
                             "strategy does not hold: run it with `robust coordinator` (root = N)")
        self.server_step = Protocol.parse(self.protocol, lr=0.0, momentum=0.0, batch_size=1)  # nodes train as they like
        if self.server_step.kind != "delta":
            raise ValueError(f"RobustStrategy: protocol {self.protocol!r} steps w - lr F on momenta the nodes send; "
                             "ClientApps reply with trained weights: use delta (server_lr, server_momentum, nesterov)")
        self.quorum = self.chain.least_n()  # the engine's default: the fewest valid rows the rule serves
        self.flags = FlagPolicy(self.flag_ratio, self.quarantine_after, own=self.flag_own)
        self.buffer: torch.Tensor | None = None  # the protocol's outer momentum
        self.history: list[dict] = []
        self._sent: tuple[int, Sent, list[int]] | None = None  # round, model, nodes asked

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, *args, **kwargs):
        """FedAvg's, with the flag policy's evidence calibrated to ``num_rounds`` and no outer
        momentum from an earlier run."""
        self.flags = FlagPolicy(self.flag_ratio, self.quarantine_after, self.false_alarm, num_rounds, self.flag_own)
        self.buffer = None
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    def summary(self) -> None:
        """Log the robust settings, then FedAvg's."""
        log(INFO, "\t├──> Robust: %r, %s, max_norm %g, weighted %s, flag ratio %g, quarantine after %d flag(s)",
            self.chain, self.protocol, self.max_norm, self.weighted, self.flag_ratio, self.quarantine_after)
        super().summary()

    def _sample(self, grid: Grid, server_round: int, fraction: float, least: int, purpose: str) -> list[int]:
        """The nodes asked, in order: the connected ones not quarantined, or a seeded draw."""
        if fraction == 0.0:
            return []
        _, connected = sample_nodes(grid, self.min_available_nodes, 0)  # waits for them, as FedAvg does
        pool = sorted(set(connected) - set(self.flags.quarantined))
        k = min(len(pool), max(int(len(pool) * fraction), least))
        log(INFO, "configure_%s: asking %d of %d connected node(s), %d quarantined", purpose, k, len(connected),
            len(connected) - len(pool))
        return sample(pool, k, self.seed, server_round, purpose)

    def _configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, nodes: list[int],
                   message_type: str) -> Iterable[Message]:
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, nodes, message_type)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """FedAvg's, asking no quarantined node and remembering the model sent."""
        sent = Sent.of(arrays)
        nodes = self._sample(grid, server_round, self.fraction_train, self.min_train_nodes, "train")
        self._sent = (server_round, sent, nodes)
        return self._configure(server_round, arrays, config, nodes, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        """FedAvg's, asking no quarantined node."""
        nodes = self._sample(grid, server_round, self.fraction_evaluate, self.min_evaluate_nodes, "evaluate")
        return self._configure(server_round, arrays, config, nodes, MessageType.EVALUATE)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The model sent, stepped by the protocol with the robust aggregate of the valid updates
        (``None``: the round made no step), and the accepted replies' metrics; appends the
        round's record to :attr:`history`."""
        if self._sent is None or self._sent[0] != server_round:
            raise RuntimeError(f"aggregate_train(round {server_round}) without configure_train for that round: "
                               "call configure_train first, as Strategy.start does")
        _, sent, asked = self._sent
        accepted, rejected, failed = self._read(server_round, replies, sent, set(asked))
        before = set(self.flags.quarantined)
        with profile(self.threads):
            ids = list(accepted)
            X = torch.stack([accepted[i][1] for i in ids]) if ids else torch.empty(0, sent.w.numel())
            ids, X = valid(*canonical(ids, X), self.max_norm, rejected)
            skipped = cannot_step(self.chain, self.quorum, len(ids))
            if self.weighted and ids:
                c = torch.tensor([accepted[i][2] for i in ids], dtype=torch.float64)
                c /= c.max()  # no overflow in the sum, whatever counts the nodes claim
                X *= (c * len(ids) / c.sum()).to(torch.float32)[:, None]
            inputs = (aggregators.RoundInputs(ids=tuple(str(i) for i in ids), w=sent.w)
                      if self.chain.needs and not skipped else None)
            aggregate, scores, flagged = judge(self.chain, self.flags, server_round, ids, X, rejected, not skipped,
                                               inputs)
            if aggregate is not None:
                w, self.buffer = self.server_step.apply(sent.w, aggregate, self.buffer)
        rec = record(server_round, asked, ids, rejected, failed, self.flags, flagged, skipped, aggregate, scores,
                     model={}, rows={})  # the Flower app holds the model; a reply is its row
        self.history.append(rec)
        self._log(rec, sorted(set(self.flags.quarantined) - before))
        metrics = self._metrics(self.train_metrics_aggr_fn, server_round, "train", {i: accepted[i][0] for i in ids})
        return (None if aggregate is None else sent.record(w)), metrics

    def _read(self, server_round: int, replies: Iterable[Message], sent: Sent, asked: set[int]
              ) -> tuple[dict[int, tuple[RecordDict, torch.Tensor, float]], dict[int, str], dict[int, str]]:
        """Every reply read, by node id in the order they came: ``(accepted: (content, row,
        count), rejected, failed)``."""
        by_node: dict[int, list[Message]] = {}
        for msg in replies:
            by_node.setdefault(msg.metadata.src_node_id, []).append(msg)
        accepted, rejected, failed = {}, {}, {}
        for node, msgs in by_node.items():
            if node not in asked:
                log(WARNING, "round %d: ignored a reply from node %d, which was not asked", server_round, node)
                continue
            msg = msgs[0]
            if len(msgs) > 1:
                rejected[node] = f"{len(msgs)} replies to one task"
            elif msg.has_error():
                failed[node] = f"node error: {str(msg.error.reason)[:200]}"
            else:
                row = sent.update(msg.content)
                count = sample_count(msg.content, self.weighted_by_key) if self.weighted else 1.0
                if isinstance(row, str) or isinstance(count, str):
                    rejected[node] = row if isinstance(row, str) else count
                else:
                    accepted[node] = (msg.content, row, count)
        return accepted, rejected, failed

    def _log(self, record: dict, quarantined: list[int]) -> None:
        t = record["round"]
        for node, reason in record["rejected"].items():
            log(WARNING, "round %d: rejected node %d: %s", t, node, reason)
        for node, reason in record["failed"].items():
            log(WARNING, "round %d: no update from node %d: %s", t, node, reason)
        if record["skipped"]:
            log(WARNING, "round %d: %s; the model is unchanged", t, record["skipped"])
        for node in quarantined:
            log(WARNING, "round %d: node %d quarantined after %d flags: no longer asked", t, node,
                self.flags.flags[node])
        log(INFO, "round %d: accepted %d of %d node(s); flagged %s; quarantined %s", t, record["accepted"],
            record["asked"], record["flagged"], record["quarantined"])

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """FedAvg's, except that a reply whose metrics cannot be aggregated is left out (logged)."""
        valid, _ = self._check_and_log_replies(replies, is_train=False, validate=False)
        contents = {m.metadata.src_node_id: m.content for m in valid}
        return self._metrics(self.evaluate_metrics_aggr_fn, server_round, "evaluate", contents)

    def _metrics(self, aggregate: Callable[[list[RecordDict], str], MetricRecord], server_round: int, what: str,
                 contents: dict[int, RecordDict]) -> MetricRecord | None:
        """``aggregate`` of the replies (by node id) whose metrics it can read, in node order:
        node input never ends the run."""
        usable = []
        for node, content in sorted(contents.items()):
            n = len(content.metric_records)
            count = sample_count(content, self.weighted_by_key) if n == 1 else f"{n} MetricRecords, expected 1"
            if isinstance(count, str):
                log(WARNING, "round %d: %s metrics of node %d left out: %s", server_round, what, node, count)
            else:
                usable.append(content)
        if not usable:
            return None
        try:
            return aggregate(usable, self.weighted_by_key)
        except Exception as err:  # noqa: BLE001 - metrics sent by nodes: they cost the metrics, not the run
            log(WARNING, "round %d: %s metrics not aggregated (%s: %s)", server_round, what, type(err).__name__,
                str(err)[:200])
            return None
