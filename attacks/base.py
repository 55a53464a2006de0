"""What every attack shares: the round context it sees, the registry, the two kinds.

*Omniscient* attacks run on the coordinator's side of the threat model (benchmark mode
only): they see the round's honest updates, the aggregator actually deployed, the previous
aggregate and a seeded generator, and return the ``f`` Byzantine rows. Byzantine nodes may
collude: one call crafts all ``f`` rows. *Node-side* attacks change what a Byzantine node
trains on; its update is then computed like an honest one, by the one training function
(``nodes.engine.protocol.Protocol.node_update``), which an attack may bend through a :class:`Shaping`
hook (an extra loss term, a per-step gradient transform) but never replace. An attack whose
poisoning reads the model it is sent (:attr:`~NodeAttack.sees_model`: ``a3fl``'s trigger,
optimised against it) gets a :class:`Sight` of the task in :meth:`~NodeAttack.poison`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

Params = dict[str, torch.Tensor]

from robust.constraints import Interval, Param
from robust.registry import Component, Registry

REGISTRY: Registry[Attack] = Registry("attack")
register = REGISTRY.register


@dataclass
class Context:
    """What an omniscient attack knows about the round it attacks."""

    n: int  # rows the aggregator will see: honest + Byzantine
    generator: torch.Generator  # seeded from (run seed, round, "attack")
    aggregator: Callable[[torch.Tensor], torch.Tensor] | None = None  # the deployed chain
    previous: torch.Tensor | None = None  # previous aggregate, (d,)
    own: torch.Tensor | None = None  # the Byzantine nodes' own honest updates, (f, d)
    round: int = 0
    state: dict = field(default_factory=dict)
    # the deployment's detectors (``nodes.engine.detectors``): rows -> {detector: score per row}, and
    # the flag policy's per-round rule: those scores -> which rows it flags (bool)
    detectors: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None
    flagged: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
    layout: list[tuple[str, tuple[int, ...]]] | None = None  # (name, shape) of the row's pieces, in order
    step_sign: int | None = None  # +1: the server moves the model along the aggregate (delta); -1: against it

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        """The deployed aggregator on ``X`` without touching its state (for searches)."""
        if self.aggregator is None:
            raise ValueError("this attack searches against the aggregator: pass it in the Context")
        return copy.deepcopy(self.aggregator)(X)


def spread_param(default: float) -> Param:
    """``spread``, the omniscient attacks' jitter (see :class:`OmniscientAttack`), with an
    attack's own default."""
    return Param("spread", Interval(float, 0, None), default,
                 "each colluding row's own seeded jitter, in honest stds (0: identical rows)")


def unit(x: torch.Tensor) -> torch.Tensor:
    """``x / ||x||``; zero stays zero."""
    return x / x.norm().clamp_min(torch.finfo(x.dtype).tiny)


def honest_std(H: torch.Tensor) -> torch.Tensor:
    """Per-coordinate population standard deviation of the honest rows (the attacks' unit)."""
    return (H - H.mean(dim=0)).square().mean(dim=0).sqrt()


class Attack(Component):
    """Base of every attack; ``f`` is the number of Byzantine nodes."""

    kind: ClassVar[str]


