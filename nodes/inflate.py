"""A pulled message's arrays assembled once, not three times: in a volunteer's ClientApp (a
task, :func:`inflate`) and in the coordinator's ServerApp (a reply, :func:`assemble`).

Flower (1.42) rebuilds a pulled ``Array`` by appending its chunks to a growing ``bytearray``,
then copying that into ``bytes``, while every chunk is still held: the ClientApp of a task on a
384 MB model held about three copies of it at once (1.3 GB, the volunteer's peak, measured by
``python -m evaluation.large_model``), and the ServerApp as much for each reply it pulls.
:func:`lean` replaces ``Array.inflate`` in the process (the volunteer's gate installs it,
``nodes.codetrust.install_gate``) with :func:`inflate`: the same checks and the same array
(dtype, shape, serialisation and bytes), its bytes joined from the chunks in one allocation of
the final size (no growing buffer, no copy of it: the chunks and the array, two copies, until
Flower lets the chunks go; a chunk object may serve several arrays, so none is emptied here;
``bytes``, as Flower's records check). The ServerApp pulls a reply's objects itself
(``nodes.coordinator.pull``) and writes each chunk into the array as it comes
(:func:`assemble`): one copy. The ClientApp hands its bytes to the trainer as they are
(``nodes.wire.pack``); the coordinator checks and spools a reply's row from them.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable, Generator

from flwr.app import Array
from flwr.app.message.arraychunk import ArrayChunk
from flwr.supercore.inflatable.inflatable_object import get_object_body, get_object_children_ids_from_object_content


def inflate(cls, object_content: bytes, children: dict | None = None) -> Array:
    """``Array.inflate``'s array from its content and its chunks (``children``, by object id)."""
    children = children or {}
    meta, ids, order = _layout(object_content)
    if set(order) != set(children):
        raise ValueError(f"Unexpected set of `children`. Expected {set(order)} but got {set(children)}.")
    data = b"".join(children[chunk].data for chunk in order)  # one allocation of the final size
    return cls(dtype=meta["dtype"], shape=tuple(meta["shape"]), stype=meta["stype"], data=data)


Fetch = Callable[[str], "bytes | None"]  # object id -> its deflated content, None while it is still on its way
Waiting = Generator[str, None, "Array"]  # an assembly: yields the id of each object not there yet, returns the array


def assemble(object_content: bytes, fetch: Fetch, most: int) -> Waiting:
    """The array of ``object_content`` (a deflated ``Array``), its chunks fetched one at a time
    (``fetch``: object id -> deflated content) and written into its bytes, each let go once
    written: the array's bytes plus one chunk at a time, where :func:`inflate` needs them all.

    A generator, so that a reply still on its way holds up nobody: where ``fetch`` says a chunk
    is not there yet (``None``: the node is still sending it), it yields that chunk's id; resumed,
    it asks again. It returns the array.

    Flower cuts an array into chunks of one size but the last (``Array.slice_array``), so the
    first and the last give the whole size; a chunk of another size (a node's doing, not
    Flower's) is a ``ValueError``. The bytes object is made at its final size and filled, as
    ``b"".join`` does it in C (``PyBytes_FromStringAndSize(NULL, n)``): nobody else holds it
    until it is returned. An array bigger than ``most`` bytes is a ``ValueError`` before any
    allocation (chunks named many times over make an array of any size)."""
    meta, ids, order = _layout(object_content)
    if set(order) != set(ids):
        raise ValueError(f"an array names {len(set(ids))} chunks but is cut into {len(set(order))}")
    if len(order) < 2:
        data = (yield from _chunk(fetch, order[0])) if order else b""
    else:
        bodies = {order[0]: (yield from _chunk(fetch, order[0]))}
        step = len(bodies[order[0]])
        if order[-1] not in bodies:
            bodies[order[-1]] = yield from _chunk(fetch, order[-1])
        size = step * (len(order) - 1) + len(bodies[order[-1]])
        if size > most:
            raise ValueError(f"an array of {size} bytes, where a reply holds at most {most}")
        data = _new_bytes(None, size)
        start = _bytes_address(data)
        for chunk in dict.fromkeys(order):  # each distinct chunk fetched once, written where it goes
            body = bodies.pop(chunk) if chunk in bodies else (yield from _chunk(fetch, chunk))
            places = [k for k, c in enumerate(order) if c == chunk]
            if any(len(body) != step for k in places if k < len(order) - 1):
                raise ValueError(f"an array's chunks are not of one size ({len(body)} bytes after {step})")
            for k in places:
                ctypes.memmove(start + k * step, body, len(body))
    return Array(dtype=meta["dtype"], shape=tuple(meta["shape"]), stype=meta["stype"], data=data)


def _layout(object_content: bytes) -> tuple[dict, list[str], list[str]]:
    """A deflated array's metadata, its chunks' ids, and the chunk at each place of its bytes."""
    meta = json.loads(get_object_body(object_content, Array).decode("utf-8"))
    ids = get_object_children_ids_from_object_content(object_content)
    return meta, ids, [ids[i] for i in meta["arraychunk_ids"]]


def fetched(fetch: Fetch, object_id: str) -> Generator[str, None, bytes]:
    """``object_id``'s content, yielding its id for as long as ``fetch`` says it is not there yet."""
    while (content := fetch(object_id)) is None:
        yield object_id
    return content


def _chunk(fetch: Fetch, object_id: str) -> Generator[str, None, bytes]:
    return get_object_body((yield from fetched(fetch, object_id)), ArrayChunk)


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype, _bytes_address.argtypes = ctypes.c_void_p, (ctypes.py_object,)


def lean() -> None:
    """Have Flower inflate arrays with :func:`inflate` in this process."""
    Array.inflate = classmethod(inflate)
