"""``nodes.coordinator.pull.Replies``: a reply still coming up its node's link holds up none of
the others, and is handed on, whole, once its last object is in.

The SuperLink here is a fake of its Runtime API, as Flower 1.42's servicer answers it: a reply is
handed over (and forgotten) by ``PullMessages`` as soon as its node announced it, while its
objects may still be on their way (``PullObject``: found, not available); ``ConfirmMessageReceived``
lets them go. The messages and their objects are Flower's own.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
from flwr.app import Array, ArrayRecord, Metadata, RecordDict
from flwr.app.message import make_message
from flwr.common.serde import message_to_proto
from flwr.proto.message_pb2 import ObjectTree  # pylint: disable=E0611
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.superlink.grid import HttpGrid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

from nodes.coordinator.pull import Replies


def reply(task: str, node: int, n: int):
    message = make_message(
        metadata=Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0, message_type="train", group_id="",
                          ttl=100, reply_to_message_id=task, created_at=time.time()),
        content=RecordDict({"update": ArrayRecord({"row": Array(np.arange(n, dtype=np.float32) * node)})}))
    message.metadata.__dict__["_message_id"] = message.object_id
    return message


class Link:
    """The SuperLink's Runtime API: replies announced, objects stored as they come in."""

    def __init__(self) -> None:
        self.announced: dict[str, tuple] = {}  # task id -> (proto, tree) of its reply
        self.objects: dict[str, bytes] = {}  # object id -> content, for the objects that are in
        self.known: set[str] = set()  # every object announced
        self.confirmed: list[str] = []
        self.asked: list[list[str]] = []

    def announce(self, message, missing: set[str] = frozenset()) -> list[str]:
        """A node pushed ``message``: its reply announced, its objects in but those of
        ``missing`` types; the ids still to come."""
        objects = get_all_nested_objects(message)
        self.announced[message.metadata.reply_to_message_id] = (message_to_proto(message), get_object_tree(message))
        self.known |= set(objects)
        self.objects.update({oid: obj.deflate() for oid, obj in objects.items() if type(obj).__name__ not in missing})
        return [oid for oid, obj in objects.items() if type(obj).__name__ in missing]

    def arrive(self, message) -> None:
        self.objects.update({oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()})

    def PullMessages(self, request):  # noqa: N802 - Flower's name
        ids = list(request.message_ids)
        self.asked.append(ids)
        handed = [self.announced.pop(t) for t in ids if t in self.announced]  # handed over once, as the SuperLink does
        return SimpleNamespace(messages_list=[p for p, _ in handed], message_object_trees=[t for _, t in handed])

    def PullObject(self, request):  # noqa: N802
        oid = request.object_id
        return SimpleNamespace(object_found=oid in self.known, object_available=oid in self.objects,
                               object_content=self.objects.get(oid, b""))

    def ConfirmMessageReceived(self, request):  # noqa: N802
        self.confirmed.append(request.message_object_id)


class Grid(HttpGrid):
    """A deployed grid (what ``Replies`` pulls objects from) on :class:`Link`."""

    def __init__(self, link: Link) -> None:  # pylint: disable=super-init-not-called
        self.link, self.node = link, Node(node_id=1)

    _runtime_client = property(lambda self: self.link)
    run = property(lambda self: SimpleNamespace(run_id=1))


def test_a_reply_on_its_way_holds_up_none_of_the_others_and_comes_whole():
    link = Link()
    slow, fast = reply("t-slow", 2, 2_000_000), reply("t-fast", 3, 1000)
    replies = Replies(Grid(link), life=3600.0)
    assert link.announce(slow, missing={"ArrayChunk"})  # its row is still coming up a slow link
    link.announce(fast)
    got = replies.pull(["t-slow", "t-fast"], most=2**24, size=8)
    assert [m.metadata.reply_to_message_id for m in got] == ["t-fast"]
    assert got[0].content["update"]["row"].numpy().tolist() == fast.content["update"]["row"].numpy().tolist()
    assert link.confirmed == [fast.object_id]
    assert replies.pull(["t-slow"], most=2**24, size=8) == []  # asked once per pull, not waited for
    assert len(link.asked) == 1  # handed over already: resumed, not asked for again
    link.arrive(slow)
    assert replies.pull(["t-check"], most=2**24, size=8) == []  # a pull for other tasks (a spot check's)
    assert "t-slow" in replies.arriving and link.confirmed == [fast.object_id]  # neither hands it on nor drops it
    (whole,) = replies.pull(["t-slow"], most=2**24, size=8)
    assert whole.metadata.reply_to_message_id == "t-slow" and whole.object_id == slow.object_id
    assert np.array_equal(whole.content["update"]["row"].numpy(), slow.content["update"]["row"].numpy())
    assert link.confirmed == [fast.object_id, slow.object_id] and not replies.arriving


def test_arriving_replies_count_against_the_room_and_one_given_up_is_let_go():
    link = Link()
    first, second = reply("t1", 2, 1000), reply("t2", 3, 1000)
    replies = Replies(Grid(link), life=0.0)  # a task's life is over as soon as it is handed over
    link.announce(first, missing={"ArrayChunk"})
    link.announce(second)
    assert replies.pull(["t1", "t2"], most=2**24, size=1) == []  # t1 holds the one place: t2 waits in the link
    assert link.asked == [["t1"]] and "t2" in link.announced
    (got,) = replies.pull(["t1", "t2"], most=2**24, size=1)  # t1 still arriving past its life: let go, its place freed
    assert got.metadata.reply_to_message_id == "t2" and not replies.arriving
    assert link.confirmed == [first.object_id, second.object_id]


def test_a_reply_whose_objects_are_gone_or_malformed_is_an_error_message():
    link = Link()
    replies = Replies(Grid(link), life=3600.0)
    gone = reply("t1", 2, 1000)
    proto, tree = message_to_proto(gone), get_object_tree(gone)
    link.announced["t1"] = (proto, ObjectTree(object_id=tree.object_id, children=tree.children))  # never stored
    (err,) = replies.pull(["t1"], most=2**24, size=4)
    assert err.has_error() and "unavailable" in err.error.reason
    big = reply("t2", 3, 2_000_000)  # 8 MB: two chunks
    link.announce(big)
    (err,) = replies.pull(["t2"], most=1000, size=4)  # bigger than a reply may be
    assert err.has_error() and err.error.reason.startswith("malformed reply") and link.confirmed == [big.object_id]
