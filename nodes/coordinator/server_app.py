"""The coordinator's Flower ServerApp: the serve loop (``nodes.engine.serve``) on Flower's grid.

Flower's ``Strategy.start`` drops late replies silently and one malformed reply ends the whole
run, so the loop is ours (:func:`serve`): the product's one serve loop, with Flower's grid as
its transport (:class:`FlowerTransport`: ``Grid.push_messages``/``pull_messages``) and the
coordinator as its desk. It asks the selected nodes, collects until every one replied or the
deadline passed, hands each reply to :meth:`Coordinator.file` (a bad reply is a rejection
with a reason, never an exception), then :meth:`Coordinator.finish_round`, which runs the
round engine; its spot checks (``nodes.coordinator.verifier``) are sent to other volunteers of
the round by :func:`ask_checks`, tasks the loop gathers within one more deadline. A round with
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

One loop (``nodes.engine.serve.Loop``) serves every round mode: the coordinator's task ledger
(``nodes.engine.ledger``) says who has a task out and under which message id (training tasks,
spot checks and introductions alike); the loop pushes tasks as the mode allows, pulls the
replies to every task out, files each with the coordinator, and gives up tasks past their TTL
(``deadline`` + 30 s). A synchronous round is the ledger plus a
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
as they arrive, filed by :meth:`Coordinator.file` in the loop's buffer, and the engine runs on every
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
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from robust import keys

from .. import checkpoint
from ..engine.clocks import Clock, WallClock
from ..engine.ledger import CHECK, DISPUTE, INTRODUCE, ttl
from ..engine.serve import Landed, Loop
from ..wire import Task, introduction_content, model_record, read_identity, task_content
from .admission import short
from .coordinator import Coordinator
from .pull import Replies
from .verifier import Checkers

log = logging.getLogger("robust.coordinator")
POLL = 0.5  # seconds between pulls: Flower's own polling (3 s) dominates anyway
PULL_BYTES = 256 * 2**20  # replies' rows one pull brings in at most (one, if a row is bigger)

app = ServerApp()


class FlowerTransport:
    """Flower's grid as the serve loop's transport (``nodes.engine.serve``): who is online
    (Flower node id -> key fingerprint, see "Identity" above), tasks pushed as messages, replies
    pulled by message id."""

    live = True

    def __init__(self, grid: Grid, coord: Coordinator, poll: float) -> None:
        self.grid, self.coord, self.poll = grid, coord, poll
        self.replies = Replies(grid, ttl(coord.settings.deadline))
        self.model: tuple[str, ArrayRecord] | None = None  # the model pushed last: (its SHA-256, its record)
        self.unknown: list[int] = []

    def online(self) -> dict[int, str]:
        """Who is online now with a usable key (a call to the SuperLink); the others are
        :meth:`strangers`."""
        known, self.unknown = {}, []
        for info in self.grid.get_nodes():
            if info.status != "online":
                continue
            try:
                known[info.node_id] = keys.fingerprint(load_pem_public_key(info.public_key))
            except (ValueError, TypeError):
                self.unknown.append(info.node_id)
        return known

    def strangers(self) -> list[int]:
        return self.unknown

    def ask(self, kind: str, asks: dict[object, tuple[int, RecordDict]], life: float) -> dict[object, str]:
        """Push each ask (a spot check: a task, as ``train``; an introduction: a ``query``)."""
        keys_ = sorted(asks, key=str)
        messages = [Message(asks[k][1], dst_node_id=asks[k][0], message_type="query" if kind == INTRODUCE else "train",
                            ttl=life) for k in keys_]
        return {k: mid for k, mid in zip(keys_, self.grid.push_messages(messages)) if mid}

    def train(self, tasks: dict[str, Task], payload, addresses: dict[str, int], life: float) -> dict[str, str]:
        """Push each node its task: the model's record built once for every task that carries it."""
        with self.coord.timed("send"):
            fps = list(tasks)
            model = self.model_of(tasks[fps[0]].base, payload)
            messages = [Message(task_content(tasks[fp], model), dst_node_id=addresses[fp], message_type="train",
                                ttl=ttl(self.coord.settings.deadline)) for fp in fps]
            ids = self.grid.push_messages(messages)
        return {fp: mid for fp, mid in zip(fps, ids) if mid}

    def model_of(self, base: str, w) -> ArrayRecord:
        """The record of the model ``w`` (SHA-256 ``base``), built once for every task that carries
        it: each build is a serialized copy of the model, and hashing its chunks takes seconds at 1e8.
        It is let go once a reply comes in (:meth:`pull`): the tasks sent so far hold it in the
        SuperLink, and the ServerApp no longer does while their replies come in (402 MB at 1e8)."""
        if self.model is None or self.model[0] != base:
            self.model = None  # the previous model's copy goes before the next one is made
            self.model = (base, model_record(w))
        return self.model[1]

    def pull(self, handles: list[str]) -> list[Landed]:
        """The replies that came in to ``handles``, at most :data:`PULL_BYTES` of rows in the
        ServerApp at once (one, if a row is bigger): each is filed (checked, spooled, let go)
        before the next is pulled, the others wait in the SuperLink (one 400 MB reply at a time
        in the ServerApp at 100M parameters, where one pull brought every reply that had come
        in). A reply still coming up its node's link holds up none of the others
        (:class:`nodes.coordinator.pull.Replies`)."""
        d, protocol = self.coord.engine.w.numel(), self.coord.engine.protocol
        size = max(1, PULL_BYTES // self.coord.codec.nbytes(d))
        most = 4 * d * (protocol.steps + 1) * protocol.width + 2**20  # a dispute's states, the most a reply holds
        landed = [Landed(reply.metadata.reply_to_message_id, reply.metadata.src_node_id,
                         None if reply.has_error() else reply.content,
                         str(reply.error.reason) if reply.has_error() else "")
                  for reply in self.replies.pull(handles, most, size)]
        if landed:
            self.model = None  # the tasks it was built for are out: another wave builds it again (1 s at 1e8)
        return landed

    def pause(self) -> None:
        time.sleep(self.poll)

    def nudge(self, silent: dict[int, str], life: float) -> None:
        nudge(self.grid, silent, time.monotonic() + life)


def ask_checks(loop: Loop, nodes: dict[int, str], asked: dict[object, tuple[str, RecordDict]], kind: str = CHECK
               ) -> dict[object, RecordDict | str]:
    """Send each spot check (author -> (verifier, task)), or each dispute (key -> (the node that
    answers, task)), as tasks of ``kind`` the serve loop gathers for one more deadline (a
    dispute: ``dispute-deadline`` of them); key -> reply content, or why none."""
    address = {fp: nid for nid, fp in nodes.items()}
    s = loop.desk.settings
    asks = {key: (address[node], content, node) for key, (node, content) in sorted(asked.items()) if node in address}
    replies = loop.gather(kind, asks, s.deadline * (s.dispute_deadline if kind == DISPUTE else 1))
    return {key: f"failed: {r.error[:200]}" if r.error else r.content for key, r in replies.items()}


def nudge(grid: Grid, silent: dict[int, str], deadline: float) -> None:
    """Send each silent node (Flower id -> fingerprint) a no-op, so a reply it holds is pushed."""
    if not silent:
        return
    ttl = max(deadline - time.monotonic(), 1.0)
    grid.push_messages([Message(RecordDict(), dst_node_id=nid, message_type="query", ttl=ttl) for nid in sorted(silent)])
    log.info("no reply yet from %s: nudged", ", ".join(short(fp) for fp in sorted(silent.values())))


def say_window(coord: Coordinator) -> None:
    """Tell the operator when the window (``in-flight``) sends a round's tasks in waves."""
    nodes, cap = len(coord.keys), coord.in_flight
    if cap < nodes:
        mb = coord.codec.nbytes(coord.engine.w.numel()) / 2**20
        log.info("in-flight: at most %d of %d tasks out at once (a reply of %.0f MB waits in Flower until read), "
                 "the rest sent as replies come back; set in-flight higher for faster rounds if the coordinator "
                 "has about 2 x in-flight x %.0f MB to spare", cap, nodes, mb, mb)


def identify(content: RecordDict) -> str:
    """The fingerprint of the key a node introduced itself with (``ValueError`` if none)."""
    return keys.fingerprint(keys.load_public(read_identity(content)))


def serve(grid: Grid, coord: Coordinator, poll: float = POLL, introductions: bool = False,
          clock: Clock | None = None) -> None:
    """Play ``coord``'s rounds (or, with ``round = async``, its buffers) until its run is done,
    on the wall (a deployment) or on the bench's simulated ``clock`` (``nodes.engine.clocks``).
    With ``introductions`` (simulated nodes have no key) a node without one is asked who it is."""
    loop = Loop(FlowerTransport(grid, coord, poll), coord, clock or WallClock(coord.settings.deadline),
                (introduction_content(coord.run_id), identify) if introductions else None)
    say_window(coord)
    if coord.settings.asynchronous:  # no verifiers among the nodes buffers wait on; disputes may be asked
        loop.play_async(lambda nodes: Checkers([], lambda asked, kind=CHECK: ask_checks(loop, nodes, asked, kind)))
        return
    first = True
    while not coord.done:
        loop.play_round(first, lambda nodes: Checkers(sorted(set(nodes.values())),
                                                       lambda asked, kind=CHECK: ask_checks(loop, nodes, asked, kind)))
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
