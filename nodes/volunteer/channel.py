"""The local channel between a volunteer's per-task ClientApp processes and its warm trainer.

A Unix stream socket, ``DIR/trainer/socket``, in a folder only the volunteer's user may enter
(0700; the socket itself 0600): no other user of the machine can hand the trainer a task or
read its replies. The trainer binds it (replacing the one a killed trainer left behind); a
ClientApp connects, sends one request, reads one answer, and the connection closes. A code
bundle's trainer (``nodes.volunteer.bundles``) listens on a socket of its own,
``DIR/trainer/SHA/socket`` (the first 16 digits of the bundle's SHA-256), the same way.

A request and an answer are frames, a frame being its length (8 bytes, big-endian) then its
bytes: a JSON object (the header, with ``parts``: how many frames the body has), then the
body's frames (a Flower ``RecordDict``, the task's content or the reply's, as
``nodes.wire.pack`` cuts it: its protobuf form without the arrays' bytes, then each array's
bytes, sent from the array's own buffer and read into one buffer each, never copied whole). A
request's header holds ``sent_at`` (when the coordinator sent the task, Unix time); an
answer's holds ``error`` (empty, or why the trainer could not answer).

Reading is bounded in time and checked, and each way it fails has its own exception: no
trainer listening (:class:`Absent`), none answering in time (:class:`Silent`), a connection
closed before the answer was whole (:class:`Gone`), bytes that are not an answer
(:class:`Garbled`). The peer's process id comes from the kernel (``SO_PEERCRED``, Linux), not
from anything the peer says.

This module imports neither PyTorch nor Flower: the thin ClientApp and ``robust node join``
use it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DIR, SOCKET = "trainer", "socket"
LENGTH = struct.Struct(">Q")
HEADER_CAP = 1 << 16  # bytes: a header is a few small fields
BODY_CAP = 1 << 40  # bytes: above any model's reply; what is read is only what arrives
SUN_PATH = 100  # bytes: a socket's path must be shorter than 104 (macOS) or 108 (Linux)
CHUNK = 1 << 24  # bytes a read's buffer starts with, and grows by at least
PARTS, PARTS_CAP = "parts", 1 << 16  # the header's count of the body's frames, and its most


class ChannelError(Exception):
    """The trainer could not be asked, or did not answer; ``pid``: the trainer's, if known."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class Absent(ChannelError):
    """No trainer listens on the socket."""


class Silent(ChannelError):
    """The trainer did not answer in time."""


class Gone(ChannelError):
    """The connection closed before the answer was whole (the trainer died)."""


class Garbled(ChannelError):
    """What came back is not an answer."""


def socket_path(folder: Path, bundle: str = "") -> Path:
    """The socket of the node's trainer, or of its trainer for the code bundle of SHA-256 ``bundle``."""
    return folder / DIR / bundle[:16] / SOCKET if bundle else folder / DIR / SOCKET


