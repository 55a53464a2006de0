"""The training function of the one protocol: a node's whole computation of a round.

:func:`compute` is a node's whole computation of a round, the one function that real
volunteers, simulated ones and the bench's per-node driver all call: same task, data and
node identity, same bits. A node's batches are a function of ``(run seed, node fingerprint,
round, step)`` (``robust.batches``), its poisoned data (a Byzantine test node) of
``(run seed, fingerprint)``, the random numbers its model draws as it trains (dropout) of
``(run seed, fingerprint, round)``, and it runs under the compute profile the task states.

The coordinator runs it too: a spot check's referee recomputes a volunteer's row
(``nodes.coordinator.verifier``) and the root data's row is computed like a volunteer's
(``nodes.engine.root``). So it is the engine's, not either side's: :class:`NodeData` and
:func:`part_of` say what a node holds, :func:`transmitted` what an honest row decodes to.
"""

from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import attacks
from attacks.base import Memory, NodeAttack, Sight
from robust.batches import draw_batches, node_key
from robust.codecs import Codec
from robust.compute import profile
from robust.data import Dataset
from robust.models import build_model
from robust.params import trained, unflatten
from robust.constraints import Interval, Param, check_all, table
from robust.partition import KINDS, partition
from robust.spec import parse
from robust.source import Rows, Spooled, write_row
from robust.seeds import derive, generator

from ..checkpoint import write_atomic
from . import near_ties, trajectory
from .protocol import Protocol

if TYPE_CHECKING:  # a task's fields are all it reads: the referee's tools run without Flower
    from ..wire import Task


@dataclass
class NodeData:
    """A volunteer's training set (what ``robust node join`` prepares once, in its folder)."""

    dataset: str
    x: torch.Tensor
    y: torch.Tensor
    classes: int
    sha256: str = ""  # the data set's identity where it has one (a text set's content, robust.text)

    def save(self, path: Path) -> None:
        write_atomic(path, lambda out: torch.save({"dataset": self.dataset, "x": self.x, "y": self.y,
                                                   "classes": self.classes, "sha256": self.sha256}, out))

    @classmethod
    def load(cls, path: Path) -> NodeData:
        raw = torch.load(path, weights_only=True)
        return cls(raw["dataset"], raw["x"], raw["y"], int(raw["classes"]), str(raw.get("sha256", "")))


# A part spec: ``I/N`` (part I of N of the iid split of seed 0: what `node join --partition` takes),
# or ``I/N;KIND:alpha=A,seed=S`` (of another split, ``robust.partition``: a bench's nodes declare theirs)
SPLIT = table(
    Param("alpha", Interval(float, 0, None, "neither"), 1.0, "Dirichlet concentration (the dirichlet kinds)"),
    Param("seed", Interval(int, 0, None), 0, "the split's seed"),
)


def parse_part(part: str) -> tuple[int, int]:
    """``(I, N)`` of a part spec (part I of N, 1-based); ``ValueError`` says how to write it."""
    found = re.fullmatch(r"(\d{1,7})/(\d{1,7})", part.partition(";")[0])
    if not found or not 1 <= int(found[1]) <= int(found[2]):
        raise ValueError(f"partition {part[:40]!r}: write I/N with 1 <= I <= N, e.g. 1/5 for the first of five parts")
    return int(found[1]), int(found[2])


def split_of(part: str) -> tuple[str, dict]:
    """``(kind, {alpha, seed})`` of the split a part spec names (``iid`` of seed 0 when it names none)."""
    _, _, spec = part.partition(";")
    if not spec:
        return "iid", check_all("partition", SPLIT, {})
    [split] = parse(spec)
    if split.name not in KINDS or "+" in spec:
        raise ValueError(f"partition {part[:60]!r}: the split after ';' is one of {', '.join(KINDS)}, "
                         "e.g. 1/5;dirichlet:alpha=0.5,seed=2")
    return split.name, check_all(f"partition {split.name}", SPLIT, split.params)


def part_of(data: Dataset, part: str) -> NodeData:
    """Part ``I/N`` of ``data``'s training set (of the split the spec names: iid, seed 0 by
    default): what a volunteer holds."""
    index, total = parse_part(part)
    kind, params = split_of(part)
    if total > len(data.y_train):
        raise ValueError(f"partition {part}: {data.name} has only {len(data.y_train)} training samples")
    rows = partition(data.strata, total, kind, alpha=params["alpha"], seed=params["seed"])[index - 1]
    return NodeData(data.name, data.x_train[rows].clone(), data.y_train[rows].clone(), data.classes, data.sha256)


