"""The models a scenario can name, built deterministically from a seed.

``logreg`` (linear), ``mlp`` (one hidden layer of 64), ``wide-mlp`` (two of 1024), ``cnn`` (two conv blocks; a 1-D CNN when a
sample is a sequence ``(C, L)``, e.g. mnist1d). Parameters are initialised under a private
RNG seeded by ``seed``, so the global torch RNG is neither read nor changed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODELS = ("logreg", "mlp", "wide-mlp", "cnn")


def build_model(name: str, shape: tuple[int, ...], classes: int, seed: int = 0) -> nn.Module:
    """A fresh model for samples of ``shape`` and ``classes`` labels."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
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


def _cnn(shape: tuple[int, ...], classes: int) -> nn.Module:
    if len(shape) == 2:  # (channels, length): a 1-D CNN
        c = shape[0]
        return nn.Sequential(
            nn.Conv1d(c, 16, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(16, 32, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(4),
            nn.Flatten(), nn.Linear(32 * 4, classes),
        )
    if len(shape) == 3:  # (channels, height, width)
        c = shape[0]
        return nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4, classes),
        )
    raise ValueError(f"cnn needs samples shaped (C, L) or (C, H, W) (got {shape}): use mlp or logreg")


def accuracy(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of ``x`` that ``model`` with ``params`` (e.g. ``unflatten(w, model)``) labels as ``y``."""
    from torch.func import functional_call

    with torch.no_grad():
        return float((functional_call(model, params, (x,)).argmax(dim=1) == y).float().mean())
