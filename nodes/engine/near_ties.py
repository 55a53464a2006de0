"""Near-ties: the discrete decisions inside one step that hardware may resolve either way.

A ReLU passes a gradient where its input ``z`` is positive. When ``z`` is within rounding of
zero, two honest machines computing the same step from the same state can disagree on its sign
(their sums run in another order), and the unit's gradient is then on for one and off for the
other: a whole sample's contribution through that unit, not a rounding error. Measured with
``python -m evaluation.disputes`` (digits CNN, ``delta:steps=16``): one step from one state on
``cpu:isa=default`` and ``cpu:isa=avx512`` differed by a relative 2e-5 to 3e-2 about once in
100 disputes, each time with a conv unit at ``|z| < 1e-6`` of its layer's scale, or a max-pool
window whose two largest were 7e-8 apart; everywhere else the gap was rounding (below 1.2e-6).

So a referee does not convict a step that a resolution of near-ties explains: it finds the
*fragile* units of the step (:func:`fragile`: ``0 < |z| <= RELATIVE * max |z|`` of their layer,
on the step's batch; an exact zero comes of zero inputs, which every machine sums alike), and recomputes with subsets of them flipped (:func:`flipped`: on where the
referee had off and off where it had on). Each such computation is one an honest machine could
make, so accepting it gives a cheat nothing it could not get honestly; a cheat's error (a scaled
step, other data, skipped steps) is not a handful of flipped units and stays.

The same holds for a max-pool window whose two largest inputs are within rounding: which one
passes the gradient is a coin hardware tosses. Covered: ``torch.nn.ReLU`` modules and
``MaxPool1d``/``MaxPool2d`` modules whose windows tile their input (the built-in CNN's);
a user's model with other comparisons (a functional ``relu``, ``argmax`` routing) is refereed
on rounding alone. Smooth activations (GELU, tanh) have no such decisions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import combinations

import torch
from torch import nn

RELATIVE = 1e-5  # |z| (a ReLU) or the top-two gap (a max-pool) below this share of the layer's largest |z|
MAX_SET, MAX_TRIES = 3, 200  # decisions flipped at once, sets tried per step (a cheat costs the referee at most this)


def _decisions(model: nn.Module) -> list[nn.Module]:
    """The modules whose output depends on a comparison: ReLUs, and max-pools whose windows
    tile their input (kernel = stride, no padding or dilation, as the built-in CNN's)."""
    return [m for m in model.modules() if isinstance(m, nn.ReLU) or _tiles(m)]


def _tiles(m: nn.Module) -> bool:
    if not isinstance(m, (nn.MaxPool1d, nn.MaxPool2d)):
        return False
    dims = 1 if isinstance(m, nn.MaxPool1d) else 2
    as_tuple = (lambda v: (v,) * dims if isinstance(v, int) else tuple(v))
    return (as_tuple(m.kernel_size) == as_tuple(m.stride or m.kernel_size) and not any(as_tuple(m.padding))
            and all(d == 1 for d in as_tuple(m.dilation)) and not m.ceil_mode)


def _windows(m: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``z``'s pooling windows, ``(*output shape, window size)``."""
    if isinstance(m, nn.MaxPool1d):
        k = m.kernel_size if isinstance(m.kernel_size, int) else m.kernel_size[0]
        length = z.shape[-1] // k * k
        return z[..., :length].reshape(*z.shape[:-1], length // k, k)
    kh, kw = (m.kernel_size, m.kernel_size) if isinstance(m.kernel_size, int) else m.kernel_size
    h, w = z.shape[-2] // kh, z.shape[-1] // kw
    cut = z[..., : h * kh, : w * kw].reshape(*z.shape[:-2], h, kh, w, kw)
    return cut.movedim(-3, -2).reshape(*z.shape[:-2], h, w, kh * kw)


def _fragile(m: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(where m's decision on z is within rounding, the value each decision is made on)``: a
    ReLU input near (not at) zero, its value; a max-pool window whose two largest are near (not
    equal: exact ties every machine breaks alike, by its first maximum), their sum."""
    scale = RELATIVE * z.abs().max()
    if isinstance(m, nn.ReLU):
        return (z != 0) & (z.abs() <= scale), z
    top = _windows(m, z).topk(2, dim=-1).values
    gap = top[..., 0] - top[..., 1]
    return (gap > 0) & (gap <= scale), top.sum(-1)


@contextmanager
def _hooked(hooks: list[tuple[nn.Module, object]]) -> Iterator[None]:
    """Within the block, each ``(module, forward hook)`` is registered."""
    handles = [m.register_forward_hook(hook) for m, hook in hooks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


Decision = tuple[int, tuple[int, ...]]  # (decision module index, flat positions decided alike)


@contextmanager
def fragile(model: nn.Module, found: list[Decision]) -> Iterator[None]:
    """Within the block, each forward pass of ``model`` appends to ``found`` the fragile
    decisions it meets, each as ``(decision module index, flat positions)`` (a ReLU's input
    elements, a max-pool's output elements). A sample drawn twice into a batch is computed
    alike by any one machine, so its copies' positions form one decision."""

    def hook_for(k: int):
        def hook(module, inputs, output):
            z = inputs[0].detach()
            near, value = _fragile(module, z)
            near, value = near.reshape(len(z), -1), value.reshape(len(z), -1)
            alike: dict[tuple, list[int]] = {}
            for b, j in torch.nonzero(near).tolist():
                alike.setdefault((j, float(value[b, j])), []).append(b * near.shape[1] + j)
            found.extend((k, tuple(ps)) for ps in alike.values())
        return hook

    with _hooked([(m, hook_for(k)) for k, m in enumerate(_decisions(model))]):
        yield


@contextmanager
def flipped(model: nn.Module, flips: list[Decision]) -> Iterator[None]:
    """Within the block, the decisions ``flips`` of ``model`` go the other way: a ReLU passes
    ``z`` where ``z > 0`` says it would not (and not where it would), a max-pool window takes
    its second largest. Every other decision is the module's own."""
    by_module: dict[int, list[int]] = {}
    for k, positions in flips:
        by_module.setdefault(k, []).extend(positions)

    def hook_for(positions: list[int]):
        def hook(module, inputs, output):
            z = inputs[0]
            flip = torch.zeros(output.numel() if not isinstance(module, nn.ReLU) else z.numel(), dtype=torch.bool,
                               device=z.device)
            flip[positions] = True
            if isinstance(module, nn.ReLU):
                return z * ((z > 0) ^ flip.view_as(z)).to(z.dtype)
            windows = _windows(module, z)
            second = windows.gather(-1, windows.topk(2, dim=-1).indices[..., 1:]).squeeze(-1)
            return torch.where(flip.view_as(output), second, output)
        return hook

    decisions = _decisions(model)
    with _hooked([(decisions[k], hook_for(ps)) for k, ps in by_module.items()]):
        yield


def subsets(decisions: list[Decision]) -> Iterator[list[Decision]]:
    """Sets of ``decisions`` to resolve otherwise, smallest first: every one, pair and triple,
    at most :data:`MAX_TRIES` in all (flips are rare: the measurement never needed two)."""
    tries = 0
    for size in range(1, min(MAX_SET, len(decisions)) + 1):
        for chosen in combinations(decisions, size):
            tries += 1
            if tries > MAX_TRIES:
                return
            yield list(chosen)
