"""The training protocol: what a node's row is, and how the server applies the aggregate.

One object, used by volunteers, by the coordinator and by every bench driver, so a bench
result describes a protocol that can be deployed. Its spec uses the project's grammar:

- ``momentum`` (D-SGD with worker momentum; Karimireddy, He and Jaggi, ICML 2021, "Learning
  from history for Byzantine robust optimization"): each round a node takes the gradient
  ``g`` of its loss on one batch at the global model ``w`` and sends its worker momentum
  ``m <- beta m + g``, which it keeps between rounds; the server steps
  ``w <- w - lr F(m_1..m_n)``.
- ``delta:steps=K,server_lr=1,server_momentum=0,nesterov=false`` (FedAvg, McMahan et al.
  2017, with DiLoCo's outer optimiser, Douillard et al. 2023): a node runs ``K`` SGD steps
  (learning rate ``lr``, momentum ``beta`` started afresh each round) from ``w`` on ``K``
  batches and sends ``w_K - w``; the server takes ``-F`` as a pseudo-gradient for SGD with
  momentum ``mu = server_momentum`` (PyTorch's convention): ``b <- mu b - F``,
  ``w <- w - server_lr (-F + mu b)`` with Nesterov, else ``w <- w - server_lr b``. With
  ``mu = 0`` that is ``w <- w + server_lr F``.
- ``delta:...,inner=adamw`` (what language models train with; DiLoCo's inner optimiser): the
  local steps are AdamW's (Loshchilov and Hutter, ICLR 2019): ``m <- b1 m + (1 - b1) g``,
  ``v <- b2 v + (1 - b2) g^2``, ``local <- local (1 - lr decay) - lr m_hat / (sqrt(v_hat) + eps)``
  with the bias corrections ``m_hat = m / (1 - b1^t)``, ``v_hat = v / (1 - b2^t)`` at step ``t``;
  ``b1`` is the run's ``momentum``, ``b2 = beta2``, ``eps = 1e-8``, ``decay = weight_decay``.
  Its state (``m``, ``v``) starts at zero with every task, as SGD's momentum does, so an update
  stays a function of its task (checkable by recomputation).
- ``clip = C`` (``delta``, either inner optimiser): each step's gradient is scaled to an L2
  norm of at most ``C`` (over all parameters; 0: not clipped).

The number of local steps is the protocol's, never a function of a node's data size: a node
with fewer samples than a batch samples with replacement (``robust.batches``).

:meth:`Protocol.node_update` is the one local-training function. A node-side attack that
must bend training (``neurotoxin``, ``constrain-scale``) passes a hook
(:class:`attacks.base.Shaping`: a loss in place of the class loss, a transform of each
step's gradient); without one the computation is the honest one, operation for operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from attacks.base import Shaping
from robust.models import recomputing
from robust.constraints import Flag, Interval, OneOf, Param, Relation, check_all, table
from robust.spec import parse

KINDS = ("delta", "momentum")
INNER = ("sgd", "adamw")
EPS = 1e-8  # AdamW's
PIECE = 1 << 20  # elements an in-place update works on at once (4 MB of float32)
PARAMS = {  # each kind's spec parameters
    "delta": table(
        Param("steps", Interval(int, 1, 100_000), 10, "local SGD steps per round"),
        Param("server_lr", Interval(float, 0, None, "neither"), 1.0, "the server's step on the aggregate"),
        Param("server_momentum", Interval(float, 0, 1, "left"), 0.0, "the server's outer momentum"),
        Param("nesterov", Flag(), False, "Nesterov outer momentum"),
        Param("inner", OneOf(INNER), "sgd", "the local optimiser: SGD with momentum, or AdamW"),
        Param("clip", Interval(float, 0, None), 0.0, "each local step's gradient clipped to this L2 norm (0: none)"),
        Param("beta2", Interval(float, 0, 1, "left"), 0.999, "AdamW's second-moment decay"),
        Param("weight_decay", Interval(float, 0, None), 0.01, "AdamW's decoupled weight decay"),
    ),
    "momentum": {},
}
RELATIONS = (Relation("nesterov", "false while server_momentum is 0", "server_momentum",
                      lambda v: not v["nesterov"] or v["server_momentum"] > 0),)

Params = dict[str, torch.Tensor]


def loss_fn(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model`` with parameters ``params`` on ``(x, y)``."""
    return F.cross_entropy(functional_call(model, params, (x,)), y.long())  # a text set's targets are bytes


