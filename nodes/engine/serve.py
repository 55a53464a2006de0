"""The one serve loop: every schedule, over the task ledger, given a clock and a transport.

A synchronous round is the ledger plus a barrier: the selected nodes are asked, their replies
are filed until every task of the round is answered or its deadline passed (the clock says
which), the round's tasks still out are withdrawn (``late = drop``) or left out (``late =
carry``: their replies count in the round they arrive in, with their staleness), then the
desk runs the engine's round. Asynchronous rounds (``round = async``, FedBuff) are the ledger
plus :mod:`nodes.engine.buffers`: every free node gets its own task, numbered by the run's
task count, and each reply read is filed in the buffer being filled; every full buffer is a
round. Tasks are given up at their TTL (``deadline`` + 30 s) in every mode.

Three things vary, and each is an object handed in; none writes a loop of its own:

- the **clock** (``nodes.engine.clocks``): the wall in a deployment; simulated time in the
  bench (``evaluation``), which foresees when each reply arrives on its simulated volunteers;
- the **transport** (:class:`Transport`): Flower's grid (a deployment, and Flower's
  simulation), or rows computed in process (the bench's local driver);
- the **desk** (:class:`Desk`): what makes a round's tasks and reads its replies, the
  coordinator (``nodes.coordinator``: signed replies off the wire, checkpoints, the audit
  log) or the bench's desk (decoded rows, the threat model's hook).

Only this module and the ledger's own issue, close, withdraw and expire tasks
(``tests/test_layout.py`` holds every other module to it). A ticket's handle is the
transport's name for its task; the ledger finds a ticket by it in O(1). A task in the
transport whose reply is not yet filed counts against the window (``in-flight``): a round's
tasks go out in waves when the window is smaller than the round.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol as Interface

from .buffers import Buffers
from .clocks import Barrier, Clock
from .inbox import Inbox
from .ledger import INTRODUCE, TRAIN, TaskLedger, Ticket

log = logging.getLogger("robust.coordinator")
LOOK_EVERY = 2.0  # seconds between looks at who is online while buffers fill (live): each is a call


@dataclass(frozen=True)
class Landed:
    """A reply the transport delivered: to which task (``handle``), from where, its content,
    or the transport's error (then no content)."""

    handle: object
    source: object
    content: object = None
    error: str = ""


class Transport(Interface):
    """How tasks reach nodes and replies come back. ``live``: a real network (nodes come
    online over time, the loop waits for them and pauses between pulls); otherwise every
    reply is at hand at once, and the clock alone says when it counts."""

    live: bool

    def online(self) -> dict[object, str]:
        """The nodes reachable now whose key is known: address -> key fingerprint."""

    def strangers(self) -> list[object]:
        """The addresses reachable now with no usable key (asked who they are, if the loop
        introduces nodes)."""

    def ask(self, kind: str, asks: dict[object, tuple[object, object]], life: float) -> dict[object, object]:
        """Send each ask (key -> (address, content)) as a task of ``kind`` (a spot check, an
        introduction); the handles of those whose message left, by key."""

    def train(self, tasks: dict, payload: object, addresses: dict[str, object], life: float) -> dict[str, object]:
        """Send each node (fingerprint -> its task) its training task carrying ``payload`` (the
        model as it travels); the handles of those whose message left."""

    def pull(self, handles: list[object]) -> list[Landed]:
        """The replies that came in to ``handles``."""

    def pause(self) -> None:
        """Wait a little for replies (a live transport polls)."""

    def nudge(self, silent: dict[object, str], life: float) -> None:
        """Send each silent node (address -> fingerprint) a no-op: see ``nodes.coordinator.server_app``."""


class Desk(Interface):
    """What makes tasks and reads replies (the coordinator; the bench's desk), around its
    round engine (``engine``: its round, whether the run is done, its quorum)."""

    ledger: TaskLedger
    settings: object
    engine: object
    in_flight: int

    def select(self, online: list[str]) -> list[str]:
        """The nodes to ask this round, from the ``online`` ones."""

    def free(self, online: list[str]) -> list[str]:
        """The ``online`` nodes that may get a task now (async)."""

    def tasks(self, nodes: list[str]) -> tuple[dict, object]:
        """A task for each of ``nodes`` and what they carry."""

    def model(self):
        """The model the tasks being issued carry (a spot check recomputes from it)."""

    def file(self, ticket: Ticket, content: object, error: str, inbox: Inbox, waited: float) -> bool:
        """File the reply to ``ticket`` in ``inbox``; whether it is a valid update."""

    def finish_round(self, asked: list[str], inbox: Inbox, started: float, checkers=None,
                     held: list[str] | None = None, missed: dict[str, str] | None = None, size: int = 0) -> dict:
        """The engine's round on ``inbox``; its record (an asynchronous buffer's: the nodes
        ``held`` for the next, and the buffer's ``size``)."""

    def gave_up(self, tickets: list[Ticket]) -> None:
        """``tickets`` reached their TTL unanswered."""

    def candidates(self) -> list[str]:
        """Every node that may ever be asked (the admitted ones)."""

    def reachable(self, online: list[str]) -> list[str]:
        """The ``online`` nodes that may get a task (with those out: who may still answer)."""

    def may_fill(self, size: int) -> bool:
        """Whether a buffer of ``size`` valid replies may still fill (enough nodes not barred)."""


