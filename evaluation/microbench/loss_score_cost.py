"""The loss score's cost per round (issue 46): ``nodes.engine.loss_ratings.effects`` on a round
of ``n`` rows, beside what the same round's rule and detectors cost (``nodes.engine.engine.assess``,
``nnm+trimmed-mean`` with every detector), for the models a scenario names.

    python -m evaluation.microbench.loss_score_cost [--nodes 25] [--root 100] [--repeats 3]

Each repeat is a turn: one call of each, each on rows drawn afresh (nothing one call computed is
reused by the next); the median is reported. Per model: its parameters ``d``, the loss score's
seconds for the round and per row, the rule and detectors' seconds, and their ratio. The loss
score's cost is ``n`` forward passes over the ``root`` samples, so it grows with the model and the
root set, where the rule's grows with ``n^2 d``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import aggregators
from nodes.engine import loss_ratings
from nodes.engine.engine import assess
from nodes.engine.protocol import Protocol
from nodes.engine.root import Root
from nodes.settings import Settings
from robust.compute import profile
from robust.data import load
from robust.models import Scorer, build_model
from robust.params import flat_params
from robust.source import as_rows

CASES = (("digits", "mlp", "momentum"), ("digits", "cnn", "momentum"),
         ("pystdlib", "gpt-tiny", "delta:steps=4,inner=adamw,clip=1.0"),
         ("pystdlib", "gpt-small", "delta:steps=4,inner=adamw,clip=1.0"))
RULE = "nnm+trimmed-mean"


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(dataset: str, model: str, protocol: str, n: int, root: int, repeats: int) -> dict:
    """One case's medians (see the module)."""
    settings = Settings(dataset=dataset, model=model, protocol=protocol, root=root, aggregator=RULE, tolerate=n // 5)
    data = load(dataset, seed=0)
    net = build_model(model, data.shape, data.classes, 0)
    w, scorer, protocol, kept = flat_params(net), Scorer(net), Protocol.of(settings), Root(settings, data)
    chain = aggregators.build(RULE, n // 5)
    loss, rule = [], []
    gen = torch.Generator().manual_seed(0)
    with profile(settings.threads):
        for _ in range(repeats):
            X = 1e-3 * torch.randn(n, w.numel(), generator=gen)
            loss.append(timed(lambda: loss_ratings.effects(scorer, protocol, kept, w, None, as_rows(X))))
            X = 1e-3 * torch.randn(n, w.numel(), generator=gen)
            rule.append(timed(lambda: assess(chain, X, True)))
    loss_s, rule_s = statistics.median(loss), statistics.median(rule)
    return {"dataset": dataset, "model": model, "d": w.numel(), "n": n, "root": root, "loss_score_s": loss_s,
            "per_row_ms": 1000 * loss_s / n, "rule_and_detectors_s": rule_s, "ratio": loss_s / rule_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=25)
    parser.add_argument("--root", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{'model':<22} {'d':>10} {'loss score s':>13} {'per row ms':>11} {'rule+detectors s':>17} {'ratio':>7}")
    for dataset, model, protocol in CASES:
        r = measure(dataset, model, protocol, args.nodes, args.root, args.repeats)
        print(f"{dataset + ' ' + model:<22} {r['d']:>10,} {r['loss_score_s']:>13.3f} {r['per_row_ms']:>11.1f} "
              f"{r['rule_and_detectors_s']:>17.3f} {r['ratio']:>6.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