def _autograd(model: nn.Module, loss):
    """``g(p, x, y)`` of ``loss(p, x, y)`` by ``torch.autograd.grad``, the model recomputing its
    activations where it can. The leaves are the model's own parameters, lent ``p``'s storage
    (no copy) for the call: a block recomputed in the backward pass must find them in the
    model, where ``torch.func.functional_call`` would have put its originals back."""

    def g(p: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
        own = dict(model.named_parameters())
        kept = {k: own[k].data for k in p}
        try:
            for k, v in p.items():
                own[k].data = v.detach()
            leaves = {k: own[k] for k in p}
            with torch.enable_grad(), recomputing(model):
                grads = torch.autograd.grad(loss(leaves, x, y), list(leaves.values()))
        finally:
            for k, data in kept.items():
                own[k].data = data
        return dict(zip(leaves, grads))

    return g


def _pieces(*tensors: torch.Tensor):
    """Aligned 1-D pieces of ``PIECE`` elements of same-shaped tensors, views of them (the first
    ones, written in place, are contiguous): an in-place update's temporaries stay that small
    however large a tensor is (a 100M model's 10,000 x 10,000 layer, 400 MB). Elementwise
    operations give the same bits piece by piece as whole."""
    flat = [t.reshape(-1) for t in tensors]
    for start in range(0, flat[0].numel(), PIECE):
        yield tuple(f[start:start + PIECE] for f in flat)


def _flat(params: Params) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params.values()])


def _like(flat: torch.Tensor, params: Params) -> Params:
    """``flat`` cut into tensors shaped as ``params`` (the inverse of :func:`_flat`)."""
    pieces = torch.split(flat, [p.numel() for p in params.values()])
    return {k: piece.view_as(p) for (k, p), piece in zip(params.items(), pieces)}