@contextmanager
def _address(folder: Path, bundle: str = "") -> Iterator[str]:
    """The address of ``folder``'s socket: its path, or (too long for a socket) the same file
    reached through an open descriptor of its folder (Linux)."""
    path = str(socket_path(folder, bundle))
    if len(os.fsencode(path)) < SUN_PATH:
        yield path
        return
    fd = os.open(socket_path(folder, bundle).parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{SOCKET}"
    finally:
        os.close(fd)


def listen(folder: Path, bundle: str = "") -> socket.socket:
    """The trainer's listening socket for the node in ``folder`` (for its code bundle ``bundle``)."""
    where = folder / DIR
    where.mkdir(mode=0o700, exist_ok=True)
    where.chmod(0o700)  # made by an older version, or under another umask
    socket_path(folder, bundle).parent.mkdir(mode=0o700, exist_ok=True)
    socket_path(folder, bundle).unlink(missing_ok=True)  # a killed trainer's
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with _address(folder, bundle) as address:
        server.bind(address)
    socket_path(folder, bundle).chmod(0o600)
    server.listen(8)
    return server


def peer_pid(conn: socket.socket) -> int | None:
    """The process id of the socket's peer, as the kernel says (``None`` where it cannot)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid if uid == os.getuid() else None


def connect(folder: Path, until: float, bundle: str = "") -> socket.socket:
    """A connection to the trainer of ``folder`` (for its code bundle ``bundle``), waiting (by
    ``until``, ``time.monotonic()``) for one being started; :class:`Absent` if none listens by then."""
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _address(folder, bundle) as address:
                conn.connect(address)
            return conn
        except OSError as err:  # none yet (no socket file, or a dead trainer's)
            conn.close()
            if time.monotonic() >= until:
                raise Absent(f"no trainer listens on {socket_path(folder, bundle)} ({err.strerror})") from None
            time.sleep(0.2)


def send(conn: socket.socket, header: dict, body: list[bytes]) -> None:
    """``header`` (with the count of ``body``'s frames, ``parts``) and each frame of ``body``."""
    head = json.dumps({**header, PARTS: len(body)}).encode()
    conn.sendall(LENGTH.pack(len(head)) + head)
    for part in body:
        conn.sendall(LENGTH.pack(len(part)))
        conn.sendall(part)


def _read(conn: socket.socket, n: int, until: float | None) -> bytearray:
    """``n`` bytes from ``conn``, read into one buffer (a 400 MB body is held once, never copied);
    the buffer grows with what arrives, so a length no one sends costs nothing."""
    out, got = bytearray(min(n, CHUNK)), 0
    while got < n:
        if until is not None:
            left = until - time.monotonic()
            if left <= 0:
                raise Silent("no answer in time")
            conn.settimeout(left)
        if got == len(out):
            out.extend(bytes(min(n - got, max(got, CHUNK))))  # doubling: each byte is moved O(1) times
        try:
            with memoryview(out) as view:
                k = conn.recv_into(view[got:], min(len(out) - got, 1 << 20))
        except TimeoutError:
            raise Silent("no answer in time") from None
        except OSError as err:
            raise Gone(f"the connection failed ({err.strerror or err})") from None
        if not k:
            raise Gone(f"the connection closed after {got} of {n} bytes")
        got += k
    return out


def _frame(conn: socket.socket, cap: int, until: float | None) -> bytearray:
    (n,) = LENGTH.unpack(_read(conn, LENGTH.size, until))
    if n > cap:
        raise Garbled(f"a frame of {n} bytes (at most {cap})")
    return _read(conn, n, until)


def receive(conn: socket.socket, until: float | None = None) -> tuple[dict, list[bytearray]]:
    """``(header, body's frames)`` from ``conn``, whole by ``until`` (``time.monotonic()``;
    ``None``: no limit)."""
    try:
        header = json.loads(_frame(conn, HEADER_CAP, until))
    except (UnicodeDecodeError, ValueError):
        raise Garbled("the header is not JSON") from None
    if not isinstance(header, dict):
        raise Garbled(f"the header is a JSON {type(header).__name__}, not an object")
    parts = header.pop(PARTS, None)
    if type(parts) is not int or not 0 <= parts <= PARTS_CAP:
        raise Garbled(f"the header's {PARTS} is {parts!r}, not a count of frames (at most {PARTS_CAP})")
    return header, [_frame(conn, BODY_CAP, until) for _ in range(parts)]


def ask(folder: Path, header: dict, body: Callable[[], list[bytes]], until: float, bundle: str = ""
        ) -> tuple[dict, list[bytearray], int | None]:
    """Send a request (``body()``: its body, made once connected and let go once sent: a big
    task is not held while the trainer works) to the trainer of ``folder`` (for its code bundle
    ``bundle``); its answer, whole by ``until`` (``time.monotonic()``), and the trainer's pid. A
    :class:`ChannelError` says why not, with the trainer's pid."""
    conn = connect(folder, until, bundle)
    pid = peer_pid(conn)
    try:
        with conn:
            conn.settimeout(max(until - time.monotonic(), 0.001))  # a trainer that reads nothing fills the buffer
            try:
                send(conn, header, body())
            except TimeoutError:
                raise Silent("the request was not read in time") from None
            except OSError as err:
                raise Gone(f"the request could not be sent ({err.strerror or err})") from None
            return (*receive(conn, until), pid)
    except ChannelError as err:
        err.pid = pid
        raise
