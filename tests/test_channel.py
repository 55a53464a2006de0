"""The volunteer's local channel (``nodes.volunteer.channel``) on a real socket pair: frames of
any size whole and in one buffer each, a message's content cut into frames and put back
(``nodes.wire.pack``), and each way a read fails."""

import socket
import threading
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from nodes.volunteer import channel
from nodes.wire import array_of, npy_array, pack, unpack


def pair():
    a, b = socket.socketpair()
    return a, b


@pytest.mark.parametrize("size", [0, 1, channel.CHUNK - 1, channel.CHUNK + 1, 5 * channel.CHUNK + 123])
def test_a_body_of_any_size_arrives_whole(size):
    a, b = pair()
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    writer = threading.Thread(target=channel.send, args=(a, {"error": ""}, [body, b"", body[:7]]))
    writer.start()
    header, got = channel.receive(b, time.monotonic() + 60)
    writer.join()
    assert header == {"error": ""} and all(isinstance(part, bytearray) for part in got)
    assert got == [body, b"", body[:7]]
    a.close(), b.close()


def test_a_content_travels_as_its_arrays_own_bytes():
    w, s = np.arange(10, dtype=np.float32), np.arange(6, dtype=np.int8).reshape(2, 3)
    content = RecordDict({"model": ArrayRecord({"w": Array(w), "b": Array(w[:3])}), "task": ConfigRecord({"round": 3}),
                          "extra": ArrayRecord({"s": Array(s)})})
    frames = pack(content)
    assert len(frames) == 4 and all(len(f) < 200 for f in frames[1:])
    assert any(f is content.array_records["model"]["w"].data for f in frames)  # not copied
    back = unpack([bytearray(f) for f in frames])
    assert back.config_records["task"]["round"] == 3
    assert np.array_equal(back.array_records["model"]["w"].numpy(), w)
    assert np.array_equal(back.array_records["model"]["b"].numpy(), w[:3])
    assert np.array_equal(back.array_records["extra"]["s"].numpy(), s)
    assert content.array_records["model"]["w"].data  # the sender's content untouched
    assert array_of(back.array_records["model"]["w"]).base is not None  # a view of the frame, not a copy
    w_bytes = content.array_records["model"]["w"].data
    taken = pack(content, take=True)  # handed over: the frames are the bytes' only holders
    assert taken[1:] == frames[1:] and any(f is w_bytes for f in taken)
    assert all(a.data == b"" for record in content.array_records.values() for a in record.values())
    for bad in ([b"this is not a reply"], frames[:2], [frames[0]] + frames[1:] + [b"x"], []):
        with pytest.raises(ValueError, match="not a message's content"):
            unpack(list(bad))


def test_each_way_a_read_fails():
    a, b = pair()
    head = b'{"error": "", "parts": 1}'
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
    for parts in ("-1", '"2"', "70000", "null"):
        bad = b'{"parts": ' + parts.encode() + b"}"
        a.sendall(channel.LENGTH.pack(len(bad)) + bad)
        with pytest.raises(channel.Garbled, match="not a count of frames"):
            channel.receive(b, time.monotonic() + 10)
    a.sendall(channel.LENGTH.pack(len(head)) + head + channel.LENGTH.pack(10) + b"12345")
    with pytest.raises(channel.Silent, match="no answer in time"):
        channel.receive(b, time.monotonic() + 0.3)  # half a body, then nothing


def test_an_array_is_flowers_own_bytes_made_with_one_copy():
    for a in (np.arange(10, dtype=np.float32), np.arange(7, dtype=np.float16), np.arange(-5, 5, dtype=np.int8),
              np.zeros(0, np.float32), np.arange(12.0).reshape(3, 4), np.arange(12.0).reshape(3, 4).T):
        ours, flowers = npy_array(a), Array(np.ascontiguousarray(a))
        assert (ours.data, ours.dtype, ours.shape, ours.stype) == (flowers.data, flowers.dtype, flowers.shape, flowers.stype)
        assert ours.object_id == flowers.object_id and np.array_equal(ours.numpy(), a)
