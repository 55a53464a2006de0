"""The coordinator's Flower ServerApp: a round loop on ``Grid.push_messages``/``pull_messages``.

Flower's ``Strategy.start`` drops late replies silently and one malformed reply ends the whole
run, so the loop is ours (:func:`serve`): ask the selected nodes, collect until every one
replied or the deadline passed, hand each reply to :meth:`Coordinator.take` (a bad reply is
a rejection with a reason, never an exception), then :meth:`Coordinator.finish_round`, which
runs the round engine; its spot checks (``nodes.coordinator.verifier``) are sent to other
volunteers of the round by :func:`ask_checks`, answered within one more deadline. A round with
no node to ask fails the run, after ``wait-nodes`` seconds, with what to do (never a "done" on
an untrained model). The deployed app reads the coordinator's folder from the run config's
``state-dir``; the bench's Flower simulation driver calls :func:`serve` itself, on
a coordinator with its threat-model hook.

Identity. A node is the fingerprint of its key: Flower authenticates deployed nodes by that
key (SuperNode authentication). Simulated nodes have none, so with ``introductions`` on (the
simulation only: the bench's nodes are its own) a node without one is asked once who it is;
its signatures then prove it.

Nudges. A Flower 1.41 SuperNode pushes its finished replies only right after it pulls a new
message, one message in flight at a time. When a coordinator dies while a node is fetching
a task, the SuperNode drops the message but its ClientApp still answers it, and from then on
the node is one reply behind: each reply waits in the SuperNode until the *next* message
arrives, so the node looks silent every round (seen after a SIGKILLed coordinator resumed).
So in a resumed run (only a stopped run leaves such replies behind), at half the deadline
every node that has not replied is sent a no-op ``query`` message: pulling it makes the
SuperNode push the reply it holds. A node that is merely slow runs one more no-op after its
real work; a fresh run never nudges.

One loop (:class:`Loop`) serves every round mode: the coordinator's task ledger
(``nodes.engine.ledger``) says who has a task out and under which message id; the loop pushes
tasks as the mode allows, pulls the replies to every task out, files each with the coordinator, and
gives up tasks past their TTL (``deadline`` + 30 s). A synchronous round is the ledger plus a
barrier (every task of the round answered, or the deadline). Which replies count when is the
loop's clock's (``nodes.engine.clocks``): the wall in a deployment, simulated time in the bench.

What Flower holds (``in-flight``). The SuperLink keeps objects content-addressed and
reference-counted (``flwr/supercore/object_store/in_memory_object_store.py``): the model a
round's tasks share is stored once, whatever their number, and freed when the last SuperNode
confirms it pulled its task. A reply is stored until the ServerApp pulls it, and freed then;
the reply to a task the loop no longer reads would stay until the run ends, so the loop pulls
and drops those too (until their TTL). The ServerApp builds the model's ``Array`` once for
every task that carries it (:meth:`Loop.model_of`). What grows with the nodes is the replies:
every one not yet read waits in the SuperLink, and a pull lands all that came in. So the loop
keeps at most ``in-flight`` tasks in Flower whose replies it has not filed (auto: as many as
2 GiB of replies), and sends the others as replies are filed: a synchronous round's tasks go
out in waves, each task with its own deadline, in canonical order; asynchronous rounds give the
free nodes idle longest the room there is. A round's result does not depend on the order its
tasks left or its replies came in: rows are aggregated in canonical order.

Late replies (``late = carry``): the tasks a round leaves unanswered stay out; their replies
are pulled with the next rounds' and filed in the round they arrive in, until their TTL.

Asynchronous rounds (``round = async``, FedBuff). No round waits for
anyone: every online, admitted, non-quarantined node without a task gets one with the current
model (at start, when it comes online, and right after its reply is read); replies are read
as they arrive and filed by :meth:`Coordinator.receive`, which runs the engine on every
``buffer`` valid replies (one per node: a node's next reply waits for the following buffer),
with each reply's staleness. ``rounds`` counts buffers. A task not answered within
``deadline`` (+30 s, its TTL) is given up and the node, if online, gets a fresh one; a node
that never replies holds up nobody. A resumed run starts an empty buffer and sends every node
a new task (replies to the stopped run's tasks are not read); in-flight tasks older than half
the deadline are nudged once, as in synchronous rounds.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from cryptography.hazmat.primitives.serialization import load_pem_public_key
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from robust import keys

from .. import checkpoint
from ..engine.clocks import Barrier, Clock, WallClock
from ..engine.ledger import Ticket, ttl
from ..wire import introduction_content, model_record, read_identity, task_content
from .coordinator import Coordinator, Inbox, short
from .verifier import Checkers

log = logging.getLogger("robust.coordinator")
POLL = 0.5  # seconds between pulls: Flower's own polling (3 s) dominates anyway
LOOK_EVERY = 2.0  # seconds between looks at who is online (async): each is a call to the SuperLink

app = ServerApp()


class Roster:
    """Who is online now: Flower node id -> key fingerprint (see "Identity" above)."""

    def __init__(self, grid: Grid, coord: Coordinator, introductions: bool, poll: float) -> None:
        self.grid, self.coord, self.introductions, self.poll = grid, coord, introductions, poll
        self.introduced: dict[int, str] = {}

    def online(self) -> dict[int, str]:
        out, strangers = {}, []
        for info in self.grid.get_nodes():
            if info.status != "online":
                continue
            if info.node_id in self.introduced:
                out[info.node_id] = self.introduced[info.node_id]
                continue
            try:
                out[info.node_id] = keys.fingerprint(load_pem_public_key(info.public_key))
            except (ValueError, TypeError):
                strangers.append(info.node_id)
        if strangers and self.introductions:
            self.introduced.update(self._introduce(strangers))
            out.update({nid: self.introduced[nid] for nid in strangers if nid in self.introduced})
        elif strangers:
            log.warning("node(s) %s have no usable public key: ignored", ", ".join(map(str, strangers)))
        return out

    def _introduce(self, nids: list[int]) -> dict[int, str]:
        ttl = self.coord.settings.wait_nodes
        messages = [Message(introduction_content(self.coord.run_id), dst_node_id=nid, message_type="query", ttl=ttl)
                    for nid in sorted(nids)]
        pending = {mid for mid in self.grid.push_messages(messages) if mid}
        out, until = {}, time.monotonic() + ttl
        while pending and time.monotonic() < until:
            for reply in self.grid.pull_messages(list(pending)):
                pending.discard(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    log.warning("node %d did not introduce itself: %s", reply.metadata.src_node_id, str(reply.error.reason)[:200])
                    continue
                try:
                    out[reply.metadata.src_node_id] = keys.fingerprint(keys.load_public(read_identity(reply.content)))
                except ValueError as err:
                    log.warning("node %d did not introduce itself: %s", reply.metadata.src_node_id, err)
            if pending:
                time.sleep(self.poll)
        return out


def wait_for_nodes(roster: Roster, coord: Coordinator, everyone: bool) -> dict[int, str]:
    """The selected online nodes (Flower id -> fingerprint). Waits up to ``wait_nodes`` seconds
    for a quorum, or with ``everyone`` (a run's first round) for every admitted node, so a
    federation whose nodes all start together trains on all of them from round one. Never
    waits for more nodes than admission and quarantine leave."""
    s = coord.settings
    possible = len(coord.select(list(coord.keys)))  # nodes with a task out (late = carry) are busy, not counted
    if possible + len(coord.ledger) < coord.engine.quorum:
        log.warning("only %d admitted node(s) are not quarantined, the quorum is %d: this round cannot step; "
                    "admit nodes (robust coordinator admit) or lower the quorum", possible + len(coord.ledger),
                    coord.engine.quorum)
    needed = possible if everyone else min(coord.engine.quorum, possible)
    until = time.monotonic() + s.wait_nodes
    while True:
        nodes = roster.online()
        chosen = set(coord.select(list(nodes.values())))
        if len(chosen) >= needed or time.monotonic() > until:
            return {nid: fp for nid, fp in nodes.items() if fp in chosen}
        time.sleep(roster.poll)


class Loop:
    """The one serve loop: tasks go out as the ledger allows, replies are pulled by the ledger's
    message ids, the clock says which of them count now and they are filed, tasks expire at
    their TTL; a synchronous round ends at its barrier, an asynchronous one when its buffer is
    full (``Coordinator.receive``)."""

    def __init__(self, roster: Roster, coord: Coordinator, clock: Clock) -> None:
        self.roster, self.coord, self.grid, self.clock = roster, coord, roster.grid, clock
        self.nudging = coord.round > 0  # resumed: nodes may hold the stopped run's replies
        self.nudged: set[str] = set()  # message ids nudged
        self.seen: dict[int, str] = {}  # every Flower node id seen -> its fingerprint
        self.online: dict[int, str] = {}
        self.landed: dict[str, Message] = {}  # message id -> its reply, pulled but not yet filed
        self.last_look, self.alone_since = -LOOK_EVERY, time.monotonic()
        # message id -> its TTL on the clock: every task in Flower whose reply is not yet filed
        # or dropped, its task withdrawn or not (see "What Flower holds" above)
        self.out: dict[str, float] = {}
        self.cap = coord.in_flight
        self.given: dict[str, float] = {}  # node -> when it was last given a task (the idlest go first)
        self.model: tuple[str, ArrayRecord] | None = None  # the model pushed last: (its SHA-256, its record)

    def look(self) -> None:
        """Who is online now (async: at most every ``LOOK_EVERY`` seconds: each look is a call)."""
        if time.monotonic() - self.last_look >= LOOK_EVERY:
            self.online, self.last_look = self.roster.online(), time.monotonic()
            self.seen.update(self.online)

    def room(self) -> int:
        """Tasks the window (``in-flight``) lets out now."""
        return max(0, self.cap - len(self.out))

    def release(self, queue: list[str], node_of: dict[str, int]) -> tuple[list[str], list[str]]:
        """Send the first tasks of ``queue`` the window has room for: ``(those whose message
        left, the rest of the queue)``."""
        room = self.room()
        return self.send(queue[:room], node_of), queue[room:]

    def idlest(self, fps: list[str]) -> list[str]:
        """As many of ``fps`` as the window lets out, those idle longest first (so a full window
        starves no node), in canonical order (so task numbers do not depend on the window)."""
        return sorted(sorted(fps, key=lambda fp: (self.given.get(fp, -math.inf), fp))[: self.room()])

    def send(self, fps: list[str], node_of: dict[str, int]) -> list[str]:
        """Push a task to each of ``fps``; those whose message left have their task out."""
        if not fps:
            return []
        with self.coord.timed("send"):
            tasks, w = self.coord.tasks(fps)
            model = self.model_of(tasks[fps[0]].base, w)
            messages = [Message(task_content(tasks[fp], model), dst_node_id=node_of[fp], message_type="train",
                                ttl=ttl(self.coord.settings.deadline)) for fp in fps]
            ids = self.grid.push_messages(messages)
        out = []
        for fp, mid in zip(fps, ids):
            if mid:
                ticket = self.coord.issue(fp, tasks[fp], self.clock.now(), self.clock.life, mid)
                self.clock.sent(ticket)
                self.out[mid], self.given[fp] = ticket.expires, ticket.sent
                out.append(fp)
        return out

    def model_of(self, base: str, w) -> ArrayRecord:
        """The record of the model ``w`` (SHA-256 ``base``), built once for every task that carries
        it: each build is a serialized copy of the model, and hashing its chunks takes seconds at 1e8."""
        if self.model is None or self.model[0] != base:
            self.model = None  # the previous model's copy goes before the next one is made
            self.model = (base, model_record(w))
        return self.model[1]

    def pull(self) -> None:
        """Land every reply that came in to a task still out, from the node it was sent to. The
        replies to withdrawn tasks (cancelled at a round's end, a quarantined node's) are pulled
        too, and dropped: Flower frees a reply only when it is pulled, or else at the run's end."""
        handles = [h for h in self.out if h not in self.landed]
        for reply in self.grid.pull_messages(handles) if handles else []:
            handle = reply.metadata.reply_to_message_id
            ticket = self.coord.ledger.handled(handle)
            if ticket is not None and self.seen.get(reply.metadata.src_node_id) == ticket.node:
                self.landed[handle] = reply
            else:
                self.out.pop(handle, None)

    def file(self, handle: str, inbox: Inbox | None) -> tuple[Ticket, bool, list[dict]]:
        """File the reply landed as ``handle`` (in ``inbox`` for a synchronous round): its task,
        whether it was read, and the records of the buffers it completed (async)."""
        reply, ticket = self.landed.pop(handle), self.coord.ledger.handled(handle)
        self.out.pop(handle, None)
        error = str(reply.error.reason) if reply.has_error() else ""
        content, waited = None if error else reply.content, self.clock.now() - ticket.sent
        if inbox is None:
            return ticket, True, self.coord.receive(ticket.node, content, error, list(self.online.values()), waited)
        return ticket, self.coord.file(ticket.node, content, error, inbox, waited), []

    def tend(self) -> None:
        """Give up the tasks past their TTL; in a resumed run, nudge the tasks silent for half
        the deadline once (see "Nudges" above)."""
        coord, now = self.coord, self.clock.now()
        coord.expire(now)
        for handle in [h for h in self.landed if coord.ledger.handled(h) is None]:  # withdrawn: dropped
            del self.landed[handle]
            self.out.pop(handle, None)
        self.out = {h: until for h, until in self.out.items() if until > now}  # Flower dropped them too
        if not self.nudging:
            return
        late = {t.handle: t for t in coord.ledger
                if t.handle not in self.nudged and now - t.sent > self.clock.deadline / 2}
        node_of = {fp: nid for nid, fp in self.seen.items()}
        self.nudged |= set(late)
        nudge(self.grid, {node_of[t.node]: t.node for t in late.values() if t.node in node_of},
              time.monotonic() + self.clock.deadline / 2)

    def play_round(self, first: bool) -> dict:
        """One synchronous round: ask the selected nodes, collect until the barrier, then the
        engine's round (its spot checks sent to the round's volunteers, :func:`ask_checks`)."""
        coord, clock = self.coord, self.clock
        nodes = wait_for_nodes(self.roster, coord, first)
        self.seen.update(nodes)
        if not nodes and not len(coord.ledger):
            raise RuntimeError(
                f"round {coord.round + 1}: no admitted volunteer is online after waiting {coord.settings.wait_nodes:g} s "
                "(wait-nodes): start volunteers with `robust node join` (its output says why one cannot connect), "
                "or admit more if all are quarantined; the run resumes from this round")
        started, start, node_of = time.monotonic(), clock.now(), {fp: nid for nid, fp in nodes.items()}
        sent, queue = self.release(sorted(nodes.values()), node_of)  # the rest as the window frees up
        barrier, inbox, late = Barrier(coord.round + 1, start, bool(sent)), Inbox(), set()
        while True:
            self.pull()
            for handle in clock.count(coord.ledger, barrier, self.landed):
                ticket, read, _ = self.file(handle, inbox)
                if read and ticket.number != barrier.number:  # a carried task's reply
                    late.add(ticket.node)
            sent, queue = self.release(queue, node_of)
            barrier.sent |= bool(sent)
            if not queue and clock.over(coord.ledger, barrier):
                break
            self.tend()
            time.sleep(self.roster.poll)
        if coord.settings.late == "drop":
            coord.ledger.cancel(barrier.number)
        self.tend()
        checkers = Checkers(sorted(set(nodes.values())), lambda asked: ask_checks(self.roster, nodes, asked))
        return coord.finish_round(sorted(set(nodes.values()) | late), inbox, started, checkers)

    def play_async(self) -> None:
        """Buffers until the run is done (see "Asynchronous rounds" above)."""
        coord, s = self.coord, self.coord.settings
        possible = len(coord.free(list(coord.keys)))
        if possible < coord.buffer_size:
            log.warning("only %d admitted node(s) are not quarantined, a buffer takes %d: no buffer can fill; "
                        "admit nodes (robust coordinator admit) or lower buffer", possible, coord.buffer_size)
        self.seen.update(wait_for_nodes(self.roster, coord, True))  # all that start together get tasks together
        while not coord.done:
            self.look()
            node_of = {fp: nid for nid, fp in self.online.items()}
            self.send(self.idlest(coord.free(list(node_of))), node_of)
            if len(coord.ledger):
                self.alone_since = time.monotonic()
            elif time.monotonic() - self.alone_since > s.wait_nodes:
                raise RuntimeError(
                    f"buffer {coord.round + 1}: no admitted volunteer is online after waiting {s.wait_nodes:g} s "
                    "(wait-nodes): start volunteers with `robust node join` (its output says why one cannot connect), "
                    "or admit more if all are quarantined; the run resumes from this buffer")
            self.pull()
            due = self.clock.due(coord.ledger, self.landed)
            for handle in due:
                for record in self.file(handle, None)[2]:
                    log_record(record)
                if coord.done:
                    break
            self.tend()
            if not due:
                time.sleep(self.roster.poll)


def ask_checks(roster: Roster, nodes: dict[int, str], asked: dict[str, tuple[str, RecordDict]]
               ) -> dict[str, RecordDict | str]:
    """Send each spot check (author -> (verifier, task)) to its verifier and collect the
    answers for one more deadline (author -> reply content, or why none)."""
    grid, node_of = roster.grid, {fp: nid for nid, fp in nodes.items()}
    until = time.monotonic() + roster.coord.settings.deadline
    messages = {author: Message(content, dst_node_id=node_of[verifier], message_type="train",
                                ttl=ttl(roster.coord.settings.deadline))
                for author, (verifier, content) in sorted(asked.items())}
    ids = dict(zip(grid.push_messages(list(messages.values())), messages))
    pending, out = {mid for mid in ids if mid}, {}
    while pending and time.monotonic() < until:
        for reply in grid.pull_messages(list(pending)):
            mid = reply.metadata.reply_to_message_id
            pending.discard(mid)
            author = ids.get(mid)
            if author is not None and author not in out:
                out[author] = (f"failed: {str(reply.error.reason)[:200]}" if reply.has_error() else reply.content)
        if pending:
            time.sleep(roster.poll)
    return out


def nudge(grid: Grid, silent: dict[int, str], deadline: float) -> None:
    """Send each silent node (Flower id -> fingerprint) a no-op, so a reply it holds is pushed."""
    if not silent:
        return
    ttl = max(deadline - time.monotonic(), 1.0)
    grid.push_messages([Message(RecordDict(), dst_node_id=nid, message_type="query", ttl=ttl) for nid in sorted(silent)])
    log.info("no reply yet from %s: nudged", ", ".join(short(fp) for fp in sorted(silent.values())))


def log_record(record: dict) -> None:
    log.info("round %d: accepted %d/%d, accuracy %.3f, flagged %s, rejected %s", record["round"],
             record["accepted"], record["asked"], record["accuracy"], [short(fp) for fp in record["flagged"]],
             {short(fp): r for fp, r in record["rejected"].items()})


def say_window(coord: Coordinator) -> None:
    """Tell the operator when the window (``in-flight``) sends a round's tasks in waves."""
    nodes, cap = len(coord.keys), coord.in_flight
    if cap < nodes:
        mb = coord.codec.nbytes(coord.engine.w.numel()) / 2**20
        log.info("in-flight: at most %d of %d tasks out at once (a reply of %.0f MB waits in Flower until read), "
                 "the rest sent as replies come back; set in-flight higher for faster rounds if the coordinator "
                 "has about 2 x in-flight x %.0f MB to spare", cap, nodes, mb, mb)


def serve(grid: Grid, coord: Coordinator, poll: float = POLL, introductions: bool = False,
          clock: Clock | None = None) -> None:
    """Play ``coord``'s rounds (or, with ``round = async``, its buffers) until its run is done,
    on the wall (a deployment) or on the bench's simulated ``clock`` (``nodes.engine.clocks``)."""
    loop = Loop(Roster(grid, coord, introductions, poll), coord, clock or WallClock(coord.settings.deadline))
    say_window(coord)
    if coord.asynchronous:
        loop.play_async()
        return
    first = True
    while not coord.done:
        log_record(loop.play_round(first))
        first = False


@app.main()
def main(grid: Grid, context: Context) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = Path(str(context.run_config["state-dir"]))
    try:
        serve(grid, Coordinator(folder))
    except Exception as err:  # `robust coordinator start` shows this file to the user
        checkpoint.write_failure(folder, err)
        raise
