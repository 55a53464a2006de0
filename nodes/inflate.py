"""A pulled message's arrays assembled once, not three times: in a volunteer's ClientApp (a
task) and in the coordinator's ServerApp (a reply).

Flower (1.42) rebuilds a pulled ``Array`` by appending its chunks to a growing ``bytearray``,
then copying that into ``bytes``, while every chunk is still held: the ClientApp of a task on a
384 MB model held about three copies of it at once (1.3 GB, the volunteer's peak, measured by
``python -m evaluation.large_model``), and the ServerApp as much for each reply it pulls.
:func:`lean` replaces ``Array.inflate`` in the process (the volunteer's gate installs it,
``nodes.codetrust.install_gate``; the ServerApp at its start, ``nodes.coordinator.server_app``)
with :func:`inflate`: the same checks and the same array (dtype, shape, serialisation and
bytes), its bytes joined from the chunks in one allocation of the final size (no growing
buffer, no copy of it: the chunks and the array, two copies, until Flower lets the chunks go;
a chunk object may serve several arrays, so none is emptied here; ``bytes``, as Flower's
records check). The ClientApp hands those bytes to the trainer as they are
(``nodes.wire.pack``); the coordinator checks and spools a reply's row from them.
"""

from __future__ import annotations

import json

from flwr.app import Array
from flwr.supercore.inflatable.inflatable_object import get_object_body, get_object_children_ids_from_object_content


def inflate(cls, object_content: bytes, children: dict | None = None) -> Array:
    """``Array.inflate``'s array from its content and its chunks (``children``, by object id)."""
    children = children or {}
    meta = json.loads(get_object_body(object_content, cls).decode("utf-8"))
    ids = get_object_children_ids_from_object_content(object_content)
    order = [ids[i] for i in meta["arraychunk_ids"]]
    if set(order) != set(children):
        raise ValueError(f"Unexpected set of `children`. Expected {set(order)} but got {set(children)}.")
    data = b"".join(children[chunk].data for chunk in order)  # one allocation of the final size
    return cls(dtype=meta["dtype"], shape=tuple(meta["shape"]), stype=meta["stype"], data=data)


def lean() -> None:
    """Have Flower inflate arrays with :func:`inflate` in this process."""
    Array.inflate = classmethod(inflate)
