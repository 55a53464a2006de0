"""The coordinator's Flower ServerApp: a round loop on ``Grid.push_messages``/``pull_messages``.

Flower's ``Strategy.start`` drops late replies silently and one malformed reply ends the whole
run, so the loop is ours (:func:`serve`): ask the selected nodes, collect until every one
replied or the deadline passed, hand each reply to :meth:`Coordinator.take` (a bad reply is
a rejection with a reason, never an exception), then :meth:`Coordinator.finish_round`, which
runs the round engine; its spot checks (``nodes.verifier``) are sent to other volunteers of
the round by :func:`ask_checks`, answered within one more deadline. A round with no node to ask fails the run, after ``wait-nodes``
seconds, with what to do (never a "done" on an untrained model). The deployed app reads the coordinator's folder from the run
config's ``state-dir``; the bench's Flower simulation driver calls :func:`serve` itself, on
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

Late replies (``late = carry``): the tasks a round leaves unanswered are carried; their
replies are pulled with the next rounds' and filed in the round they arrive in
(:meth:`Coordinator.carry`), until their TTL (``deadline`` + 30 s) expires.

Asynchronous rounds (``round = async``, FedBuff: :func:`serve_async`). No round waits for
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
import time
from pathlib import Path

from cryptography.hazmat.primitives.serialization import load_pem_public_key
from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from robust import keys

from . import checkpoint
from .coordinator import Coordinator, Inbox, short
from .verifier import Checkers
from .wire import introduction_content, read_identity, task_content

log = logging.getLogger("robust.coordinator")
POLL = 0.5  # seconds between pulls: Flower's own polling (3 s) dominates anyway
TTL_SLACK = 30.0  # seconds a task lives past the deadline: its message's TTL, then it is given up


def ttl(settings) -> float:
    """How long a task's message lives (and is waited for): ``deadline`` + ``TTL_SLACK``."""
    return settings.deadline + TTL_SLACK

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
    possible = len(coord.select(list(coord.keys)))  # carried nodes (late = carry) are busy, not counted
    if possible + len(coord.late) < coord.engine.quorum:
        log.warning("only %d admitted node(s) are not quarantined, the quorum is %d: this round cannot step; "
                    "admit nodes (robust coordinator admit) or lower the quorum", possible + len(coord.late),
                    coord.engine.quorum)
    needed = possible if everyone else min(coord.engine.quorum, possible)
    until = time.monotonic() + s.wait_nodes
    while True:
        nodes = roster.online()
        chosen = set(coord.select(list(nodes.values())))
        if len(chosen) >= needed or time.monotonic() > until:
            return {nid: fp for nid, fp in nodes.items() if fp in chosen}
        time.sleep(roster.poll)


def play_round(roster: Roster, coord: Coordinator, first: bool, nudging: bool,
               carried: dict[str, tuple[str, int, float]] | None = None) -> dict:
    """One synchronous round. ``carried`` (``late = carry``; message id -> (node, Flower id, sent
    at)) holds the tasks past their round: their replies are read with this round's, and the
    tasks this round leaves unanswered join them, until answered or expired (their TTL)."""
    grid, carried = roster.grid, {} if carried is None else carried
    nodes = wait_for_nodes(roster, coord, first)
    if not nodes and not carried:
        raise RuntimeError(
            f"round {coord.round + 1}: no admitted volunteer is online after waiting {coord.settings.wait_nodes:g} s "
            "(wait-nodes): start volunteers with `robust node join` (its output says why one cannot connect), "
            "or admit more if all are quarantined; the run resumes from this round")
    started = time.monotonic()
    task, w = coord.task()
    deadline = started + coord.settings.deadline
    messages = [Message(task_content(task, w), dst_node_id=nid, message_type="train",
                        ttl=ttl(coord.settings)) for nid in sorted(nodes)]
    sent = dict(zip(grid.push_messages(messages), sorted(nodes))) if messages else {}  # message id -> Flower id
    pending = {mid for mid in sent if mid}
    inbox = Inbox()
    late: set[str] = set()  # carried nodes whose reply this round read
    nudge_at = started + coord.settings.deadline / 2 if nudging else None

    def waiting() -> bool:
        """Replies still awaited: this round's, or with no new task out (every node's is
        carried), the carried ones."""
        return bool(pending) or (not sent and bool(carried))

    while waiting() and time.monotonic() < deadline:
        if nudge_at is not None and time.monotonic() >= nudge_at:
            nudge(grid, {nid: fp for nid, fp in nodes.items() if fp not in inbox}, deadline)
            nudge_at = None
        for reply in grid.pull_messages(list(pending | set(carried))):
            mid = reply.metadata.reply_to_message_id
            old = carried.pop(mid, None)
            if old is not None:  # a carried task's reply, from its own node only, not read once it is quarantined
                fp = old[0] if reply.metadata.src_node_id == old[1] else None
                quarantined = fp in coord.engine.flags.quarantined
                if fp is not None and not reply.has_error() and fp not in inbox and not quarantined:
                    coord.take(fp, reply.content, inbox)
                    late.add(fp)
                coord.late.pop(old[0], None)
                continue
            pending.discard(mid)
            fp = nodes.get(reply.metadata.src_node_id)
            if fp is None or fp in inbox:
                continue
            if reply.has_error():
                inbox.failed[fp] = f"node error: {str(reply.error.reason)[:200]}"
            else:
                coord.take(fp, reply.content, inbox)
        if waiting():
            time.sleep(roster.poll)
    if coord.settings.late == "carry":
        for mid in pending:
            fp = nodes[sent[mid]]
            if fp not in inbox:
                carried[mid] = (fp, sent[mid], started)
                coord.carry(fp, task)
    expire(carried, coord)
    checkers = Checkers(sorted(set(nodes.values())), lambda asked: ask_checks(roster, nodes, asked))
    return coord.finish_round(sorted(set(nodes.values()) | late), inbox, started, checkers)


