"""Light volunteers: hundreds of authenticated nodes in one process, for ``robust stress --light``.

A light node speaks the whole deployed protocol to the real coordinator (its SuperLink and
ServerApp): Flower's Fleet API over TLS, through Flower's own client
(``flwr.supernode.fleet_http_client.FleetHttpClient``, each request signed with the node's
admitted key by Flower's ``NodeAuthHttpInterceptor``), node heartbeats, tasks pulled and
inflated and replies pushed object by object as a SuperNode does, every reply signed for its
task (run, round, base model) as ``nodes.volunteer.volunteer.work`` signs one. It trains
nothing: it replays a row computed once before the run (:func:`precompute`: what the
volunteer's own ``work`` sends for round 1 from the initial model on its part of the data
set; a Byzantine node's row from a node-side attack the same way, or from an omniscient
attack played on the honest rows, so light nodes may play omniscient attacks too), declines
spot checks, and answers no-op queries.

Why one process: a SuperNode is a process of about 100 MB that starts a ``flwr-clientapp``
process per task (87 MB with robust's thin ClientApp); 200 of them take more than this
machine's 24 GB while their tasks run, and their start-up alone would be the measurement.
One process holds each node's session (an HTTP client, a heartbeat thread, a worker thread)
in a few MB, so what is measured is the coordinator.

A killed node (:meth:`LightNode.kill`) drops its session as a SIGKILLed SuperNode does: no
reply to the task it holds, no more heartbeats, no goodbye to the SuperLink. Its restart
opens a new session with the same key, which Flower refuses until the dead session's
heartbeat window has passed (``HEARTBEAT_PATIENCE x HEARTBEAT_DEFAULT_INTERVAL``, 60 s), as
it refuses a restarted SuperNode: the node keeps trying (:data:`RETRY`).

Each node keeps, per round, when its reply's last object reached the SuperLink (``sent``),
and every reply the runtime refused, with the cause (``refused``): what ``robust stress``
counts as lost.
"""

from __future__ import annotations

import random
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.fleet_pb2 import ActivateNodeRequest, PullMessagesRequest, PushMessagesRequest
from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatRequest
from flwr.proto.node_pb2 import Node
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree, no_object_id_recompute
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
    make_push_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree, push_objects
from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
from flwr.supercore.primitives.asymmetric import public_key_to_bytes
from flwr.supernode.fleet_http_client import FleetHttpClient
from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

import attacks
from attacks.base import Context, NodeAttack
from nodes.engine.spotcheck import profile_of
from nodes.engine.training import part_of
from nodes.volunteer.volunteer import sign, work
from nodes.settings import Settings
from nodes.wire import Reply, Task, check_of, refusal, reply_content, task_of
from robust import keys
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, sha256
from robust.seeds import generator

POLL = 3.0  # seconds between a node's pulls when it has no task: a SuperNode's
RETRY = 5.0  # seconds between a refused or failed session's attempts to open again
DECLINE_CHECK = "a light node trains nothing: it cannot recompute another node's update"
PROFILE = profile_of(torch.device("cpu"))  # what its replies declare they were computed on


@dataclass(frozen=True)
class Row:
    """What a light node replays every round: its update, that update's SHA-256 and the sample
    count it declares (its part of the data set)."""

    values: np.ndarray
    sha: str
    count: int
    part: str


def precompute(settings: Settings, run: str, private: list, byzantine: int, attack: str) -> list[Row]:
    """The row each node (its key in ``private``, node ``i`` holding part ``i/n``) replays:
    what a volunteer's own :func:`~nodes.volunteer.volunteer.work` sends for round 1 from the
    initial model, honest or, for the last ``byzantine`` nodes, playing a node-side ``attack``;
    an omniscient ``attack`` makes those nodes' rows from the others' honest rows instead."""
    data, n = load(settings.dataset, root=settings.data_root or None, seed=0), len(private)
    w = flat_params(build_model(settings.model, data.shape, data.classes, settings.seed)).detach()
    task = Task.of(settings, run, 1, sha256(w))
    node_side = bool(byzantine) and isinstance(attacks.build(attack, 1), NodeAttack)
    rows = []
    for i, key in enumerate(private, start=1):
        part, played = f"{i}/{n}", attack if node_side and i > n - byzantine else ""
        reply, row = work(task, w.numpy(), part_of(data, part), key, torch.device("cpu"), played, None, part)
        if reply.refused or not isinstance(row, np.ndarray):
            raise ValueError(f"light nodes replay plain float32 rows of a stateless protocol: "
                             f"{reply.refused or 'compression ' + settings.compression} cannot be replayed")
        rows.append(Row(row, sha256(torch.from_numpy(row)), reply.count, part))
    if byzantine and not node_side:
        honest = torch.stack([torch.from_numpy(r.values) for r in rows[: n - byzantine]])
        crafted = attacks.build(attack, byzantine)(honest, Context(n=n, generator=generator(settings.seed, 1, "attack")))
        rows[n - byzantine:] = [Row(c.numpy(), sha256(c), r.count, r.part) for c, r in zip(crafted, rows[n - byzantine:])]
    return rows


