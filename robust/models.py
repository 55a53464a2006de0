"""The models a scenario can name, built deterministically from a seed.

``logreg`` (linear), ``mlp`` (one hidden layer of 64), ``wide-mlp`` (two of 1024), ``cnn`` (two conv blocks; a 1-D CNN when a
sample is a sequence ``(C, L)``, e.g. mnist1d), a byte-level transformer for the text sets
(``gpt:layers=L,width=W,heads=H,context=C`` and its presets ``gpt-tiny``, ``gpt-small``,
``gpt-100m``: ``robust.gpt``), or a user's factory ``package.module:make``,
called as ``make(shape, classes)`` (``robust.user_code``). Parameters are initialised under a
private RNG seeded by ``seed``, so the global torch RNG is neither read nor changed.

What a node trains and sends is every floating-point parameter that requires a gradient
(``robust.params``), cast to float32. Everything else comes from the factory and is the same
on every machine: frozen or integer parameters are never changed, and BatchNorm layers are
built without running statistics (they normalise with the statistics of the batch they see,
in training and evaluation alike), so no per-node state escapes robust aggregation.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.func import replace_all_batch_norm_modules_

from . import gpt
from .user_code import is_reference, resolve
from .params import trained

MODELS = ("logreg", "mlp", "wide-mlp", "cnn", *gpt.PRESETS)  # and gpt:... specs


def build_model(name: str, shape: tuple[int, ...], classes: int, seed: int = 0) -> nn.Module:
    """A fresh model for samples of ``shape`` and ``classes`` labels."""
    if is_reference(name):
        return _user_model(name, shape, classes, seed)
    if gpt.is_gpt(name):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return gpt.build(name, shape, classes)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}, or name your factory package.module:make")
    features = math.prod(shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "logreg":
            return nn.Sequential(nn.Flatten(), nn.Linear(features, classes))
        if name == "mlp":
            return nn.Sequential(
                nn.Flatten(), nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes)
            )
        if name == "wide-mlp":  # two hidden layers of 1024: 1.1M parameters on digits
            return nn.Sequential(
                nn.Flatten(), nn.Linear(features, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                nn.Linear(1024, classes),
            )
        return _cnn(shape, classes)


def training_defaults(name: str) -> dict[str, object]:
    """The run settings (by key) model ``name`` trains with where the run leaves them unset:
    a language model's local AdamW (``robust.gpt.TRAINING``; plain SGD diverges on it at the
    image models' learning rates); nothing for the others, which take the declared defaults."""
    return dict(gpt.TRAINING) if not is_reference(name) and gpt.is_gpt(name) else {}


@contextlib.contextmanager
def recomputing(model: nn.Module) -> Iterator[None]:
    """Within it, a model that can recompute its activations in the backward pass (a ``gpt``:
    its ``recompute``) does: memory for the activations of one block instead of all; the same
    bits. Other models are left as they are."""
    if not hasattr(model, "recompute"):
        yield
        return
    before, model.recompute = model.recompute, True
    try:
        yield
    finally:
        model.recompute = before


FACTORY = "factory(shape, classes) -> torch.nn.Module"


def _user_model(name: str, shape: tuple[int, ...], classes: int, seed: int) -> nn.Module:
    """The user's factory's model, checked: a module with float parameters to train whose
    output on a batch of two samples is ``(2, classes)`` logits."""
    factory = resolve(name, "model", FACTORY)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = factory(tuple(shape), classes)
        except Exception as err:  # the user's code: any failure is theirs to fix, said in one line
            raise ValueError(f"model {name!r} failed when called as {FACTORY.split(' ->')[0]} with shape={tuple(shape)}, "
                             f"classes={classes}: {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r} returned a {type(model).__name__}; expected a torch.nn.Module")
    model = replace_all_batch_norm_modules_(model.float())
    if not any(p.requires_grad and p.is_floating_point() for p in model.parameters()):
        raise ValueError(f"model {name!r} has no floating-point parameter that requires a gradient: nothing to train")
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros(2, *shape))
    except Exception as err:
        raise ValueError(f"model {name!r} cannot take a batch of samples shaped {tuple(shape)}: "
                         f"{type(err).__name__}: {err}") from None
    finally:
        model.train()
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model {name!r} maps a batch of 2 samples to {got}; expected logits shaped (2, {classes})")
    return model