class Loop:
    """One run's schedule on a desk, a transport and a clock (see the module)."""

    def __init__(self, transport: Transport, desk: Desk, clock: Clock, introduce=None) -> None:
        self.transport, self.desk, self.clock, self.ledger = transport, desk, clock, desk.ledger
        # asks a stranger who it is (content, then the fingerprint its reply proves, or ValueError)
        self.introduce = introduce
        self.introduced: dict[object, str] = {}  # address -> the fingerprint it introduced itself with
        self.nudging = transport.live and desk.engine.round > 0  # resumed: nodes may hold the stopped run's replies
        self.nudged: set[object] = set()  # handles nudged
        self.seen: dict[object, str] = {}  # every address seen -> its fingerprint
        self.online: dict[object, str] = {}
        self.landed: dict[object, tuple[Landed, Ticket]] = {}  # handle -> its reply and task, pulled, not yet filed
        self.alone_since, self.last_look = time.monotonic(), -math.inf
        self.given: dict[str, float] = {}  # node -> when it was last given a task (the idlest go first)
        self.cap = desk.in_flight
        self.buffers = (Buffers(desk.settings.buffer_for(len(desk.candidates()))) if desk.settings.asynchronous
                        else None)  # async: each reply a one-node inbox
        self.started = time.monotonic()  # async: when the buffer being filled began
        self.disputes = None  # async: nodes -> the desk's way to ask for disputes (play_async's)

    def look(self, every: float = 0.0) -> dict[object, str]:
        """Who is online now: the nodes with a known key, and those that introduced themselves.
        A live transport is asked at most once per ``every`` seconds (each look is a call)."""
        if self.transport.live and time.monotonic() - self.last_look < every:
            return self.online
        self.last_look = time.monotonic()
        online, present = dict(self.transport.online()), self.transport.strangers()
        strangers = [a for a in present if a not in self.introduced]
        if strangers and self.introduce is not None:
            content, identify = self.introduce
            replies = self.gather(INTRODUCE, {a: (a, content, str(a)) for a in strangers},
                                  self.desk.settings.wait_nodes)
            for address, reply in sorted(replies.items()):
                try:
                    if reply.error:
                        raise ValueError(reply.error[:200])
                    self.introduced[address] = identify(reply.content)
                except ValueError as err:
                    log.warning("node %s did not introduce itself: %s", address, err)
        elif strangers:
            log.warning("node(s) %s have no usable public key: ignored", ", ".join(map(str, strangers)))
        online.update({a: self.introduced[a] for a in present if a in self.introduced})
        self.online = online
        self.seen.update(online)
        return online

    def gather(self, kind: str, asks: dict[object, tuple[object, object, str]], wait: float) -> dict[object, Landed]:
        """Tasks of ``kind`` other than training (spot checks, introductions), each a ticket out
        in the ledger like any task: send each ask (key -> (address, content, the node asked)),
        and return the replies that came within ``wait`` seconds, by key. The tasks still out
        then are withdrawn (their replies, if they come, are pulled and dropped) and given up at
        their TTL like any other."""
        handles = self.transport.ask(kind, {key: (address, content) for key, (address, content, _) in asks.items()},
                                     self.clock.life)
        keys = {}
        for key, handle in handles.items():
            self.ledger.issue(asks[key][2], 0, self.desk.engine.round, "", None, self.clock.now(), self.clock.life, handle, kind)
            keys[handle] = key
        out, until = {}, time.monotonic() + wait
        while keys:
            for reply in self.transport.pull(list(keys)):
                key = keys.pop(reply.handle, None)
                if key is not None and self.ledger.close(reply.handle) is not None:
                    out[key] = reply
            if not keys or time.monotonic() >= until:
                break
            self.transport.pause()
        for handle in keys:
            self.ledger.withdraw(handle)
        return out

    def room(self) -> int:
        """Tasks the window (``in-flight``) lets out now."""
        return max(0, self.cap - self.ledger.in_flight())

    def release(self, queue: list[str], addresses: dict[str, object]) -> tuple[list[str], list[str]]:
        """Send the first tasks of ``queue`` the window has room for: ``(those whose message
        left, the rest of the queue)``."""
        room = self.room()
        return self.send(queue[:room], addresses), queue[room:]

    def idlest(self, fps: list[str]) -> list[str]:
        """As many of ``fps`` as the window lets out, those idle longest first (so a full window
        starves no node), in canonical order (so task numbers do not depend on the window)."""
        return sorted(sorted(fps, key=lambda fp: (self.given.get(fp, -math.inf), fp))[: self.room()])

    def send(self, fps: list[str], addresses: dict[str, object]) -> list[str]:
        """Give each of ``fps`` a training task; those whose message left have it out."""
        if not fps:
            return []
        desk, clock = self.desk, self.clock
        tasks, payload = desk.tasks(fps)
        handles = self.transport.train(tasks, payload, addresses, clock.life)
        model, out = desk.model(), []
        for fp in fps:
            if fp in handles:
                task = tasks[fp]
                ticket = self.ledger.issue(fp, task.round, desk.engine.round, task.base, model, clock.now(), clock.life,
                                           handles[fp])
                clock.sent(ticket)
                self.given[fp] = ticket.sent
                out.append(fp)
        return out

    def pull(self) -> None:
        """Land every reply that came in to a task out, from the node it was sent to. The replies
        to withdrawn tasks (cancelled at a round's end, a quarantined node's) are pulled too, and
        dropped: a transport may hold a reply until it is pulled."""
        handles = [h for h in self.ledger.pending() if h not in self.landed]
        for reply in self.transport.pull(handles) if handles else []:
            ticket = self.ledger.handled(reply.handle)
            if ticket is None:
                self.ledger.close(reply.handle)  # a withdrawn task's: dropped
            elif ticket.kind == TRAIN and self.seen.get(reply.source) == ticket.node:
                self.landed[reply.handle] = reply, ticket

    def file(self, handle: object, inbox: object) -> tuple[Ticket, bool]:
        """File the reply landed as ``handle`` in ``inbox``: its task, and whether it was valid
        (``None``: not read, its node is quarantined)."""
        reply, ticket = self.landed.pop(handle)
        if not self.ledger.reads(ticket):
            return ticket, None
        self.ledger.close(handle)
        waited = self.clock.now() - ticket.sent
        return ticket, self.desk.file(ticket, None if reply.error else reply.content, reply.error, inbox, waited)

    def tend(self) -> None:
        """Give up the tasks past their TTL, drop the replies landed for withdrawn ones; in a
        resumed run, nudge the tasks silent for half the deadline once."""
        now = self.clock.now()
        gone = self.ledger.expire(now)
        if gone:
            self.desk.gave_up(gone)
        for handle in [h for h, (_, ticket) in self.landed.items() if self.ledger.handled(h) is not ticket]:
            del self.landed[handle]
            self.ledger.close(handle)
        if not self.nudging:
            return
        late = {t.handle: t for t in self.ledger
                if t.handle not in self.nudged and now - t.sent > self.clock.deadline / 2}
        address = {fp: a for a, fp in self.seen.items()}
        self.nudged |= set(late)
        self.transport.nudge({address[t.node]: t.node for t in late.values() if t.node in address},
                             self.clock.deadline / 2)

    def wait_for_nodes(self, everyone: bool) -> dict[object, str]:
        """The selected online nodes (address -> fingerprint). A live transport waits up to
        ``wait-nodes`` seconds for a quorum, or with ``everyone`` (a run's first round) for
        every node that may be asked, so a federation whose nodes all start together trains on
        all of them from round one; never for more nodes than admission and quarantine leave."""
        desk, live = self.desk, self.transport.live
        if not live:
            online = self.look()
            chosen = set(desk.select(list(online.values())))
            return {a: fp for a, fp in online.items() if fp in chosen}
        possible = len(desk.select(desk.candidates()))  # nodes with a task out (late = carry) are busy
        if possible + len(self.ledger) < desk.engine.quorum:
            log.warning("only %d admitted node(s) are not quarantined, the quorum is %d: this round cannot step; "
                        "admit nodes (robust coordinator admit) or lower the quorum", possible + len(self.ledger),
                        desk.engine.quorum)
        needed = possible if everyone else min(desk.engine.quorum, possible)
        until = time.monotonic() + desk.settings.wait_nodes
        while True:
            online = self.look()
            chosen = set(desk.select(list(online.values())))
            if len(chosen) >= needed or time.monotonic() > until:
                return {a: fp for a, fp in online.items() if fp in chosen}
            self.transport.pause()

    def play_round(self, first: bool, checkers=None) -> dict:
        """One synchronous round: ask the selected nodes, file their replies until the barrier,
        then the desk's round. ``checkers(nodes)``: who may verify this round's spot checks."""
        desk, clock, ledger = self.desk, self.clock, self.ledger
        nodes = self.wait_for_nodes(first)
        if self.transport.live and not nodes and not len(ledger):
            raise RuntimeError(
                f"round {desk.engine.round + 1}: no admitted volunteer is online after waiting {desk.settings.wait_nodes:g} s "
                "(wait-nodes): start volunteers with `robust node join` (its output says why one cannot connect), "
                "or admit more if all are quarantined; the run resumes from this round")
        started, start, addresses = time.monotonic(), clock.now(), {fp: a for a, fp in nodes.items()}
        sent, queue = self.release(sorted(nodes.values()), addresses)  # the rest as the window frees up
        barrier, inbox, late = Barrier(desk.engine.round + 1, start, bool(sent)), Inbox(), set()
        while True:
            self.pull()
            for handle in clock.count(ledger, barrier, self.landed):
                ticket, read = self.file(handle, inbox)
                if read is not None and ticket.number != barrier.number:  # a carried task's reply
                    late.add(ticket.node)
            sent, queue = self.release(queue, addresses)
            barrier.sent |= bool(sent)
            if not queue and clock.over(ledger, barrier):
                break
            self.tend()
            self.transport.pause()
        carry = desk.settings.late == "carry"
        missed = {t.node: reason for t in ledger if t.number == barrier.number
                  and (reason := clock.missed(t, barrier, carry)) is not None}
        if not carry:
            ledger.cancel(barrier.number)
        self.tend()
        asked = sorted(set(nodes.values()) | late)
        clock.stepping()
        return desk.finish_round(asked, inbox, started, checkers(nodes) if checkers else None, missed=missed)

    def receive(self, handle: object) -> list[dict]:
        """Asynchronous rounds: file the reply landed as ``handle`` in the buffer being filled
        (or, if its node is already in it, hold it for the next); the records of the buffers it
        completed (the desk's rounds on them)."""
        desk, single = self.desk, Inbox()
        ticket, valid = self.file(handle, single)
        if valid is None:
            return []
        records = []
        everyone = self.ledger.may_answer(desk.reachable(list(self.look(LOOK_EVERY).values())))
        for full in self.buffers.add(ticket.node, single, valid, everyone):
            if desk.engine.done:
                break
            inbox, started, self.started = Inbox.of(full.replies.values()), self.started, time.monotonic()
            self.clock.stepping()
            records.append(desk.finish_round(sorted(full.replies), inbox, started,
                                             self.disputes(self.online) if self.disputes else None, held=full.held,
                                             size=self.buffers.size))
        return records

    def play_async(self, disputes=None) -> None:
        """Buffers until the run is done (or, in process, until no buffer can fill any more).
        ``disputes(nodes)``: how a buffer's spot checks ask for disputes (its checks are the
        desk's own recomputations: a verifier would be a node the buffers wait on)."""
        self.disputes = disputes
        desk, live = self.desk, self.transport.live
        possible = len(desk.free(desk.candidates()))
        if live and possible < self.buffers.size:
            log.warning("only %d admitted node(s) are not quarantined, a buffer takes %d: no buffer can fill; "
                        "admit nodes (robust coordinator admit) or lower buffer", possible, self.buffers.size)
        if live:
            self.wait_for_nodes(True)  # all that start together get tasks together
        while self.next_buffers():
            pass

    def next_buffers(self) -> list[dict]:
        """Asynchronous rounds: tasks out to every free node, replies filed as they count, until
        a reply completes one or more buffers (their records); ``[]``: the run is done, or (in
        process) no buffer can fill any more."""
        desk, s, ledger, live = self.desk, self.desk.settings, self.ledger, self.transport.live
        while not desk.engine.done and (live or desk.may_fill(self.buffers.size)):
            online, before = self.look(LOOK_EVERY), self.clock.now()
            addresses = {fp: a for a, fp in online.items()}
            self.send(self.idlest(desk.free(list(addresses))), addresses)
            if len(ledger):
                self.alone_since = time.monotonic()
            elif live and time.monotonic() - self.alone_since > s.wait_nodes:
                raise RuntimeError(
                    f"buffer {desk.engine.round + 1}: no admitted volunteer is online after waiting {s.wait_nodes:g} s "
                    "(wait-nodes): start volunteers with `robust node join` (its output says why one cannot connect), "
                    "or admit more if all are quarantined; the run resumes from this buffer")
            self.pull()
            due, records = self.clock.due(ledger, self.landed), []
            for handle in due:
                records += self.receive(handle)
                if desk.engine.done:
                    break
            self.tend()
            if records:
                return records
            if not due:
                if not live and not len(ledger) and self.clock.now() == before:
                    break  # in process: no task out, and nobody comes back
                self.transport.pause()
        return []