@dataclass
class LightNode:
    """One node identity: its key, the row it replays, its session, what it sent."""

    key: object  # its EC private key
    fp: str  # its fingerprint: who it is to the coordinator
    row: Row
    ca: ssl.SSLContext
    address: str
    sent: dict[tuple[str, int], float] = field(default_factory=dict)  # (run, round) -> when its reply was pushed
    refused: list[tuple[str, int, float, str]] = field(default_factory=list)  # (run, round, when, cause) of lost replies
    errors: list[str] = field(default_factory=list)  # why sessions ended, other than a kill or a stop
    generation: int = 0  # bumped by kill(): the session of an older generation is dead
    stop: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)  # set by kill() and close(): stop waiting
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, name=f"light-{self.fp[:8]}", daemon=True)
        self.thread.start()

    def kill(self) -> None:
        """Drop the session now, as a SIGKILL would (see the module's docstring); a new one opens."""
        self.generation += 1
        self.wake.set()

    def close(self, wait: bool = True) -> None:
        """End the node (its session says no goodbye); ``wait``: until its thread is done."""
        self.stop.set()
        self.wake.set()
        if wait and self.thread is not None:
            self.thread.join(timeout=30)

    def _serve(self) -> None:
        while not self.stop.is_set():
            generation = self.generation
            self.wake.clear()
            try:
                self._session(generation)
            except Exception as err:  # noqa: BLE001 - refused (a dead session's window), or the SuperLink is gone: try again
                self.errors.append(f"{type(err).__name__}: {str(err)[:200]}")
                self.stop.wait(RETRY)

    def _client(self) -> FleetHttpClient:
        public = self.key.public_key()
        return FleetHttpClient(f"https://{self.address}", verify=self.ca, interceptors=[
            RuntimeVersionHttpInterceptor(component_name="SuperNode"), NodeAuthHttpInterceptor(self.key, public)])

    def _alive(self, generation: int) -> bool:
        return not self.stop.is_set() and self.generation == generation

    def _session(self, generation: int) -> None:
        """One session, as a SuperNode keeps it: activate, heartbeat, pull and answer tasks,
        until stopped or killed (then, like a dead process, it says no goodbye)."""
        client = self._client()
        try:
            node = Node(node_id=client.ActivateNode(ActivateNodeRequest(
                public_key=public_key_to_bytes(self.key.public_key()),
                heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL)).node_id)
            heartbeat = HeartbeatSender(lambda: _alive_beat(client, node, lambda: self._alive(generation)))
            heartbeat.start()
            try:
                self.wake.wait(random.Random(self.fp).uniform(0, POLL))  # nodes do not all poll at once
                while self._alive(generation):
                    if not self._answer_one(client, node, generation):
                        self.wake.wait(POLL)
            finally:
                if heartbeat.is_running:
                    heartbeat.stop()
        finally:
            client.close()

    def _answer_one(self, client: FleetHttpClient, node: Node, generation: int) -> bool:
        """Pull one message and answer it; whether there was one. A reply the SuperLink does not
        take is logged as lost, and the session goes on, as a SuperNode's does."""
        response = client.PullMessages(PullMessagesRequest(node=node))
        if not response.messages_list:
            return False
        run_id = message_from_proto(response.messages_list[0]).metadata.run_id
        tree = response.message_object_trees[0]
        message = pull_and_inflate_object_from_tree(
            tree, make_pull_object_fn_protobuf(client.PullObject, node, run_id),
            make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, run_id),
            return_type=Message)
        message.metadata.__dict__["_message_id"] = tree.object_id
        start = time.perf_counter()
        content, task = self.reply(message)
        if not self._alive(generation):
            return True  # killed while it held the task: no reply
        try:
            push(client, node, Message(content, reply_to=message), time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - whatever the runtime said, the reply is lost: logged, with why
            if task is not None:
                self.refused.append((task.run, task.round, time.time(), f"{type(err).__name__}: {str(err)[:200]}"))
            return True
        if task is not None:
            self.sent[(task.run, task.round)] = time.time()
        return True

    def reply(self, message: Message) -> tuple[RecordDict, Task | None]:
        """The reply to a task (the row, signed for it), a spot check (declined) or a query
        (empty); with the task answered."""
        if message.metadata.message_type != "train":
            return RecordDict(), None
        task = task_of(message.content)
        check = check_of(message.content)
        if check is not None:
            return reply_content(refusal(task, DECLINE_CHECK, check[0]), None), None
        reply = Reply(run=task.run, round=task.round, base=task.base, count=self.row.count, signature=b"",
                      part=self.row.part, profile=PROFILE)
        return reply_content(sign(reply, self.key, self.row.sha), self.row.values), task


def _alive_beat(client: FleetHttpClient, node: Node, alive) -> bool:
    """One node heartbeat while the session is ``alive()`` (a killed one sends none); ``False``
    (retried by Flower's sender) if it did not get through."""
    if not alive():
        return True
    try:
        return bool(client.SendNodeHeartbeat(SendNodeHeartbeatRequest(
            node=node, heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL)).success)
    except (httpx.HTTPError, ValueError):
        return False


def push(client: FleetHttpClient, node: Node, reply: Message, seconds: float) -> None:
    """Push ``reply`` as a SuperNode does: the message without its content, then each object
    the SuperLink asks for."""
    run_id = reply.metadata.run_id
    reply.metadata.__dict__["_message_id"] = reply.object_id
    with no_object_id_recompute():
        tree = get_object_tree(reply)
        response = client.PushMessages(PushMessagesRequest(
            node=node, messages_list=[message_to_proto(remove_content_from_message(reply))],
            message_object_trees=[tree], clientapp_runtime_list=[seconds]))
        push_objects(get_all_nested_objects(reply),
                     make_push_object_fn_protobuf(client.PushObject, node, run_id, response.session_id),
                     object_ids_to_push=set(response.objects_to_push))


def fleet(private: list, rows: list[Row], address: str, ca: Path) -> list[LightNode]:
    """A light node for each key in ``private``, replaying ``rows``; not yet started. They share
    one TLS context: the coordinator's CA."""
    context = ssl.create_default_context(cafile=str(ca))
    return [LightNode(key, keys.fingerprint(key.public_key()), row, context, address) for key, row in zip(private, rows)]
