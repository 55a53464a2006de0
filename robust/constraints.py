"""Parameters declared once, as data, with their constraints (after scikit-learn's
``_parameter_constraints``): a rule's, an attack's or a codec's spec parameter, a protocol's
option, a coordinator setting, a scenario key and a command-line option are each a
:class:`Param`, checked by the same rule and refused with the same one-line error, which names
the component, the key and what is allowed (:func:`check_all`, the one function they all go
through)::

    multi-krum: m must be an integer >= 1 (got m=0)

A :class:`Param` names its key, its rule, its default and a one-line meaning (a default of
``None`` means "derived from the round", e.g. multi-krum's ``m = n - f``, and is accepted as
such). A :class:`Relation` ties two parameters (``hi > lo``). Rules: :class:`Interval` (an
int or float range), :class:`OneOf` (a fixed or computed list of names, optionally or a
user's ``package.module:attribute``), :class:`Text`, :class:`Folder`, :class:`Host`,
:class:`Flag` (a bool) and :class:`Spec` (a value a builder accepts, e.g. an aggregator spec;
the builder's own message says what is wrong). ``rule.describe()`` is the text of what is
allowed, in errors and in the manual's reference alike.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .user_code import is_reference


@dataclass(frozen=True)
class Interval:
    """An ``int`` (bools refused) or a ``float`` (ints accepted) in a range; ``None`` bounds
    are open. ``closed`` says which ends belong: ``both``, ``left``, ``right``, ``neither``."""

    kind: type
    low: float | None = None
    high: float | None = None
    closed: str = "both"

    def accepts(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else int):
            return False
        if not math.isfinite(value):
            return False
        left, right = self.closed in ("both", "left"), self.closed in ("both", "right")
        if self.low is not None and (value < self.low if left else value <= self.low):
            return False
        return self.high is None or (value <= self.high if right else value < self.high)

    def convert(self, value: object) -> object:
        return float(value) if self.kind is float else value

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        left, right = self.closed in ("both", "left"), self.closed in ("both", "right")
        if self.low is not None and self.high is not None:
            return f"{what} in {'[' if left else '('}{self.low:g}, {self.high:g}{']' if right else ')'}"
        if self.low is not None:
            return f"{what} {'>=' if left else '>'} {self.low:g}"
        if self.high is not None:
            return f"{what} {'<=' if right else '<'} {self.high:g}"
        return f"a finite {'integer' if self.kind is int else 'number'}"


class _AsGiven:
    """A rule whose accepted values are used as they are."""

    def convert(self, value: object) -> object:
        return value


@dataclass(frozen=True)
class OneOf(_AsGiven):
    """One of a list of names, given as a tuple or as a function (imported lazily); with
    ``user`` (e.g. ``"factory"``), also a user's callable written ``package.module:factory``
    (``robust.user_code``: imported when used)."""

    choices: tuple[str, ...] | Callable[[], Iterable[str]]
    user: str = ""
    spec: Callable[[str], object] | None = None  # also a spec it parses (raising ValueError otherwise)
    example: str = ""  # such a spec, for the message

    def names(self) -> list[str]:
        return list(self.choices() if callable(self.choices) else self.choices)

    def accepts(self, value: object) -> bool:
        return isinstance(value, str) and (value in self.names() or bool(self.user) and is_reference(value)
                                           or self._parses(value))

    def _parses(self, value: str) -> bool:
        """Whether ``value`` is a spec ``spec`` takes; its ``ValueError`` (what is wrong) goes up."""
        if self.spec is None or ":" not in value or is_reference(value):
            return False
        self.spec(value)
        return True

    def describe(self) -> str:
        return ("one of " + ", ".join(self.names()) + (f", a spec such as {self.example}" if self.example else "")
                + (f", or package.module:{self.user}" if self.user else ""))


@dataclass(frozen=True)
class Folder:
    """An existing folder, kept as an absolute path (``""``: none)."""

    def accepts(self, value: object) -> bool:
        return isinstance(value, str) and (not value or Path(value).expanduser().is_dir())

    def convert(self, value: object) -> object:
        return str(Path(value).expanduser().resolve()) if value else ""

    def describe(self) -> str:
        return "an existing folder"


@dataclass(frozen=True)
class Text(_AsGiven):
    """Any string."""

    def accepts(self, value: object) -> bool:
        return isinstance(value, str)

    def describe(self) -> str:
        return "a string"


@dataclass(frozen=True)
class Host(_AsGiven):
    """An IP address, or a host name (RFC 1123 labels; a dotted all-digit name must be an address)."""

    def accepts(self, value: object) -> bool:
        if not isinstance(value, str):
            return False
        try:
            ipaddress.ip_address(value)
            return True
        except ValueError:
            pass
        labels = value.split(".")
        return (len(value) <= 253 and not all(label.isdigit() for label in labels)
                and all(_LABEL.fullmatch(label) for label in labels))

    def describe(self) -> str:
        return "an IP address or a host name"


_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True)
class Flag(_AsGiven):
    """``true`` or ``false``."""

    def accepts(self, value: object) -> bool:
        return isinstance(value, bool)

    def describe(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Spec(_AsGiven):
    """A spec string that ``build`` accepts (``build`` raises ``ValueError`` saying why not)."""

    build: Callable[[str], object]
    what: str

    def accepts(self, value: object) -> bool:
        if not isinstance(value, str):
            return False
        self.build(value)  # its ValueError carries the precise reason
        return True

    def describe(self) -> str:
        return self.what


Rule = Interval | OneOf | Folder | Text | Host | Flag | Spec


@dataclass(frozen=True)
class Param:
    """One declared parameter: ``key`` (kebab-case), its rule, default and help; ``tune``: a
    defence's hyperparameter, which ``robust bench --tune`` chooses (``evaluation.bench.tune``)."""

    key: str
    rule: Rule
    default: object
    help: str
    tune: bool = False

    @property
    def attr(self) -> str:
        """The Python name (``batch-size`` -> ``batch_size``)."""
        return self.key.replace("-", "_")

    @property
    def kind(self) -> type:
        """The command-line type of the value."""
        if isinstance(self.rule, Interval):
            return self.rule.kind
        return bool if isinstance(self.rule, Flag) else str

    def check(self, value: object) -> object:
        """``value`` converted to the parameter's type, or ``ValueError`` in one line."""
        if value is None and self.default is None:
            return None
        try:
            ok = self.rule.accepts(value)
        except ValueError as err:  # the builder's own words; named by the key unless they are already
            message = str(err)
            raise ValueError(message if message.startswith(self.key) else f"{self.key}: {message}") from None
        if not ok:
            raise ValueError(f"{self.key} must be {self.rule.describe()} (got {self.key}={value!r})")
        return self.rule.convert(value)


