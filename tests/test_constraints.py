"""Parameters declared as data: one rule, one conversion, one error format."""

import re

import pytest

from robust.constraints import Flag, Interval, OneOf, Param, Spec, Text, unknown


def check(rule, value, default=None):
    return Param("key", rule, default, "help").check(value)


@pytest.mark.parametrize("rule, value, words", [
    (Interval(int, 1, None), 0, "key must be an integer >= 1 (got key=0)"),
    (Interval(int, 1, None), True, "key must be an integer >= 1 (got key=True)"),  # a bool is no count
    (Interval(int, 1, None), 2.0, "key must be an integer >= 1 (got key=2.0)"),
    (Interval(float, 0, 1, "left"), 1.0, "key must be a number in [0, 1) (got key=1.0)"),
    (Interval(float, 0, None, "neither"), float("nan"), "key must be a number > 0 (got key=nan)"),
    (Interval(float, None, 5, "both"), float("inf"), "key must be a number <= 5 (got key=inf)"),
    (Interval(int, 1, 65535), 70000, "key must be an integer in [1, 65535] (got key=70000)"),
    (OneOf(lambda: ["a", "b"]), "c", "key must be one of a, b (got key='c')"),
    (Text(), 3, "key must be a string (got key=3)"),
    (Flag(), "yes", "key must be true or false (got key='yes')"),
])
def test_a_bad_value_is_one_line_naming_the_rule(rule, value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        check(rule, value)


def test_good_values_are_converted_once():
    assert check(Interval(float, 0, None), 3) == 3.0 and type(check(Interval(float, 0, None), 3)) is float
    assert check(Interval(int, 0, None), 3) == 3 and check(OneOf(("a",)), "a") == "a"
    assert check(Flag(), False) is False


def test_a_spec_rule_keeps_the_builders_words_named_by_the_key():
    def build(spec):
        if spec != "ok":
            raise ValueError(f"unknown thing {spec!r}: choose ok")

    assert check(Spec(build, "a thing"), "ok") == "ok"
    with pytest.raises(ValueError, match=re.escape("key: unknown thing 'no': choose ok")):
        check(Spec(build, "a thing"), "no")
    with pytest.raises(ValueError, match=re.escape("key must be a thing (got key=3)")):
        check(Spec(build, "a thing"), 3)


def test_unknown_keys_list_the_known_ones():
    unknown({"a": 1}, {"a": None}, "here")
    with pytest.raises(ValueError, match=re.escape("here: unknown keys b, c (known: a)")):
        unknown({"a": 1, "c": 2, "b": 3}, {"a": None}, "here")
