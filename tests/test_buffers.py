"""FedBuff's schedule (``nodes.engine.buffers``), the one both the coordinator and the bench drive."""

import pytest

from nodes.engine.buffers import Buffers


def test_a_buffer_counts_valid_replies_only_and_keeps_the_others_for_its_record():
    b = Buffers(2)
    assert b.add("a", "bad", False) == []
    assert b.add("b", "ok", True) == []
    [full] = b.add("c", "ok", True)
    assert full.replies == {"a": "bad", "b": "ok", "c": "ok"} and full.held == []
    assert b.filling == {} and b.held == []


def test_one_reply_per_node_the_next_held_oldest_first():
    b = Buffers(2)
    b.add("a", "a1", True)
    b.add("a", "a2", True)
    b.add("a", "a3", False)
    b.add("a", "a4", True)
    [full] = b.add("b", "b1", True)
    assert full.replies == {"a": "a1", "b": "b1"} and full.held == ["a", "a"]  # the valid ones waiting
    assert b.filling == {"a": ("a2", True)}  # the oldest of a's held replies, one per node
    assert [(node, reply) for node, reply, _ in b.held] == [("a", "a3"), ("a", "a4")]


def test_held_replies_can_fill_several_buffers_in_a_row():
    b = Buffers(2)
    b.add("a", "a1", True)
    b.add("b", "b1", False)  # filed, does not count: the buffer still waits
    for reply in ("a2", "b2", "a3", "b3"):
        assert b.add(reply[0], reply, True) == []  # a and b are in the buffer: held
    fulls = b.add("c", "c1", True)
    assert [f.replies for f in fulls] == [{"a": "a1", "b": "b1", "c": "c1"}, {"a": "a2", "b": "b2"},
                                          {"a": "a3", "b": "b3"}]
    assert [f.held for f in fulls] == [["a", "a", "b", "b"], ["a", "b"], []]
    assert b.filling == {} and b.held == []


def test_a_buffer_holds_at_least_one_reply():
    with pytest.raises(ValueError, match="at least 1 valid reply"):
        Buffers(0)


def test_a_buffer_with_a_reply_from_every_node_that_may_answer_leaves_whatever_their_validity():
    b = Buffers(3)
    assert b.add("a", "bad", False, {"a", "b", "c"}) == []
    assert b.add("a", "bad again", False, {"a", "b", "c"}) == []  # held: a is in the buffer
    assert b.add("b", "ok", True, {"a", "b", "c"}) == []
    [full] = b.add("c", "bad", False, {"a", "b", "c"})  # 1 valid of 3, but nothing more could come
    assert full.replies == {"a": "bad", "b": "ok", "c": "bad"} and b.filling == {"a": ("bad again", False)}
    assert Buffers(3).add("a", "ok", True) == []  # without everyone: only valid replies fill
