"""Replies pulled from the SuperLink one object at a time, each array's chunks written straight
into its bytes: the ServerApp holds a reply once, not twice; and a reply still on its way holds
up nobody.

Flower's ``HttpGrid.pull_messages`` (1.42) first pulls every object of a message into a dict,
then makes each chunk an ``ArrayChunk`` (a copy of its bytes) and joins them: a 402 MB reply
(100M parameters) held twice at the ServerApp's busiest moment, while the other replies that
came in with it wait in the SuperLink. And the SuperLink hands a reply over as soon as its
node has announced it, while its objects are still coming up the node's link: Flower's pull
then waits for each missing object, retrying with a back-off of 1 to 10 s, and every reply
behind it waits too. On a 2 Mbit/s uplink a 4.5 MB reply takes 18 s: in the field lab an
asynchronous run's fast volunteers were read only once the slow ones' replies were in (27 s
after their task, where 8 s had been their own), so buffers filled in lockstep.

:class:`Replies` does what Flower's pull does (the same requests, the same confirmation that
lets the SuperLink free the reply, the same messages, an unavailable reply the same error
message; a malformed one an error message too, where Flower's pull raised) but assembles each
array with :func:`nodes.inflate.assemble`, which lets each chunk go once it is written (the
reply's bytes plus one chunk), and asks once for each object: a reply whose objects are not all
there yet is kept *arriving* (its assembly paused where the first missing object is) and
resumed at the next pull that asks for it, while the replies that are complete are handed on
(a pull for other tasks, a round's spot checks say, neither hands it on nor drops it). A reply
still arriving a task's whole life after it was handed over is let go: its task was given up.
Flower's simulation grid moves messages as they are, with no objects to pull: it is handed to
Flower.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import cast

from flwr.app import Message, Metadata
from flwr.app.error import Error
from flwr.app.message import make_message
from flwr.common.constant import ErrorCode
from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest, ObjectTree  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PullAppMessagesRequest  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.superlink.grid import HttpGrid
from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
from flwr.supercore.date import now
from flwr.supercore.inflatable.inflatable_object import get_object_type_from_object_content
from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
from flwr.supercore.inflatable.inflatable_utils import (ObjectPullError, ObjectUnavailableError,
                                                         inflate_object_from_contents)

from ..inflate import Fetch, assemble, fetched


class Replies:
    """The replies pulled from ``grid``, at most a pull's ``size`` in the ServerApp at a time; a
    task lives ``life`` seconds (see the module)."""

    def __init__(self, grid: Grid, life: float) -> None:
        self.grid, self.life = grid, life
        self.arriving: dict[str, _Arriving] = {}  # task (message) id -> its reply, objects still coming

    def pull(self, message_ids: list[str], most: int, size: int) -> list[Message]:
        """Replies to ``message_ids`` that are in: each array assembled once (one bigger than
        ``most`` bytes makes its reply an error message), at most ``size`` replies held at once,
        those arriving included (the ids asked ``size`` at a time, until one is in)."""
        if not isinstance(self.grid, HttpGrid):
            for start in range(0, len(message_ids), size):
                if replies := list(self.grid.pull_messages(message_ids[start:start + size])):
                    return replies
            return []
        now = time.monotonic()
        for task in [t for t, reply in self.arriving.items() if now - reply.since > self.life]:  # given up
            self.arriving.pop(task).drop()
        handed = set(self.arriving)  # handed over already: resumed, never asked for again
        out = [m for task in message_ids if task in handed and (m := self._resume(task)) is not None]
        fresh = [t for t in message_ids if t not in handed]
        while fresh and (room := size - len(self.arriving) - len(out)) > 0:
            asked, fresh = fresh[:room], fresh[room:]
            res = self.grid._runtime_client.PullMessages(PullAppMessagesRequest(message_ids=asked))  # noqa: SLF001
            for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
                task = proto.metadata.reply_to_message_id
                self.arriving[task] = _Arriving(self.grid, proto, tree, most)
                if (message := self._resume(task)) is not None:
                    out.append(message)
            if out:
                break
        return out

    def _resume(self, task: str) -> Message | None:
        """The reply to ``task`` if its assembly could finish now (then it is no longer arriving)."""
        message = self.arriving[task].resume()
        if message is not None:
            del self.arriving[task]
        return message


class _Arriving:
    """One reply the SuperLink handed over, its objects fetched as they come in."""

    def __init__(self, grid: HttpGrid, proto, tree: ObjectTree, most: int) -> None:
        self.client, self.node, self.run_id = grid._runtime_client, grid.node, grid.run.run_id  # noqa: SLF001
        self.msg_id, self.reply_to = proto.metadata.message_id, proto.metadata.reply_to_message_id
        self.since = time.monotonic()  # when the SuperLink handed it over
        fetch_one = make_pull_object_fn_protobuf(pull_object_protobuf=self.client.PullObject, node=self.node,
                                                 run_id=self.run_id)

        def fetch(object_id: str) -> bytes | None:  # one try: None while the node is still sending it
            try:
                return fetch_one(object_id)
            except ObjectUnavailableError:
                return None

        self.assembly = _objects(tree, fetch, most)

    def resume(self) -> Message | None:
        """The reply (or an error message in its place), or ``None`` while an object is missing."""
        try:
            next(self.assembly)
            return None
        except StopIteration as end:
            contents, arrays = end.value
        except ObjectPullError as err:
            return _error(self.reply_to, self.node.node_id, self.run_id, f"Reply message objects are unavailable. {err}")
        except ValueError as err:  # arrays that are not: a node's doing; the SuperLink may let them go
            self.confirm()
            return _error(self.reply_to, self.node.node_id, self.run_id, f"malformed reply: {err}")
        self.confirm()
        message = cast(Message, inflate_object_from_contents(self.msg_id, contents, objects=arrays))
        message.metadata.__dict__["_message_id"] = self.msg_id  # as Flower's pull sets it
        return message

    def drop(self) -> None:
        """Let the reply go, its objects too (its task was given up)."""
        self.assembly.close()
        self.confirm()

    def confirm(self) -> None:
        self.client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=self.node, run_id=self.run_id,
                                                                         message_object_id=self.msg_id))


def _objects(tree: ObjectTree, fetch: Fetch, most: int) -> Generator[str, None, tuple[dict[str, bytes], dict]]:
    """The contents of the message's objects but its arrays, and its arrays assembled (by id);
    yields the id of each object not there yet (see :func:`nodes.inflate.assemble`)."""
    contents: dict[str, bytes] = {}
    arrays: dict = {}
    pending = [tree]
    while pending:
        branch = pending.pop()
        if branch.object_id in contents or branch.object_id in arrays:
            continue
        content = yield from fetched(fetch, branch.object_id)
        if get_object_type_from_object_content(content) == "Array":
            arrays[branch.object_id] = yield from assemble(content, fetch, most)
        else:
            contents[branch.object_id] = content
            pending += branch.children
    return contents, arrays


def _error(reply_to: str, node_id: int, run_id: int, reason: str) -> Message:
    """An error message in place of a reply that could not be pulled, as Flower makes one."""
    return make_message(
        metadata=Metadata(run_id=run_id, message_id="", src_node_id=node_id, dst_node_id=node_id,
                          message_type=SYSTEM_MESSAGE_TYPE, group_id="", ttl=0, reply_to_message_id=reply_to,
                          created_at=now().timestamp()),
        error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=reason))