def expire(carried: dict[str, tuple[str, int, float]], coord: Coordinator) -> None:
    """Give up the carried tasks past their TTL (``deadline`` + 30 s): their nodes are free again."""
    now = time.monotonic()
    for mid, (fp, _, at) in list(carried.items()):
        if now - at > ttl(coord.settings):
            log.warning("round %d: no reply from %s to its carried task within %g s: given up", coord.round + 1,
                        short(fp), ttl(coord.settings))
            del carried[mid]
            coord.late.pop(fp, None)


def ask_checks(roster: Roster, nodes: dict[int, str], asked: dict[str, tuple[str, RecordDict]]
               ) -> dict[str, RecordDict | str]:
    """Send each spot check (author -> (verifier, task)) to its verifier and collect the
    answers for one more deadline (author -> reply content, or why none)."""
    grid, node_of = roster.grid, {fp: nid for nid, fp in nodes.items()}
    until = time.monotonic() + roster.coord.settings.deadline
    messages = {author: Message(content, dst_node_id=node_of[verifier], message_type="train",
                                ttl=ttl(roster.coord.settings))
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


LOOK_EVERY = 2.0  # seconds between looks at who is online (async): each is a call to the SuperLink


def serve_async(roster: Roster, coord: Coordinator) -> None:
    """Play ``coord``'s buffers (``round = async``) until its run is done (see the module's
    docstring)."""
    grid, s = roster.grid, coord.settings
    inflight: dict[str, tuple[str, int, int, float]] = {}  # message id -> (node, task number, Flower id, sent at)
    nudged: set[str] = set()
    nudging = coord.round > 0  # resumed: nodes may hold the stopped run's replies
    nodes: dict[int, str] = {}
    last_look, alone_since = -LOOK_EVERY, time.monotonic()
    possible = len(coord.free(list(coord.keys)))
    if possible < coord.buffer_size:
        log.warning("only %d admitted node(s) are not quarantined, a buffer takes %d: no buffer can fill; "
                    "admit nodes (robust coordinator admit) or lower buffer", possible, coord.buffer_size)
    while not coord.done:
        now = time.monotonic()
        if now - last_look >= LOOK_EVERY:
            nodes, last_look = roster.online(), now
        node_of = {fp: nid for nid, fp in nodes.items()}
        free = coord.free(list(node_of))
        if free:
            tasks, w = coord.send(free)
            messages = [Message(task_content(task, w), dst_node_id=node_of[fp], message_type="train",
                                ttl=ttl(s)) for fp, task in tasks.items()]
            for (fp, task), mid in zip(tasks.items(), grid.push_messages(messages)):
                if mid:
                    inflight[mid] = (fp, task.round, node_of[fp], time.monotonic())
                else:
                    coord.forget(fp, task.round)
        if inflight:
            alone_since = time.monotonic()
        elif time.monotonic() - alone_since > s.wait_nodes:
            raise RuntimeError(
                f"buffer {coord.round + 1}: no admitted volunteer is online after waiting {s.wait_nodes:g} s "
                "(wait-nodes): start volunteers with `robust node join` (its output says why one cannot connect), "
                "or admit more if all are quarantined; the run resumes from this buffer")
        for reply in grid.pull_messages(list(inflight)) if inflight else []:
            sent = inflight.pop(reply.metadata.reply_to_message_id, None)
            if sent is None or reply.metadata.src_node_id != sent[2]:
                continue
            fp, number = sent[0], sent[1]
            error = str(reply.error.reason) if reply.has_error() else ""
            for record in coord.receive(fp, number, None if error else reply.content, error):
                log_record(record)
            if coord.done:
                break
        now = time.monotonic()
        for mid, (fp, number, nid, at) in list(inflight.items()):
            if now - at > ttl(s):
                log.warning("task %d: no reply from %s within %g s: given up", number, short(fp), ttl(s))
                del inflight[mid]
                coord.forget(fp, number)
            elif nudging and mid not in nudged and now - at > s.deadline / 2:
                nudged.add(mid)
                nudge(grid, {nid: fp}, at + s.deadline)
        time.sleep(roster.poll)


def log_record(record: dict) -> None:
    log.info("round %d: accepted %d/%d, accuracy %.3f, flagged %s, rejected %s", record["round"],
             record["accepted"], record["asked"], record["accuracy"], [short(fp) for fp in record["flagged"]],
             {short(fp): r for fp, r in record["rejected"].items()})


def serve(grid: Grid, coord: Coordinator, poll: float = POLL, introductions: bool = False) -> None:
    """Play ``coord``'s rounds (or, with ``round = async``, its buffers) until its run is done."""
    roster = Roster(grid, coord, introductions, poll)
    if coord.asynchronous:
        serve_async(roster, coord)
        return
    first, nudging = True, coord.round > 0  # resumed: nodes may hold the stopped run's replies
    carried: dict[str, tuple[str, int, float]] = {}  # late = carry: tasks past their round
    while not coord.done:
        record = play_round(roster, coord, first, nudging, carried)
        first = False
        log_record(record)


@app.main()
def main(grid: Grid, context: Context) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = Path(str(context.run_config["state-dir"]))
    try:
        serve(grid, Coordinator(folder))
    except Exception as err:  # `robust coordinator start` shows this file to the user
        checkpoint.write_failure(folder, err)
        raise
