"""A 100M-parameter model for the built-in ``digits`` data set: robust calls ``make(shape, classes)``.

An MLP with two hidden layers of 10,000 units: 100,760,010 trainable parameters on digits
(samples ``(1, 8, 8)``, 10 classes), a 403 MB float32 update per node and round. It takes a
real model's size through a deployment: ``python -m evaluation.large_model --model
hugenet:make --volunteers 4 --attack alie --no-bench``.
"""

import math

from torch import nn

HIDDEN = 10_000


def make(shape, classes):
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(shape), HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, classes),
    )