def _windows(n_in: int, n_out: int) -> torch.Tensor:
    """``(n_out, n_in)``: row ``i`` averages adaptive pooling's window ``i`` of ``n_in`` values."""
    rows = torch.zeros(n_out, n_in)
    for i in range(n_out):
        start, end = (i * n_in) // n_out, -(-(i + 1) * n_in // n_out)
        rows[i, start:end] = 1.0 / (end - start)
    return rows


class AveragePool(nn.Module):
    """Adaptive average pooling of a fixed input size (``nn.AdaptiveAvgPool1d/2d``'s windows)
    as products with fixed averaging matrices: its backward is deterministic on CUDA, where
    PyTorch's adaptive pooling backward adds atomically and is refused under the deterministic
    algorithms a task's compute profile sets (``robust.compute``). The matrices are not
    parameters: they travel in no update."""

    def __init__(self, size_in: tuple[int, ...], size_out: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("rows", _windows(size_in[0], size_out[0]), persistent=False)
        self.register_buffer("cols", _windows(size_in[-1], size_out[-1]) if len(size_in) == 2 else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cols is None:  # (batch, channels, length)
            return x @ self.rows.T
        return self.rows @ x @ self.cols.T  # (batch, channels, height, width)


def _cnn(shape: tuple[int, ...], classes: int) -> nn.Module:
    if len(shape) == 2:  # (channels, length): a 1-D CNN
        c, length = shape
        return nn.Sequential(
            nn.Conv1d(c, 16, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(16, 32, 5, padding=2), nn.ReLU(), AveragePool((length // 2,), (4,)),
            nn.Flatten(), nn.Linear(32 * 4, classes),
        )
    if len(shape) == 3:  # (channels, height, width)
        c, height, width = shape
        return nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), AveragePool((height // 2, width // 2), (2, 2)),
            nn.Flatten(), nn.Linear(32 * 4, classes),
        )
    raise ValueError(f"cnn needs samples shaped (C, L) or (C, H, W) (got {shape}): use mlp or logreg")


class Scorer:
    """The share of samples ``x`` a model with the flat trained parameters ``w`` labels as
    ``y``, called every round: an eval-mode copy of ``model`` (dropout off; buffers and frozen
    parameters as they are now; BatchNorm has no running statistics to switch to, see above)
    whose trained parameters are views of the vector it is handed, then one forward pass. The
    same arithmetic as ``functional_call(model, unflatten(w, model), x)``, half its time at
    digits' size (no ``functional_call`` and no mode switches per call); the copy holds no
    trained values of its own (a 100M-parameter model is not held twice)."""

    def __init__(self, model: nn.Module) -> None:
        params = [p for _, p in trained(model)]
        # the trained parameters are copied as empty placeholders: each call points them at its vector
        memo = {id(p): nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device)) for p in params}
        self.model = copy.deepcopy(model, memo).eval()
        self.params = [memo[id(p)] for p in params]
        self.shapes = [p.shape for p in params]
        self.size = sum(p.numel() for p in params)

    def __call__(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.evaluate(w, x, y)[0]

    def evaluate(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """``(accuracy, mean cross-entropy)`` on ``(x, y)`` (a text model's: next-token accuracy
        and the held-out loss): one forward pass, or, for a big model, one per
        :func:`eval_rows` samples (their activations held at once: at 100M parameters and 256
        windows of 128 bytes, about 1 GB in one pass), each sample's results then averaged."""
        if w.shape != (self.size,):
            raise ValueError(f"a vector of shape {tuple(w.shape)} for a model of {self.size} trained values")
        with torch.no_grad():
            start = 0
            for p, shape in zip(self.params, self.shapes):
                p.data = w[start : start + shape.numel()].view(shape)
                start += shape.numel()
            rows = eval_rows(self.size)
            if len(x) <= rows:
                logits = self.model(x)
                return (float((logits.argmax(dim=1) == y).float().mean()),
                        float(torch.nn.functional.cross_entropy(logits, y.long())))
            hits, losses = [], []
            for xs, ys in zip(x.split(rows), y.split(rows)):
                logits = self.model(xs)
                hits.append(logits.argmax(dim=1) == ys)
                losses.append(torch.nn.functional.cross_entropy(logits, ys.long(), reduction="none"))
            return float(torch.cat(hits).float().mean()), float(torch.cat(losses).mean())


EVAL_VALUES = 2**31  # samples x trained values a forward pass of the evaluation takes at once


def eval_rows(d: int) -> int:
    """Samples evaluated in one forward pass of a model of ``d`` trained values: all of them
    below about 2e9 / d (the built-in models on their data sets, in one pass), fewer for big
    models (21 at 100M parameters), whose activations grow with their width."""
    return max(1, EVAL_VALUES // d)
