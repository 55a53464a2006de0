"""Replies pulled from the SuperLink one object at a time, each array's chunks written straight
into its bytes: the ServerApp holds a reply once, not twice.

Flower's ``HttpGrid.pull_messages`` (1.42) first pulls every object of a message into a dict,
then makes each chunk an ``ArrayChunk`` (a copy of its bytes) and joins them: a 402 MB reply
(100M parameters) held twice at the ServerApp's busiest moment, while the other replies that
came in with it wait in the SuperLink. :func:`pull_messages` does what it does (the same
requests, Flower's own retries and back-off for each object, the same confirmation that lets
the SuperLink free the reply, the same messages, an unavailable reply the same error message;
a malformed one an error message too, where Flower's pull raised)
but assembles each array with :func:`nodes.inflate.assemble`, which lets each chunk go once
it is written: the reply's bytes plus one chunk. Flower's simulation grid moves messages as
they are, with no objects to pull: :func:`pull` hands it to Flower.
"""

from __future__ import annotations

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
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, inflate_object_from_contents, pull_objects

from ..inflate import assemble


def pull(grid: Grid, message_ids: list[str], most: int) -> list[Message]:
    """The replies to ``message_ids`` that came in (on a deployed grid, each array assembled
    once; one bigger than ``most`` bytes makes its reply an error message)."""
    return pull_messages(grid, message_ids, most) if isinstance(grid, HttpGrid) else list(grid.pull_messages(message_ids))


def pull_messages(grid: HttpGrid, message_ids: list[str], most: int) -> list[Message]:
    client, node, run_id = grid._runtime_client, grid.node, grid.run.run_id  # noqa: SLF001 - Flower's own client
    res = client.PullMessages(PullAppMessagesRequest(message_ids=message_ids))
    fetch_one = make_pull_object_fn_protobuf(pull_object_protobuf=client.PullObject, node=node, run_id=run_id)

    def fetch(object_id: str) -> bytes:  # Flower's retries and back-off, one object at a time
        return pull_objects([object_id], fetch_one)[object_id]

    messages = []
    for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
        msg_id = proto.metadata.message_id
        try:
            contents, arrays = _objects(tree, fetch, most)
        except ObjectPullError as err:
            messages.append(_error(proto.metadata.reply_to_message_id, node.node_id, run_id,
                                   f"Reply message objects are unavailable. {err}"))
            continue
        except ValueError as err:  # arrays that are not: a node's doing; the SuperLink may let them go
            client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=node, run_id=run_id, message_object_id=msg_id))
            messages.append(_error(proto.metadata.reply_to_message_id, node.node_id, run_id, f"malformed reply: {err}"))
            continue
        client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=node, run_id=run_id, message_object_id=msg_id))
        message = cast(Message, inflate_object_from_contents(msg_id, contents, objects=arrays))
        message.metadata.__dict__["_message_id"] = msg_id  # as Flower's pull sets it
        messages.append(message)
    return messages


def _objects(tree: ObjectTree, fetch, most: int) -> tuple[dict[str, bytes], dict]:
    """The contents of the message's objects but its arrays, and its arrays assembled (by id)."""
    contents: dict[str, bytes] = {}
    arrays: dict = {}
    pending = [tree]
    while pending:
        branch = pending.pop()
        if branch.object_id in contents or branch.object_id in arrays:
            continue
        content = fetch(branch.object_id)
        if get_object_type_from_object_content(content) == "Array":
            arrays[branch.object_id] = assemble(content, fetch, most)
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