@dataclass(frozen=True)
class Relation:
    """A constraint between two parameters that no single rule states: ``key`` must be
    ``text`` given ``other`` (``hi`` must be ``> lo``), ``holds`` tells from the checked values."""

    key: str
    text: str
    other: str
    holds: Callable[[dict[str, object]], bool]

    def check(self, values: dict[str, object]) -> None:
        if not self.holds(values):
            got = f"{self.key}={values[self.key]!r}, {self.other}={values[self.other]!r}"
            raise ValueError(f"{self.key} must be {self.text} (got {got})")


def table(*params: Param) -> dict[str, Param]:
    """Params by key."""
    return {p.key: p for p in params}


def unknown(given: Iterable[str], known: Iterable[str], where: str) -> None:
    """Refuse keys that are not declared, listing the ones that are."""
    extra = sorted(set(given) - set(known))
    if extra:
        raise ValueError(f"{where}: unknown {'key' if len(extra) == 1 else 'keys'} {', '.join(extra)} "
                         f"(known: {', '.join(sorted(known)) or 'none'})")


def check_all(where: str, declared: dict[str, Param], given: dict[str, object],
              relations: Iterable[Relation] = ()) -> dict[str, object]:
    """Every declared parameter's value (``given``'s, else its default), checked and converted;
    the first unknown key, bad value or broken relation is a ``ValueError`` in one line that
    starts with ``where`` (the component's name)."""
    unknown(given, declared, where)
    try:
        values = {key: p.check(given.get(key, p.default)) for key, p in declared.items()}
        for relation in relations:
            relation.check(values)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return values