@dataclass(frozen=True)
class Protocol:
    kind: str
    lr: float
    momentum: float  # beta: the worker momentum (momentum), the local SGD momentum (delta)
    batch_size: int
    steps: int = 1
    server_lr: float = 1.0
    server_momentum: float = 0.0
    nesterov: bool = False
    inner: str = "sgd"
    clip: float = 0.0
    beta2: float = 0.999
    weight_decay: float = 0.01

    @classmethod
    def parse(cls, spec: str, *, lr: float, momentum: float, batch_size: int) -> Protocol:
        """The protocol of ``spec`` (``momentum``, ``delta:steps=20``...); ``ValueError`` says
        what to fix."""
        parts = parse(spec)
        if len(parts) != 1 or parts[0].name not in KINDS:
            raise ValueError(f"protocol {spec!r}: write momentum, or delta with its options, e.g. delta:steps=10")
        kind = parts[0].name
        values = check_all(kind, PARAMS[kind], parts[0].params, RELATIONS if kind == "delta" else ())
        return cls(kind, float(lr), float(momentum), int(batch_size), **values)

    @classmethod
    def of(cls, config) -> Protocol:
        """The protocol a run's settings or a task state (their ``protocol``, ``lr``,
        ``momentum`` and ``batch_size``)."""
        return cls.parse(config.protocol, lr=config.lr, momentum=config.momentum, batch_size=config.batch_size)

    @property
    def keeps_momentum(self) -> bool:
        """Whether a node carries state (its worker momentum) from one round to the next."""
        return self.kind == "momentum"

    def gradient(self, model: nn.Module, params: Params, shaping: Shaping | None = None, eager: bool = False):
        """``g(p, x, y)``: the parameter dict of the (possibly shaped) loss's gradient at ``p``.
        ``eager``: through autograd rather than ``torch.func`` (one node's update, never under
        ``vmap``), so a model that can recompute its activations does (``robust.models.recomputing``);
        the same bits either way (``tests/test_training.py``)."""
        if shaping is None or shaping.loss is None:
            loss = lambda p, x, y: loss_fn(model, p, x, y)  # noqa: E731
        else:
            loss = lambda p, x, y: shaping.loss(loss_fn(model, p, x, y), p, params)  # noqa: E731
        return _autograd(model, loss) if eager else grad(loss)

    @property
    def width(self) -> int:
        """How many ``d``-long blocks a node's local state holds (``nodes.engine.trajectory``): the
        parameters and SGD's momentum, or the parameters and AdamW's two moments."""
        return 3 if self.inner == "adamw" else 2

    def memory(self, d: int) -> dict[str, int]:
        """Bytes a volunteer holds at once for a task on a ``d``-parameter float32 model, by
        part: the model as received, the local training (the parameters and the optimiser's
        state: :attr:`width` blocks, trained in place), a gradient. The reply's row is written
        once the training's state is let go; what the model's activations take (its batch, its
        architecture) is not in it. A trainer's measured peak (``tests/test_memory_need.py``)."""
        block = 4 * d
        return {"model": block, "training": self.width * block, "gradient": block}

    def zero_state(self, params: Params) -> tuple[Params, ...]:
        """The local optimiser's state at the start of a task: zeros (``width - 1`` of them)."""
        return tuple({k: torch.zeros_like(p) for k, p in params.items()} for _ in range(self.width - 1))

    def local_step(self, g_of, local: Params, state: tuple[Params, ...], x: torch.Tensor, y: torch.Tensor,
                   bend=None, t: int = 1, in_place: bool = False) -> tuple[Params, tuple[Params, ...]]:
        """Local step ``t`` (1-based) of ``delta`` on the batch ``(x, y)``, from the optimiser
        ``state``: SGD (``v <- beta v + g``, ``local <- local - lr v``) or AdamW (see the
        module); the new ``(local, state)``. ``bend``: an attacker's gradient hook.

        Two kernels, the same operations in the same order, hence the same bits (tested):
        functional (new tensors: what ``vmap`` needs, the batched driver's), and ``in_place``
        (``local`` and ``state`` overwritten, the gradient scaled where it lies: a volunteer's,
        which so holds each of them once, never an old and a new copy at the same time)."""
        g = g_of(local, x, y)
        if bend is not None:  # before the optimiser: every step's update stays bent
            g = _like(bend(_flat(g)), g)
        if self.clip:
            norm = torch.sqrt(sum((p * p).sum() for p in g.values()))
            scale = (self.clip / (norm + 1e-6)).clamp(max=1.0)
            g = {k: p.mul_(scale) if in_place and p.is_contiguous() else p * scale for k, p in g.items()}
        if self.inner == "sgd":
            (v,) = state
            if in_place:
                for k in v:
                    for vk, lk, gk in _pieces(v[k], local[k], g[k]):
                        vk.mul_(self.momentum).add_(gk)
                        lk.sub_(self.lr * vk)
                return local, (v,)
            v = {k: self.momentum * v[k] + g[k] for k in v}
            return {k: local[k] - self.lr * v[k] for k in local}, (v,)
        m, v = state
        b1, b2 = self.momentum, self.beta2
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        if in_place:
            for k in local:
                for mk, vk, lk, gk in _pieces(m[k], v[k], local[k], g[k]):
                    mk.mul_(b1).add_((1 - b1) * gk)
                    vk.mul_(b2).add_((1 - b2) * gk * gk)
                    lk.mul_(1 - self.lr * self.weight_decay).sub_(self.lr * (mk / c1) / ((vk / c2).sqrt() + EPS))
            return local, (m, v)
        m = {k: b1 * m[k] + (1 - b1) * g[k] for k in m}
        v = {k: b2 * v[k] + (1 - b2) * g[k] * g[k] for k in v}
        return {k: local[k] * (1 - self.lr * self.weight_decay)
                - self.lr * (m[k] / c1) / ((v[k] / c2).sqrt() + EPS) for k in local}, (m, v)

    def momentum_step(self, model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor
                      ) -> torch.Tensor:
        """An honest ``momentum`` row, ``beta m + g`` on the batch ``(x, y)`` at ``params``: a check's
        recomputation from the momentum its task named (``nodes.engine.states``); the same
        arithmetic as :meth:`node_update`'s."""
        return self.momentum * m + _flat(self.gradient(model, params, eager=True)(params, x, y))

    def node_update(self, model: nn.Module, params: Params, xs: torch.Tensor, ys: torch.Tensor,
                    m: torch.Tensor, shaping: Shaping | None = None, on_state=None, in_place: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row, the node's new momentum)`` from the global parameters (``unflatten(w)``),
        one batch ``xs[s], ys[s]`` per local step, and the node's momentum ``m`` (``(d,)``;
        zeros in its first round; unused by ``delta``). Written with ``torch.func`` so the
        harness can ``vmap`` it; gradients stay a parameter dict until the row is flattened.
        ``shaping``: a node-side attacker's hook (its loss, its per-step gradient transform).
        ``on_state(s, local, state)``: called with ``delta``'s state (the optimiser's, a tuple)
        before the first step (``s = 0``) and after each step ``s`` (``nodes.engine.trajectory``:
        the trajectory a node commits to). ``in_place``: :meth:`local_step`'s in-place kernel (one
        node's update, not under ``vmap``; ``params`` are left as they are)."""
        g_of = self.gradient(model, params, shaping, eager=in_place)
        bend = None if shaping is None else shaping.grad
        taken = self.steps if shaping is None or shaping.fraction is None else int(self.steps * shaping.fraction)
        if self.kind == "momentum":
            g = _flat(g_of(params, xs[0], ys[0])) if taken else torch.zeros_like(m)
            m = self.momentum * m + (g if bend is None else bend(g))
            return m, m
        state = self.zero_state(params)
        local = params
        if on_state is not None:
            on_state(0, local, state)
        if in_place and taken:
            local = {k: p.clone() for k, p in params.items()}
        for s in range(self.steps):
            if s < taken:  # a node that skips steps (``fewer-steps``) stands still for the rest
                local, state = self.local_step(g_of, local, state, xs[s], ys[s], bend, s + 1, in_place)
            if on_state is not None:
                on_state(s + 1, local, state)
        if not in_place:
            return _flat(local) - _flat(params), m
        first = next(iter(params.values()))
        row, start = torch.empty(sum(p.numel() for p in params.values()), dtype=first.dtype, device=first.device), 0
        for k, p in local.items():  # local - params, written into the row: no flat copy of either
            torch.sub(p.reshape(-1), params[k].reshape(-1), out=row[start:start + p.numel()])
            start += p.numel()
        return row, m

    def apply(self, w: torch.Tensor, aggregate: torch.Tensor, buffer: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The server's step: ``(new w, new outer-momentum buffer)``; ``buffer`` is ``None``
        until the first step (and always without outer momentum)."""
        if self.kind == "momentum":
            return w - self.lr * aggregate, None
        if not self.server_momentum:
            return w + self.server_lr * aggregate, None
        pseudo = -aggregate
        buffer = pseudo.clone() if buffer is None else buffer * self.server_momentum + pseudo
        step = pseudo + self.server_momentum * buffer if self.nesterov else buffer
        return w - self.server_lr * step, buffer
