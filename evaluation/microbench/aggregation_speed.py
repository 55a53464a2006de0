"""``robust agg-bench``: time every aggregation rule, and Flower's equivalents, on the same input.

For each size (n, d) with f = n // 5, each method is called until it has ``repeats`` timed
calls after a warm-up call (or its time budget is spent); the median is reported with the
speed-up over the fastest Flower equivalent and the peak resident memory the call added,
as a multiple of the input's size.

``--device`` (``auto | cpu | cuda``, as the coordinator's ``device`` setting) runs our rules
the way a coordinator on that device does: the rows stay in host memory and their blocks are
moved to the device as they are read (``robust.source.on_device``), under the compute
profile's settings for it; a CUDA timer stops after ``torch.cuda.synchronize()``, and each
row also gives the peak GPU memory the calls allocated. Flower's equivalents run on the CPU.
One run per device: ``--device cpu`` and ``--device cuda`` print the two tables side by side.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import aggregators
from aggregators.base import REGISTRY, PreAggregator
from robust.compute import device_name, profile, resolve_device, synced
from robust.source import Memory, on_device
from robust.spec import parse

from evaluation.peers.baseline import Baseline
from evaluation.peers.flower_aggregators import baselines
from .peak_memory import peak_extra_bytes

DEFAULT_SIZES = [(20, 100_000), (50, 1_000_000), (100, 1_000_000)]
QUICK_SIZES = [(20, 100_000)]
# The targets at n=100, d=1e6, f=20 on this 2-core machine (ms).
TARGETS_MS = {
    "krum": 225, "multi-krum": 225, "median": 600, "trimmed-mean": 700,
    "geometric-median": 100, "centered-clipping": 50, "nnm": 800, "bulyan": 3000,
}


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        try:
            n, d = (int(float(v)) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"bad size {item!r}: write NxD, e.g. 100x1000000") from None
        if n < 1 or d < 1:
            raise ValueError(f"bad size {item!r}: n and d must be >= 1")
        sizes.append((n, d))
    return sizes


def time_calls(
    prepare: Callable[[], object], run: Callable[[object], object], repeats: int, budget: float
) -> tuple[list[float], int]:
    """Seconds of each timed call (a warm-up call first), and the largest memory a call added."""
    times: list[float] = []
    peak = 0
    start = time.perf_counter()
    while len(times) < repeats + 1 and (not times or time.perf_counter() - start < budget):
        state = prepare()

        def timed() -> float:
            t0 = time.perf_counter()
            run(state)
            return time.perf_counter() - t0

        elapsed, extra = peak_extra_bytes(timed)
        times.append(elapsed)
        peak = max(peak, extra)
        del state
    return (times[1:] if len(times) > 1 else times), peak


def our_method(spec: str, f: int, X: torch.Tensor, device: torch.device | str = "cpu") -> Baseline:
    """``spec`` on the rows ``X`` read on ``device`` block by block, as the round engine reads
    them (finite rows, so not checked again); a lone pre-aggregator is timed on its own. Each
    call's ``prepare`` builds everything afresh: a clone of ``X``, its source, the aggregator and
    the round's inputs, so no call reuses what an earlier one kept (a source's statistics,
    ``Rows.memo``: the distances, the median; a rule's state: a center, histories). Each call
    returns once the device has finished. A spec or a row count it cannot serve: ``ValueError``
    now, before any timing."""
    device = torch.device(device)
    _built(spec, f, X.shape[0])

    def prepare() -> Callable[[], torch.Tensor]:
        x = X.clone()
        rows = on_device(Memory(x, validated=True), device)
        built = _built(spec, f, x.shape[0])
        if isinstance(built, aggregators.Chain):
            inputs = round_inputs(x).to(device)
            return lambda: built(rows, inputs)
        return lambda: built.transformed(rows).tensor()

    return Baseline(spec, prepare, lambda call: synced(device, call()))


def _built(spec: str, f: int, n: int) -> aggregators.Chain | PreAggregator:
    """The chain ``spec`` (a lone pre-aggregator: that stage), checked for ``n`` rows."""
    comps = parse(spec)
    entry = REGISTRY.entries.get(comps[0].name)
    lone = len(comps) == 1 and entry is not None and not entry.is_rule
    built = entry(f, **comps[0].params) if lone else aggregators.build(spec, f)
    built.check_n(n)
    return built


def round_inputs(X: torch.Tensor) -> aggregators.RoundInputs:
    """Inputs for the rules that need more than the rows: ids ``node0...``, a zero model, and
    the rows' mean as the root update (a rule's first call on them: its state starts empty)."""
    return aggregators.RoundInputs(ids=tuple(f"node{i}" for i in range(X.shape[0])),
                                   w=torch.zeros(X.shape[1], dtype=X.dtype), reference=X.mean(dim=0))


def bench_size(
    n: int, d: int, specs: list[str], args: argparse.Namespace, emit: Callable[[dict], None]
) -> None:
    f = n // 5
    dtype = getattr(torch, args.dtype)
    device = resolve_device(args.device, "--device ")
    X = torch.randn(n, d, generator=torch.Generator().manual_seed(0), dtype=dtype)
    size = X.numel() * X.element_size()
    for spec in specs:
        rows = []
        for base in [] if args.no_flower else baselines(spec, X, f):
            print(f"  timing {base.name} at {n}x{d} ...", file=sys.stderr, flush=True)
            times, peak = time_calls(base.prepare, base.run, args.repeats, args.budget)
            rows.append(_record(base.name, spec, "flower", n, d, f, times, peak, size))
        try:
            ours_method = our_method(spec, f, X, device)
        except ValueError as err:  # e.g. mda's exact search at n=100
            print(f"{n:>4}x{d:<8} {spec:<44} skipped: {err}", flush=True)
            continue
        print(f"  timing {spec} at {n}x{d} on {device} ...", file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with profile(torch.get_num_threads(), device):  # on CUDA: deterministic algorithms, as a coordinator runs
            times, peak = time_calls(ours_method.prepare, ours_method.run, args.repeats, args.budget)
        ours = _record(spec, spec, "robust", n, d, f, times, peak, size)
        ours["device"] = device_name(device)
        if device.type == "cuda":
            ours["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        if rows:
            ours["speedup_vs_flower"] = min(r["ms"] for r in rows) / ours["ms"]
        if (n, d) == (100, 1_000_000) and spec in TARGETS_MS:
            ours["target_ms"] = TARGETS_MS[spec]
        for row in [ours, *rows]:
            emit(row)


def _record(method, spec, kind, n, d, f, times, peak, size) -> dict:
    return {
        "method": method, "rule": spec, "kind": kind, "n": n, "d": d, "f": f,
        "ms": 1000 * statistics.median(times), "calls": len(times),
        "ms_all": [round(1000 * t, 3) for t in times],
        "peak_extra_bytes": peak, "input_bytes": size,
    }


def _print_row(row: dict) -> None:
    speed = f"{row['speedup_vs_flower']:.1f}x" if "speedup_vs_flower" in row else ""
    target = ""
    if "target_ms" in row:
        target = f"{row['target_ms']} {'ok' if row['ms'] <= row['target_ms'] else 'MISSED'}"
    name = row["method"] if row["kind"] == "robust" else "  " + row["method"]
    print(
        f"{row['n']:>4}x{row['d']:<8} {name:<44} {row['ms']:>10.1f} {row['calls']:>5} "
        f"{speed:>8} {row['peak_extra_bytes'] / 2**20:>9.0f} {row['peak_extra_bytes'] / row['input_bytes']:>6.2f} "
        f"{target:>12}",
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    if args.sizes:
        sizes = parse_sizes(args.sizes)
    if args.out_of_core:
        from . import out_of_core

        specs, bench, show = out_of_core.prepare(args)
    else:
        specs, bench, show = prepare(args)
    results: list[dict] = []

    def emit(row: dict) -> None:
        results.append(row)
        show(row)

    for n, d in sizes:
        bench(n, d, specs, args, emit)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"results": results}, out, indent=1)
        print(f"results written to {args.json}")
    return 0


def prepare(args: argparse.Namespace) -> tuple[list[str], Callable, Callable[[dict], None]]:
    """The specs to time (checked), with the header printed; the timing and printing functions."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {args.repeats})")
    device = resolve_device(args.device, "--device ")  # cuda without a GPU: refused before any timing
    specs = args.rules.split(",") if args.rules else aggregators.rules() + aggregators.pre_aggregators()
    for spec in specs:  # fail on a bad spec before any timing
        our_method(spec, 0, torch.zeros(1000, 1))
    import flwr

    print(
        f"robust agg-bench: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, flwr {flwr.__version__}, "
        f"{args.dtype}, f = n // 5, median of {args.repeats} calls after a warm-up, our rules on "
        f"{device_name(device)}"
    )
    print(
        f"{'size':<13} {'method':<44} {'ms':>10} {'calls':>5} {'vs flwr':>8} "
        f"{'peak MB':>9} {'xinput':>6} {'target ms':>12}"
    )
    return specs, bench_size, _print_row