def part_spec(index: int, total: int, kind: str = "iid", alpha: float = 1.0, seed: int = 0) -> str:
    """The part spec of part ``index`` of ``total`` of that split (the inverse of :func:`part_of`'s parsing)."""
    plain = kind == "iid" and seed == 0
    return f"{index}/{total}" if plain else f"{index}/{total};{kind}:alpha={alpha!r},seed={seed}"


def playing(attack: str, round: int) -> NodeAttack | None:
    """The node-side attack a node plays in ``round``; ``None``: it is honest this round (no
    attack, or one that stopped after an earlier round)."""
    if attack in ("", "none"):
        return None
    played = attacks.build(attack, 1)
    return played if played.active(round) else None


def compute(task: Task, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, classes: int, node: str,
            device: torch.device, attack: str = "", m: torch.Tensor | None = None,
            last: Memory | None = None, on_state=None, kept: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, new worker momentum)``, both CPU float32, of node ``node`` (its fingerprint)
    for ``task`` from the global model ``w``, on its data ``x, y``, with its momentum ``m``
    (zeros if ``None``). A node-side ``attack`` poisons the data first (an attack that
    :attr:`~attacks.base.NodeAttack.sees_model` from a :class:`~attacks.base.Sight` of the task's
    model and ``w``) and may bend the training (its :meth:`~attacks.base.NodeAttack.shaping`, from
    ``last``: what the node remembers of its previous round); what the node then sends is
    :func:`~nodes.volunteer.volunteer.forge`'s. ``kept``: where the poisoning leaves what the
    node keeps of this round beyond its row (``Memory.after``: a3fl's trigger).
    ``on_state``: ``delta``'s per-step hook (``nodes.engine.trajectory.Recorder``).
    ``ValueError`` if ``w`` does not fit the model or the task is malformed."""
    protocol = Protocol.of(task)
    played = playing(attack, task.round)
    # a model that draws random numbers as it trains (dropout) draws them from its own stream
    with profile(task.threads, device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model, params = _model(task, w, x, classes, node, device)
        shaping = None
        if played is not None:
            sight = None if not played.sees_model else Sight(model, params, last,
                                                             {} if kept is None else kept)
            x, y = played.poison(x, y, classes, generator(task.seed, node, "poison"), sight)
            shaping = played.shaping(task.round, w.to(device), last)
        idx = _batches(task, protocol, y, node)
        if m is None:  # a first round's worker momentum; delta has none (no d zeros held for nothing)
            m = torch.zeros_like(w) if protocol.keeps_momentum else torch.zeros(0)
        row, m = protocol.node_update(model, params, x[idx].to(device), y[idx].to(device), m.to(device), shaping,
                                      on_state, in_place=True)
    return row.detach().to("cpu", torch.float32), m.detach().to("cpu", torch.float32)


def _model(task: Task, w: torch.Tensor, x: torch.Tensor, classes: int, node: str, device: torch.device):
    """The task's model on ``device`` and the parameter dict of ``w`` (the caller holds the RNG)."""
    torch.manual_seed(derive(task.seed, node, task.round, "model"))
    model = build_model(task.model, tuple(x.shape[1:]), classes, task.seed).to(device)  # frozen parameters as the coordinator has them
    params = unflatten(w.to(device), model)
    for name, p in trained(model):  # its trained parameters are the task's: their initial values let go
        p.data = params[name]
    return model, params


def _batches(task: Task, protocol: Protocol, y: torch.Tensor, node: str) -> torch.Tensor:
    """The node's ``(steps, batch)`` sample indices for the task's round."""
    return draw_batches([len(y)], protocol.batch_size, [node_key(task.seed, node)], task.round, protocol.steps)[0]


@contextmanager
def _replay(task: Task, w: torch.Tensor, x: torch.Tensor, classes: int, node: str, device: torch.device,
            flips: list[near_ties.Decision], found: list[near_ties.Decision] | None, precise: bool):
    """``(model, params of w, x)`` for a referee's one-step recomputation under the task's profile,
    in float64 if ``precise``, with ``flips`` resolved the other way and ``found`` collecting the
    fragile decisions (``nodes.engine.near_ties``)."""
    dtype = torch.float64 if precise else torch.float32
    with profile(task.threads, device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model, params = _model(task, w.to(dtype), x, classes, node, device)
        if precise:
            model, params = model.to(dtype), {k: t.to(dtype) for k, t in params.items()}
            x = x.to(dtype) if x.is_floating_point() else x
        with ExitStack() as hooks:
            if found is not None:
                hooks.enter_context(near_ties.fragile(model, found))
            if flips:
                hooks.enter_context(near_ties.flipped(model, list(flips)))
            yield model, params, x


def redo_step(task: Task, before: torch.Tensor, x: torch.Tensor, y: torch.Tensor, classes: int, node: str,
              step: int, device: torch.device, flips: list[near_ties.Decision] = (),
              found: list[near_ties.Decision] | None = None, precise: bool = False) -> torch.Tensor:
    """State ``step`` (``nodes.engine.trajectory``) recomputed from the claimed state ``step - 1``
    ``before``, on node ``node``'s batch of that step: a dispute's one-step recomputation.
    Honest training only (a referee recomputes what the task asked). ``flips``: decisions
    resolved the other way; ``found`` collects the step's fragile ones (``nodes.engine.near_ties``).
    ``precise``: in float64 (the step's value to float64 rounding), returned as float64."""
    protocol = Protocol.of(task)
    d = before.numel() // protocol.width
    with _replay(task, before[:d], x, classes, node, device, flips, found, precise) as (model, local, x):
        dtype = next(iter(local.values())).dtype
        sizes = [p.numel() for p in local.values()]
        state = tuple({k: t.view_as(p) for (k, p), t in zip(local.items(), torch.split(block, sizes))}
                      for block in before[d:].to(device, dtype).split(d))
        batch = _batches(task, protocol, y, node)[step - 1]
        local, state = protocol.local_step(protocol.gradient(model, local, eager=True), local, state, x[batch].to(device),
                                           y[batch].to(device), t=step)
        return trajectory.state(local, state, dtype)


def redo_momentum(task: Task, w: torch.Tensor, before: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                  classes: int, node: str, device: torch.device, flips: list[near_ties.Decision] = (),
                  found: list[near_ties.Decision] | None = None, precise: bool = False) -> torch.Tensor:
    """A ``momentum`` task's honest row from the model ``w`` it carried and the momentum ``before``
    it named (``nodes.engine.states``): one step, ``beta before + g``, on the CPU; otherwise as
    :func:`redo_step` (``precise``: float64)."""
    protocol = Protocol.of(task)
    with _replay(task, w, x, classes, node, device, flips, found, precise) as (model, params, x):
        dtype = next(iter(params.values())).dtype
        batch = _batches(task, protocol, y, node)[0]
        return protocol.momentum_step(model, params, x[batch].to(device), y[batch].to(device),
                                      before.to(device, dtype)).detach().cpu()


def estimates(task: Task, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, classes: int, node: str,
              device: torch.device, m: torch.Tensor | None, k: int, folder: Path | None = None
              ) -> torch.Tensor | Rows:
    """The ``(k, d)`` honest rows node ``node`` also computes for an attack with
    :attr:`~attacks.base.NodeAttack.estimates` (its view of what honest nodes send): :func:`compute`
    from the same model ``w`` and momentum ``m`` on the same data, each under the identity
    ``node/estimate/j``, hence its own draw of batches (and of a dropout stream). With a
    ``folder``, each row is written there as it is computed and they come back as a source
    read from disk (``robust.source.Spooled``): a volunteer holds one of them at a time, not
    ``k`` (1.2 GB at 100M parameters for ``alie-local``'s 3)."""
    def estimate(j: int) -> torch.Tensor:
        return compute(task, w, x, y, classes, f"{node}/estimate/{j + 1}", device, "", m)[0]

    if folder is None:
        out = torch.empty(k, w.numel())
        for j in range(k):
            out[j] = estimate(j)
        return out
    paths = [folder / f"estimate-{j + 1}.npy" for j in range(k)]
    for j, path in enumerate(paths):  # each row let go once written (a zip over a generator of
        write_row(path, estimate(j))  # rows held the last one while it computed the next)
    return Spooled(paths)


def transmitted(codec: Codec, row: torch.Tensor, key: tuple) -> torch.Tensor:
    """The row the coordinator decodes from an honest node's ``row`` (no residual): what a spot
    check's recomputation is compared as."""
    return row if codec.name == "none" else codec.decode(codec.encode(row, key), row.numel())