class OmniscientAttack(Attack):
    """Crafts the ``f`` Byzantine rows from the honest rows ``H`` of shape ``(h, d)``.

    ``spread`` (any attack's spec may set it, e.g. ``alie:z=1,spread=0.1``) makes colluding
    rows differ: each row gets its own seeded Gaussian jitter of ``spread`` times the honest
    rows' per-coordinate standard deviation, so the rows are not identical copies.
    """

    kind = "omniscient"
    params = (spread_param(0.0),)
    spread: float
    jitters_in_craft: ClassVar[bool] = False  # craft adds the jitter itself (it checks the rows it sends)

    def __call__(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        if H.dim() != 2 or H.shape[0] < 1:
            raise ValueError(f"{self.name} needs at least one honest row (got shape {tuple(H.shape)})")
        rows = self.craft(H, ctx)
        rows = rows.expand(self.f, -1).clone() if rows.dim() == 1 else rows
        if self.spread and not self.jitters_in_craft:
            rows = rows + self.jitter_rows(H, ctx)
        return rows

    def jitter_rows(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The ``(f, d)`` seeded jitter of ``spread``: ``spread * std(H) * N(0, 1)`` per row."""
        noise = torch.randn((self.f, H.shape[1]), generator=ctx.generator, dtype=H.dtype).to(H.device)
        return self.spread * honest_std(H) * noise

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The Byzantine rows ``(f, d)``, or one ``(d,)`` row that all ``f`` nodes send."""
        raise NotImplementedError


@dataclass(frozen=True)
class Memory:
    """What a node playing an attack that :attr:`~NodeAttack.remembers` kept of the last round
    it computed (a volunteer in its folder, a bench driver in memory)."""

    round: int
    w: torch.Tensor  # the global model it was sent, flat
    row: torch.Tensor  # the update it computed, before :meth:`NodeAttack.forge`
    states: list[torch.Tensor] | None = None  # the trajectory it committed to, where it commits to one
    trigger: torch.Tensor | None = None  # the trigger it stamped, for an attack that optimises one (a3fl)

    @classmethod
    def after(cls, round: int, w: torch.Tensor, row: torch.Tensor, kept: dict, last: Memory | None) -> Memory:
        """What the node keeps after ``round`` (the model ``w`` it was sent, the update ``row`` it
        computed) with the fields its poisoning left in ``kept`` (:class:`Sight`); a trigger it did
        not stamp this round (it was honest) is the one it kept from ``last``."""
        trigger = kept.get("trigger", None if last is None else last.trigger)
        return cls(round, w, row, trigger=trigger)


@dataclass(frozen=True)
class Sight:
    """What a node-side attack that :attr:`~NodeAttack.sees_model` sees of its task as it poisons
    its data (:meth:`NodeAttack.poison`), from the one training function
    (``nodes.engine.training.compute``): the task's ``model`` and ``params`` (the flat global model
    ``w`` it was sent, as the model's trained parameters, on the training device), ``last`` (what
    it kept of its previous round) and ``kept``, where it leaves the fields of this round's
    :class:`Memory` beyond its row (``trigger``)."""

    model: torch.nn.Module
    params: Params
    last: Memory | None
    kept: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Shaping:
    """How a node-side attacker bends its local training: the hook of the one training function
    (``nodes.engine.protocol.Protocol.node_update``); an honest node has none. Both act at every step.

    - ``loss(ce, local, start)``: the loss the node descends instead of its class loss ``ce``,
      from its local parameters and those the round started from (parameter dicts);
    - ``grad(g)``: the flat ``(d,)`` gradient the step applies instead of ``g``;
    - ``fraction``: the share of the protocol's local steps the node takes (the first
      ``floor(fraction * K)``; it then stands still), ``None``: all of them.
    """

    loss: Callable[[torch.Tensor, Params, Params], torch.Tensor] | None = None
    grad: Callable[[torch.Tensor], torch.Tensor] | None = None
    fraction: float | None = None


class NodeAttack(Attack):
    """What a Byzantine node does on its own side: it trains on its (poisoned) data as an
    honest node would, bent by :meth:`shaping` if the attack has one, then sends :meth:`forge`
    of that update. Every driver (a volunteer, the bench's per-node and batched drivers) calls
    these methods and nothing else; in a round where it is not :meth:`active` the node is honest."""

    kind = "node"
    remembers = False  # whether the node needs its previous round (a :class:`Memory`)
    stop_after = 0  # 0: attacks every round; R: honest from round R + 1 on
    estimates = 0  # K > 0: the node also computes K honest rows on its own data for forge's ``own``
    rank_key: ClassVar[str | None] = None  # the parameter colluding nodes set to their rank among the attackers (dba's part)
    sees_model: ClassVar[bool] = False  # its poison reads the task's model (a Sight), its success its Memory

    def active(self, round: int) -> bool:
        """Whether the node attacks in ``round`` (1-based) or behaves honestly (after ``stop_after``)."""
        return not self.stop_after or round <= self.stop_after

    @property
    def trains_alone(self) -> bool:
        """Whether a bench driver must compute this attacker's row with the volunteer's own
        function, one node at a time: its training changes with the round or with its memory
        (a :meth:`shaping` hook, a stop round, poisoning that :attr:`sees_model`), or it computes
        :attr:`estimates`, which the batched kernels do not model."""
        return (bool(self.stop_after) or bool(self.estimates) or self.sees_model
                or type(self).shaping is not NodeAttack.shaping)

    def shaping(self, round: int, w: torch.Tensor, last: Memory | None) -> Shaping | None:
        """How the node bends its local training in ``round`` from the global model ``w``
        (flat) it was sent; ``last``: what it kept of its previous round, for an attack that
        :attr:`remembers`. ``None`` (the default): it trains as an honest node does."""
        return None

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator, sight: Sight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The node's poisoned copy of its training data (unchanged by default); ``sight``: the
        task as the node sees it, given to an attack that :attr:`sees_model` (``None`` otherwise)."""
        return x, y

    def boost(self) -> float:
        """Factor the node applies to its update before sending it."""
        return 1.0

    @property
    def bends_trajectory(self) -> bool:
        """Whether it commits to (:meth:`commit`) or answers a dispute with (:meth:`answer`)
        other states than those it computed: only then does it keep them as it trains (a task's
        states are its width x (steps + 1) model-sized blocks: 6 GB at 100M parameters under 4
        AdamW steps); a node answering a dispute computes them again."""
        return type(self).commit is not NodeAttack.commit or type(self).answer is not NodeAttack.answer

    @property
    def plants_backdoor(self) -> bool:
        """Whether the attack leaves a backdoor whose :meth:`success` can be measured."""
        return type(self).success is not NodeAttack.success

    def success(self, model, w: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                last: Memory | None = None) -> float | None:
        """How much of its backdoor the model with the flat parameters ``w`` (an instance of
        ``model``) carries, on the test set: ``None`` for an attack that plants none. ``last``:
        what an attacker kept of its last round, read by an attack that :attr:`sees_model` (its
        trigger changes)."""
        return None

    def forge(self, row: torch.Tensor, previous: torch.Tensor | None, own: torch.Tensor | None = None
              ) -> torch.Tensor:
        """What the node sends for the update ``row`` it computed this round (``previous``: the
        one it computed last round, if it took part; only read when :attr:`remembers`;
        ``own``: for an attack with :attr:`estimates` ``K``, the ``(K, d)`` honest rows the node
        also computed from the same model and momentum, each on its own draw of batches from
        its data (``nodes.engine.training.estimates``): its view of what honest nodes send; a
        tensor, or a volunteer's ``robust.source.Rows`` on disk)."""
        boost = self.boost()
        return row * boost if boost != 1.0 else row

    def commit(self, states: list[torch.Tensor], last: Memory | None) -> list[torch.Tensor] | None:
        """The trajectory the node commits to (``nodes.engine.trajectory``), from the states
        ``[local_i, v_i]`` it computed (``states[0] = [w, 0]``) and ``last`` (for an attack that
        :attr:`remembers`). ``None`` (the default): what it computed, and it sends
        :meth:`forge`'s row. A list: it claims those states and sends the row its last one gives,
        ``local_K - w``, as an honest node does."""
        return None

    def answer(self, committed: list[torch.Tensor], computed: list[torch.Tensor]) -> list[torch.Tensor]:
        """The states the node answers a dispute with (``nodes.engine.referee``), from those it
        ``committed`` to and those it ``computed``: the committed ones (the default)."""
        return committed
