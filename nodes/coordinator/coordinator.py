"""The coordinator: the round engine (``nodes.engine.engine``) with a folder, keys and a transport.

:class:`Coordinator` is the serve loop's desk (``nodes.engine.serve``): it reads its settings,
admission list and run id from its folder, makes each round's tasks, files every reply the
loop reads (:meth:`file`: decoded from its bytes, then :meth:`check`: run, round, base model,
shape, signature, sample count), then :meth:`finish_round` hands the accepted rows to
:meth:`Engine.step`, checkpoints and logs. Nothing a node sends can raise out of :meth:`file`:
an unexpected error is that node's rejection. The Flower ServerApp
(``nodes/coordinator/server_app.py``) only moves messages. Everything is a function of the settings, the seed and the accepted
replies, so the same replies give the same bits in any arrival order, and a restart
resumes exactly.

Compressed updates (``compression``): each reply's encoded arrays are checked against the
codec's layout and decoded as they are read (``nodes.wire.read_reply``): a malformed encoding
is that node's rejection with the reason; the decoded row, which is what the node signed, then
goes through the same checks as an uncompressed one. Every round record counts the bytes that
travelled: ``bytes_up`` (the replies' arrays), ``bytes_down`` (the tasks' model arrays), and
``bytes_per_node`` (short id -> ``[up, down]``); spot-check traffic is not counted. With
``downlink = fp16`` tasks carry the model in half precision (``Engine.task_model``): half the
bytes down, and each task names the SHA-256 of the rounded model the nodes train from.

Every task out is in the coordinator's :class:`~nodes.engine.ledger.TaskLedger` (:attr:`ledger`),
issued by the serve loop when its message leaves. A reply must answer its
node's task: the same task number and base model, no staler than ``max-staleness``; the reply
closes the task whatever it holds, and a quarantined node's reply is not read. Each accepted
row goes to the engine with its task, so its staleness and its spot check follow that task.

Late replies (``late = carry``, synchronous rounds): a task not answered by the round's
deadline stays out: its node is not asked again until its reply arrives, and that reply counts
in the round it arrives in, with its staleness (rounds since its task), which the engine
weighs as in asynchronous rounds. Records of runs whose rows may be stale (``late = carry``,
``round = async``) name each update's task and base (``updates``: ``task``, ``base``) for the
audit.

Asynchronous rounds (``round = async``, FedBuff): each free node gets its own task, numbered
by the run's task count (``DIR/tasks-sent``, so a resumed run never reuses a number a volunteer
has seen), with the current model. Replies fill the serve loop's buffer, one per node (a
node's next reply waits for the following buffer; ``nodes.engine.buffers`` is the schedule); every
``buffer`` valid ones (or a reply from every node that may still answer: ``nodes.engine.ledger``)
:meth:`finish_round` runs the engine. A *round* is a buffer: ``rounds`` counts buffers. Its
record keeps the schedule: ``ids`` (which replies), ``staleness`` (from which base version),
``held`` (replies of nodes already in it, waiting for the next buffer), which ``robust
coordinator replay`` and ``robust audit verify`` check.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from flwr.app import RecordDict

from robust import codecs, keys
from robust.codecs import Encoded
from robust.data import load
from robust.models import build_model
from robust.params import sha256, unflatten
from robust.rowstore import RowStore, names
from robust.source import Spooled

from .. import checkpoint
from ..engine.engine import Engine, ThreatHook
from ..engine.inbox import Inbox
from ..engine.ledger import Ticket, TaskLedger, ttl
from ..engine.root import Root
from ..engine.rows import rejection_reason, stacked
from ..settings import Settings
from ..wire import Reply, Task, content_bytes, model_array, read_reply, reply_payload, task_content
from . import admission, audit, roundlog
from .admission import scan, short
from .attendance import Attendance
from .disk import Projection, project
from .verifier import Checkers, SpotChecks

log = logging.getLogger("robust.coordinator")
TASKS_SENT = "tasks-sent"  # async: the run's task count, written before each task leaves
# Settings a resumed run must share with its checkpoint (rounds, deadline... may change).
FIXED = ("round", "seed", "dataset", "model", "aggregator", "tolerate", "protocol", "batch_size", "lr", "momentum", "threads")


SPOOL_ABOVE = 2**30  # spool = auto: a round's rows past this many bytes wait on disk
# what a round record's ``costs`` split its seconds into: the coordinator's own (each block counted
# once, in the innermost cost that times it) and the rest, ``waiting`` for replies
COSTS = ("send", "check", "hashing", "spool", "engine", "spot checks", "loss score", "rule", "evaluation", "audit",
         "waiting")
IN_FLIGHT_BYTES = 2 * 2**30  # in-flight = 0 (auto): the replies of the tasks out at once stay under this


def _tensor_of(row: np.ndarray, keep: bool) -> torch.Tensor:
    """A reply's float32 row as a tensor: a copy of its own where it is ``keep``-t (the engine's
    round holds it), else the message's bytes themselves, read-only, for the checks and the
    spool to read (at 100M parameters the copy was 400 MB more in the ServerApp per reply)."""
    if keep or row.flags.writeable or row.dtype != np.float32:
        return torch.from_numpy(np.array(row, dtype=np.float32))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # it is only read
        return torch.from_numpy(row)


class Coordinator:
    def __init__(self, folder: str | Path, hook: ThreatHook | None = None) -> None:
        self.folder = Path(folder)
        self.settings = s = Settings.read(self.folder)
        self.codec = codecs.build(s.compression)
        self._task_bytes: int | None = None
        self.run_id = (self.folder / checkpoint.RUN_ID).read_text().strip()
        self._warned: set[str] = set()
        self.keys = self._admitted()
        self.data = data = load(s.dataset, root=s.data_root or None, seed=0)
        self.checks = SpotChecks(self)
        self.engine = Engine(s, build_model(s.model, data.shape, data.classes, s.seed), data.x_test, data.y_test, hook,
                             self.checks if s.spot_check else None, Root.of(s, data))
        self.attendance = Attendance(s.rest_after)
        self.rejected: dict[str, str] = {}  # node -> its latest rejection's reason
        self._tip = roundlog.genesis(self.run_id)
        flags = self.engine.flags
        self.ledger = TaskLedger(s.max_staleness, lambda fp: fp in flags.quarantined or fp in flags.convicted)
        # the coordinator's own seconds since the last round's record, by what they went to (see finish_round)
        self.costs: dict[str, float] = dict.fromkeys(COSTS, 0.0)
        self._timing: list[str] = []  # the costs being timed, innermost last
        self._since = 0.0  # when the innermost began or resumed
        self.engine.clock = self.timed
        self.rowstore = self._rule_store()
        self._resume()
        self._collect()
        path = self.folder / TASKS_SENT
        self.sent = int(path.read_text().strip() or 0) if path.exists() else 0

    def _rule_store(self) -> RowStore | None:
        """Where the rule keeps the ``(d,)`` rows it carries across rounds (FoolsGold's
        histories, FLDetector's last rows and pairs): ``DIR/state`` when the rows are spooled
        (decided at start; a run that kept them there keeps them there), else memory."""
        if not self.spooling and not (self.folder / audit.STATE).exists():
            return None
        store = RowStore(self.folder / audit.STATE)
        self.engine.chain.spill(store)
        return store

    def _collect(self) -> None:
        """Remove the rule's stored rows the checkpoint on disk no longer names (the engine's
        state is what it holds: call right after a checkpoint is written or loaded)."""
        if self.rowstore is not None:
            self.rowstore.collect(names(self.engine.chain.state()))

    def _admitted(self) -> dict:
        """The admitted keys; a bad file in the list is skipped with one warning naming it."""
        found, problems = scan(self.folder)
        for problem in sorted(set(problems) - self._warned):
            log.warning("admission list: %s", problem)
        self._warned |= set(problems)
        return {fp: key for fp, (_, key) in found.items()}

    @property
    def round(self) -> int:
        return self.engine.round

    @property
    def done(self) -> bool:
        return self.engine.done

    def _resume(self) -> None:
        state = checkpoint.load(self.folder)
        if state is None:
            return
        path = self.folder / checkpoint.CHECKPOINT
        saved = state["settings"]
        changed = [k for k in FIXED if saved.get(k, "sync" if k == "round" else None) != getattr(self.settings, k)]
        if changed:
            raise ValueError(
                f"{self.folder} holds a checkpoint made with different {', '.join(changed)} "
                f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}): start with the same values, "
                "or use a new folder for a new run"
            )
        w, d = state["engine"]["w"], self.engine.w.numel()
        if w.dtype != torch.float32 or w.dim() != 1 or w.numel() != d:
            raise ValueError(f"{path} holds a {w.dtype} model of shape {tuple(w.shape)}, model {self.settings.model} "
                             f"is float32 ({d},): restore the checkpoint from a backup, or start over in a new folder")
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{path} holds a model with non-finite values: restore it from a backup, "
                             "or start over in a new folder")
        try:
            self.engine.load_state(state["engine"])
            self.attendance.load_state(state["attendance"])
            self.rejected = dict(state["rejected"])
            self._tip = roundlog.line_hash(state["record"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path} does not fit this run ({type(err).__name__}: {str(err)[:120]}): restore it "
                             "from a backup, or start over in a new folder") from None
        log.info("resumed from %s after round %d", path, self.round)

    def save(self, record: dict) -> None:
        checkpoint.save(self.folder, {"settings": {k: getattr(self.settings, k) for k in FIXED},
                                      "engine": self.engine.state(), "attendance": self.attendance.state(),
                                      "rejected": self.rejected, "record": record})

    def select(self, online: list[str]) -> list[str]:
        """The nodes asked this round (``Engine.select`` of the admitted online ones that are not
        resting; resting ones too if a quorum needs them). The admission list is re-read, so a
        key admitted while the run goes on is used from the next round."""
        self.keys = self._admitted()
        online = [fp for fp in online if fp in self.keys and not self.ledger.busy(fp)]  # a carried task: busy
        rested = self.attendance.rested(self.round + 1)
        chosen = self.engine.select([fp for fp in online if fp not in rested])
        return chosen if len(chosen) >= self.engine.quorum or not rested else self.engine.select(online)

    def task(self) -> tuple[Task, np.ndarray]:
        """The next round's task and the model array it carries (``downlink``: as it travels)."""
        w, base = self.engine.task_model()
        task = Task.of(self.settings, self.run_id, self.round + 1, base, self.data.sha256, self.memory)
        return task, model_array(w.numpy(), self.settings.downlink)

    def tasks(self, nodes: list[str]) -> tuple[dict[str, Task], np.ndarray]:
        """A task for each of ``nodes`` and the model array they carry: this round's (sync), or
        each its own number (async; the task count is on disk before any task leaves). Each is
        out once issued (:meth:`issue`), when its message leaves."""
        if not self.settings.asynchronous:
            task, w = self.task()  # each continues from the momentum the engine names for its node, if any
            return {fp: task.continuing(self.engine.named_state(fp)) for fp in nodes}, w
        tasks, (w, base) = {}, self.engine.task_model()
        for fp in nodes:
            self.sent += 1
            tasks[fp] = Task.of(self.settings, self.run_id, self.sent, base, self.data.sha256, self.memory)
        if tasks:
            checkpoint.write_atomic(self.folder / TASKS_SENT, lambda out: out.write(f"{self.sent}\n".encode()))
        return tasks, model_array(w.numpy(), self.settings.downlink)

    @functools.cached_property
    def memory(self) -> int:
        """Bytes a volunteer holds at once for a task (``Protocol.memory``), said in every task
        (the run's protocol and model size: the same for the whole run)."""
        return sum(self.engine.protocol.memory(self.engine.w.numel()).values())

    def model(self) -> torch.Tensor:
        """The model the tasks being issued carry (a spot check recomputes from it)."""
        return self.engine.task_model()[0]

    def candidates(self) -> list[str]:
        """The admitted nodes (the list is re-read)."""
        self.keys = self._admitted()
        return list(self.keys)

    def reachable(self, online: list[str]) -> list[str]:
        """The ``online`` nodes that are admitted."""
        return [fp for fp in online if fp in self.keys]

    def gave_up(self, tickets: list[Ticket]) -> None:
        """Tasks past their TTL: their nodes may be asked again."""
        for t in tickets:
            log.warning("task %d: no reply from %s within %g s: given up", t.number, short(t.node),
                        ttl(self.settings.deadline))

    def free(self, online: list[str]) -> list[str]:
        """The online admitted nodes that may get a task now: not quarantined, not convicted, and
        without a task out; in canonical order."""
        self.keys = self._admitted()
        return self.ledger.free([fp for fp in online if fp in self.keys])

    def file(self, ticket: Ticket, content: RecordDict | None, error: str, inbox: Inbox,
             waited: float | None = None) -> bool:
        """File the answer to ``ticket`` (read by the serve loop, ``nodes.engine.serve``) in
        ``inbox``: its reply ``content`` as it came off the wire, or the transport's ``error`` (a
        failure, not a flag), ``waited`` seconds after the task was sent (the record's
        ``reply_seconds``). Whether it is a valid update. Never raises on what a node sent: a
        reply that cannot be read or checked, for any reason, is the node's rejection."""
        fp = ticket.node
        if fp in inbox:
            return False  # a node answers once a round
        if waited is not None:
            inbox.of_node(fp).waited = waited
        if content is None:
            inbox.fail(fp, f"node error: {error[:200]}")
            return False
        with self.timed("check"):
            self._take(ticket, content, inbox)
        return fp in inbox.rows

    @contextlib.contextmanager
    def timed(self, cost: str) -> Iterator[None]:
        """Count the seconds the block takes in this round's ``costs[cost]`` (``COSTS``); a block
        timed inside it counts in its own cost only (the outer one pauses)."""
        now = time.perf_counter()
        if self._timing:
            self.costs[self._timing[-1]] += now - self._since
        self._timing.append(cost)
        self._since = now
        try:
            yield
        finally:
            now = time.perf_counter()
            self.costs[self._timing.pop()] += now - self._since
            self._since = now

    def _take(self, ticket: Ticket, content: RecordDict, inbox: Inbox) -> None:
        fp = ticket.node
        try:
            inbox.of_node(fp).size = content_bytes(content)
            reply, row, enc = read_reply(content, self.engine.w.numel(), self.codec)
        except ValueError as err:
            inbox.reject(fp, f"malformed reply: {err}")
            return
        except Exception as err:  # noqa: BLE001 - untrusted input must never end the round
            log.exception("round %d: reply from %s could not be read", self.round + 1, short(fp))
            inbox.reject(fp, f"reply could not be read ({type(err).__name__})")
            return
        inbox.of_node(fp).seconds = reply.seconds
        if reply.refused:
            inbox.fail(fp, f"declined the task: {reply.refused[:200]}")
            return
        try:
            result = self.check(fp, reply, row, ticket, enc)
        except Exception as err:  # noqa: BLE001 - as above
            log.exception("round %d: reply from %s could not be checked", self.round + 1, short(fp))
            result = f"reply could not be checked ({type(err).__name__})"
        if isinstance(result, str):
            inbox.reject(fp, result)
        else:
            row, sha = result
            kept = self.spool(sha, row, inbox) if self.spooling else row
            if enc is not None:  # what the audit keeps, at the codec's size
                enc = self.spool(sha, enc, inbox) if self.spooling else enc
            inbox.accept(fp, kept, ticket, reply=reply, sha=sha, encoded=enc)

    def disk(self) -> Projection:
        """What the rounds left will store in this folder (``nodes.coordinator.disk``)."""
        return project(self.folder, self.settings, self.engine.w.numel(), len(self.keys),
                       self.settings.rounds - self.round, self.spooling,
                       self.engine.chain.kept_rows(len(self.keys)) if self.rowstore else 0)

    @property
    def spooling(self) -> bool:
        """Whether accepted rows wait on disk (``spool``; auto: once the admitted nodes' rows
        would pass ``SPOOL_ABOVE`` bytes a round)."""
        spool = self.settings.spool
        return spool == "disk" or (spool == "auto" and len(self.keys) * self.engine.w.numel() * 4 > SPOOL_ABOVE)

    @property
    def in_flight(self) -> int:
        """Tasks out at once (``in-flight``; auto: as many as keep their replies, each waiting in
        the SuperLink until the ServerApp reads it, under ``IN_FLIGHT_BYTES``)."""
        reply = self.codec.nbytes(self.engine.w.numel())
        return self.settings.in_flight or max(1, IN_FLIGHT_BYTES // reply)

    def spool(self, sha: str, update: torch.Tensor | Encoded, inbox: Inbox) -> Path:
        """Write the accepted update ``sha`` (its row, or its encoding) to the round's spool,
        the audit's store, and let it go."""
        path = audit.update_path(self.folder, update, sha)
        if not path.exists():
            try:
                with self.timed("spool"):
                    audit.keep(self.folder, update, sha)
            except OSError as err:  # the disk, not the node: the round fails, the checkpoint stands
                raise OSError(err.errno, f"round {self.round + 1} stopped: an update could not be spooled to "
                              f"{path.parent} ({err.strerror or err}): free disk space, then `robust coordinator "
                              f"start {self.folder}` resumes after round {self.round}") from err
            inbox.spooled.add(path)
        return path

    def rows(self, inbox: Inbox) -> tuple[list[str], torch.Tensor | Spooled]:
        """The accepted rows in canonical order: stacked in memory, or read from the spool
        (the rows still in memory, if spooling began mid-round, are spooled first)."""
        if not any(isinstance(row, Path) for row in inbox.rows.values()):
            return stacked(inbox.rows, self.engine.w.numel())
        ids = sorted(inbox.rows)
        paths = [inbox.rows[fp] if isinstance(inbox.rows[fp], Path) else self.spool(inbox.hashes[fp], inbox.rows[fp], inbox)
                 for fp in ids]
        return ids, Spooled(paths, validated=True, shas=[inbox.hashes[fp] for fp in ids])

    def check(self, fp: str, reply: Reply, row: np.ndarray | None, ticket: Ticket,
              enc: Encoded | None) -> tuple[torch.Tensor, str] | str:
        """The update of a reply to ``ticket`` that did not decline, as ``(row, its SHA-256)``, or
        why it is rejected; ``enc``: the encoding the row was decoded from (``None`` for
        ``none``), whose claims must answer the task (a ``shared-sign`` support)."""
        if reply.run != self.run_id:
            return f"signed for run {reply.run!r}, this is run {self.run_id!r}"
        reason = ticket.refusal(reply.round, reply.base, self.round, self.settings.max_staleness)
        if reason:
            return reason
        if enc is not None and (reason := self.codec.refusal(enc, (self.settings.seed, ticket.number, fp))):
            return reason
        tensor = _tensor_of(row, keep=not self.spooling) if row is not None else None
        reason = rejection_reason(tensor, self.engine.w.numel(), self.settings.max_norm)
        if reason:
            return reason
        if reply.author:
            return "a spot check's reply where an update was expected"
        with self.timed("hashing"):
            sha = sha256(tensor)
        if fp not in self.keys or not keys.verify(self.keys[fp], reply.signature, reply_payload(reply, sha)):
            return "bad signature"
        if not 1 <= reply.count <= self.settings.max_count:
            return f"sample count {reply.count} outside [1, {self.settings.max_count}]"
        return tensor, sha

    def finish_round(self, asked: list[str], inbox: Inbox, started: float, checkers: Checkers | None = None,
                     held: list[str] | None = None, missed: dict[str, str] | None = None, size: int = 0) -> dict:
        """The engine's round on the accepted rows, then checkpoint and log; the round's record.

        Rejected replies (bad content) count as flags; failed ones (a transport error, or a
        node declining the task) are recorded without a flag: they are not lies. A node
        without a usable reply ``rest_after`` rounds in a row is rested (``nodes.coordinator.attendance``).
        The seconds nodes say their training took only feed the overhead figure. ``costs``: where
        the round's seconds went: the coordinator's own, handing its tasks to Flower (``send``:
        the transport adds them), reading and checking replies (``check``), hashing them
        (``hashing``), writing them to the spool (``spool``), the engine's ``spot checks``,
        ``rule`` (the aggregation and the step) and ``evaluation`` (the held-out metric) and the
        rest of its step (``engine``: screening, ordering), storing the updates for the audit
        (``audit``); and the rest, ``waiting`` for replies (their transfer, the volunteers'
        training, Flower's polling). The checkpoint and the log line are written after the
        record is made."""
        ids, X = self.rows(inbox)
        if self._task_bytes is None:  # the model array's bytes: the same every round
            self._task_bytes = content_bytes(task_content(*self.task()))
        self.checks.begin(inbox.replies, checkers)
        with self.timed("engine"):
            record = self.engine.step(asked, ids, X, inbox.rejected, {**(missed or {}), **inbox.failed},
                                      tasks=inbox.tasks)
        if self.settings.asynchronous:
            record["buffer"] = size
            record["held"] = held or []  # valid replies of this buffer's nodes, left for the next buffer
        record["prev"] = self._tip  # the SHA-256 of the last record's log line
        with self.timed("audit"):
            record["updates"] = audit.store(self.folder, self.settings.keep_updates, record, inbox, self.checks.evidence)
        record["costs"], self.costs = {k: round(v, 4) for k, v in self.costs.items()}, dict.fromkeys(COSTS, 0.0)
        traffic = {short(fp): [inbox.sizes.get(fp, 0), self._task_bytes] for fp in sorted(asked)}
        record["bytes_up"] = sum(up for up, _ in traffic.values())
        record["bytes_down"] = sum(down for _, down in traffic.values())
        record["bytes_per_node"] = traffic
        for fp in record["convicted"]:
            self.convicted(fp, record)
        for fp, reason in record["rejected"].items():
            self.rejected[fp] = reason
            log.warning("round %d: rejected %s: %s", record["round"], short(fp), reason)
        for fp, reason in record["failed"].items():
            log.warning("round %d: no usable reply from %s: %s", record["round"], short(fp), reason)
        declined = {fp for fp, reason in inbox.failed.items() if reason.startswith("declined")}
        record["rested"] = self.attendance.update(record["round"], asked, set(ids) | set(record["rejected"]), declined)
        for fp in record["rested"]:
            log.warning("round %d: %s gave no usable reply %d rounds in a row: not asked for %d rounds",
                        record["round"], short(fp), self.settings.rest_after, self.settings.rest_after)
        record["seconds"] = round(time.monotonic() - started, 3)
        record["costs"]["waiting"] = round(max(record["seconds"] - sum(record["costs"].values()), 0.0), 4)
        record["train_seconds_max"] = round(max((inbox.seconds.get(fp, 0.0) for fp in ids), default=0.0), 3)
        record["reply_seconds"] = {short(fp): round(s, 3) for fp, s in sorted(inbox.waited.items())}
        self.save(record)
        self._collect()
        checkpoint.append_round(self.folder, record)
        self._tip = roundlog.line_hash(record)
        if self.done:
            self.finish(record["accuracy"], record["loss"])
        log.info("round %d: accepted %d/%d, accuracy %.3f, flagged %s, rejected %s", record["round"],
                 record["accepted"], record["asked"], record["accuracy"], [short(fp) for fp in record["flagged"]],
                 {short(fp): r for fp, r in record["rejected"].items()})
        return record

    def convicted(self, fp: str, record: dict) -> None:
        """Ban ``fp``, convicted in ``record``'s round: its key leaves the admission list (kept in
        ``convicted/`` with the evidence in the round log, for the audit)."""
        evidence = self.engine.flags.convicted[fp]
        if record["rejected"].get(fp, "").startswith("convicted in a dispute"):
            log.warning("round %d: %s CONVICTED %s; banned", record["round"], short(fp),
                        record["rejected"][fp].removeprefix("convicted "))
        else:
            log.warning("round %d: %s CONVICTED: a spot check's recomputation (by %s) differs from its signed update "
                        "(relative distance %s); banned", record["round"], short(fp), short(evidence["verifier"]),
                        "n/a" if evidence["distance"] is None or fp != evidence["author"] else f"{evidence['distance']:.3g}")
        admission.ban(self.folder, fp)
        self.keys.pop(fp, None)

    def finish(self, final_accuracy: float, final_loss: float) -> None:
        """Write the final model (a ``state_dict``) and ``result.json``."""
        engine = self.engine
        params = {k: v.clone() for k, v in unflatten(engine.w, engine.model).items()}
        checkpoint.write_atomic(self.folder / "model.pt", lambda out: torch.save(params, out))
        checkpoint.write_result(self.folder, {
            "final_accuracy": final_accuracy, "final_loss": final_loss, "data_sha256": self.data.sha256 or None,
            "model_sha256": engine.base, "rounds": self.round,
            "rejected": {short(fp): r for fp, r in sorted(self.rejected.items())},
            "flagged": sorted(short(fp) for fp in engine.flags.flags),
            "quarantined": sorted(short(fp) for fp in engine.flags.quarantined),
            "declined": {short(fp): n for fp, n in sorted(self.attendance.declined.items())},
            "convicted": {short(fp): {"round": e["round"], "distance": e["distance"], "verifier": short(e["verifier"]),
                                      "as": "author" if e["author"] == fp else f"verifier of {short(e['author'])}"}
                          for fp, e in sorted(engine.flags.convicted.items())},
        })
