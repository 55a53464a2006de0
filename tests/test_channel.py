"""The volunteer's local channel (``nodes.volunteer.channel``) on a real socket pair: bodies of
any size whole and in one buffer, and each way a read fails."""

import socket
import threading
import time

import pytest

from nodes.volunteer import channel


def pair():
    a, b = socket.socketpair()
    return a, b


@pytest.mark.parametrize("size", [0, 1, channel.CHUNK - 1, channel.CHUNK + 1, 5 * channel.CHUNK + 123])
def test_a_body_of_any_size_arrives_whole(size):
    a, b = pair()
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    writer = threading.Thread(target=channel.send, args=(a, {"error": ""}, body))
    writer.start()
    header, got = channel.receive(b, time.monotonic() + 60)
    writer.join()
    assert header == {"error": ""} and isinstance(got, bytearray) and got == body
    a.close(), b.close()


def test_each_way_a_read_fails():
    a, b = pair()
    head = b'{"error": ""}'
    a.sendall(channel.LENGTH.pack(len(head)) + head + channel.LENGTH.pack(1 << 30) + b"x" * 1000)
    a.close()  # a body announced as 1 GiB, 1000 bytes sent: no 1 GiB buffer, a clear error
    with pytest.raises(channel.Gone, match="closed after 1000 of 1073741824 bytes"):
        channel.receive(b, time.monotonic() + 10)
    a, b = pair()
    a.sendall(channel.LENGTH.pack(channel.HEADER_CAP + 1))
    with pytest.raises(channel.Garbled, match="at most"):
        channel.receive(b, time.monotonic() + 10)
    a, b = pair()
    a.sendall(channel.LENGTH.pack(2) + b"[]")
    with pytest.raises(channel.Garbled, match="not an object"):
        channel.receive(b, time.monotonic() + 10)
    a, b = pair()
    a.sendall(channel.LENGTH.pack(len(head)) + head + channel.LENGTH.pack(10) + b"12345")
    with pytest.raises(channel.Silent, match="no answer in time"):
        channel.receive(b, time.monotonic() + 0.3)  # half a body, then nothing
