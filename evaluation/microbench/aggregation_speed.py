"""``robust agg-bench``: time every aggregation rule, and Flower's equivalents, on the same input.

For each size (n, d) with f = n // 5, a rule and its peers are timed in turns: each turn calls
every method once, so that machine noise hits them alike; a warm-up turn, then ``repeats``
turns (fewer once the turns have taken the time budget). Every call starts afresh: its
``prepare`` (untimed) builds the inputs, the source and the aggregator, so no call reuses what
an earlier one computed. The median is reported with the speed-up over the fastest Flower
equivalent and the peak resident memory the call added, as a multiple of the input's size.
``--peers`` adds ByzFL's equivalents (``evaluation.peers.byzfl_aggregators``) and prints one
row per rule: robust's, ByzFL's and Flower's median ms and the ratio fastest peer / robust,
checked against issue 41's targets at n = 100, d = 1e6 (``evaluation.microbench.peer_ratios``).

``--device`` (``auto | cpu | cuda``, as the coordinator's ``device`` setting) runs our rules
the way a coordinator on that device does: the rows stay in host memory and their blocks are
moved to the device as they are read (``robust.source.on_device``), under the compute
profile's settings for it; a CUDA timer stops after ``torch.cuda.synchronize()``, and each
row also gives the peak GPU memory the calls allocated. The peers run on the CPU.
One run per device: ``--device cpu`` and ``--device cuda`` print the two tables side by side.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import aggregators
from aggregators.base import REGISTRY, PreAggregator
from nodes.engine.spotcheck import profile_of
from robust.compute import device_name, profile, resolve_device, synced
from robust.source import Memory, on_device
from robust.spec import parse

from evaluation.peers import byzfl_aggregators as byzfl
from evaluation.peers import flower_aggregators as flower
from evaluation.peers import gram_pass
from evaluation.peers.baseline import Baseline
from . import peer_ratios
from .peak_memory import peak_extra_bytes

DEFAULT_SIZES = [(20, 100_000), (50, 1_000_000), (100, 1_000_000)]
QUICK_SIZES = [(20, 100_000)]


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


def time_calls(methods: list[Baseline], repeats: int, budget: float) -> tuple[list[tuple[list[float], int]], list[str]]:
    """Time ``methods`` in turns: each turn calls every method once, in order (its ``prepare``
    untimed, then its ``run`` timed); a warm-up turn, then up to ``repeats`` turns, none begun
    once the turns have taken ``budget`` seconds per method. Returns, per method, the seconds
    of its timed calls (the warm-up's alone if no other turn ran) and the most resident memory
    a call added; and the methods' names in the order they were called."""
    calls: list[list[tuple[float, int]]] = [[] for _ in methods]
    order: list[str] = []
    start = time.perf_counter()
    for turn in range(repeats + 1):
        if turn and time.perf_counter() - start >= budget * len(methods):
            break
        for method, made in zip(methods, calls):
            made.append(_one_call(method))
            order.append(method.name)
    return [([t for t, _ in made[1:]] or [made[0][0]], max(peak for _, peak in made)) for made in calls], order


def _one_call(method: Baseline) -> tuple[float, int]:
    """Seconds of one call of ``method`` (prepared untimed) and the resident memory it added."""
    state = method.prepare()

    def timed() -> float:
        t0 = time.perf_counter()
        method.run(state)
        return time.perf_counter() - t0

    return peak_extra_bytes(timed)


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
    """Inputs for the rules that need more than the rows: ids ``node0...``, a zero model, the
    rows' mean as the root update (a rule's first call on them: its state starts empty), and
    ratings falling with the row index."""
    n = X.shape[0]
    return aggregators.RoundInputs(ids=tuple(f"node{i}" for i in range(n)), w=torch.zeros(X.shape[1], dtype=X.dtype),
                                   reference=X.mean(dim=0), ratings=-torch.arange(n, dtype=torch.float64))


def bench_size(
    n: int, d: int, specs: list[str], args: argparse.Namespace, emit: Callable[[dict], None]
) -> None:
    f = n // 5
    dtype = getattr(torch, args.dtype)
    device = resolve_device(args.device, "--device ")
    X = torch.randn(n, d, generator=torch.Generator().manual_seed(0), dtype=dtype)
    size = X.numel() * X.element_size()
    for spec in specs:
        try:
            methods = [("robust", our_method(spec, f, X, device))]
        except ValueError as err:  # e.g. mda's exact search at n=100
            print(f"{n:>4}x{d:<8} {spec:<44} skipped: {err}", flush=True)
            continue
        if args.peers:
            methods += [("byzfl", base) for base in byzfl.baselines(spec, X, f)]
            methods += [("floor", base) for base in gram_pass.baselines(spec, X)]
        if not args.no_flower:
            methods += [("flower", base) for base in flower.baselines(spec, X, f)]
        print(f"  timing {spec} at {n}x{d} ({len(methods)} methods in turns) ...", file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with profile(torch.get_num_threads(), device):  # on CUDA: deterministic algorithms, as a coordinator runs
            timings, order = time_calls([base for _, base in methods], args.repeats, args.budget)
        ours, *rows = [_record(base.name, spec, kind, n, d, f, times, peak, size)
                       for (kind, base), (times, peak) in zip(methods, timings)]
        ours["device"] = device_name(device)
        if device.type == "cuda":
            ours["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        flower_ms = [r["ms"] for r in rows if r["kind"] == "flower"]
        if flower_ms:
            ours["speedup_vs_flower"] = min(flower_ms) / ours["ms"]
        for row in [ours, *rows]:
            emit(row)
        if args.peers:
            emit(peer_ratios.compared(ours, rows, order, args.dtype))


def _record(method, spec, kind, n, d, f, times, peak, size) -> dict:
    return {
        "method": method, "rule": spec, "kind": kind, "n": n, "d": d, "f": f,
        "ms": 1000 * statistics.median(times), "calls": len(times),
        "ms_all": [round(1000 * t, 3) for t in times],
        "peak_extra_bytes": peak, "input_bytes": size,
    }


def _print_row(row: dict) -> None:
    speed = f"{row['speedup_vs_flower']:.1f}x" if "speedup_vs_flower" in row else ""
    name = row["method"] if row["kind"] == "robust" else "  " + row["method"]
    print(
        f"{row['n']:>4}x{row['d']:<8} {name:<44} {row['ms']:>10.1f} {row['calls']:>5} "
        f"{speed:>8} {row['peak_extra_bytes'] / 2**20:>9.0f} {row['peak_extra_bytes'] / row['input_bytes']:>6.2f}",
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    if args.sizes:
        sizes = parse_sizes(args.sizes)
    if args.peers and (args.out_of_core or args.no_flower):
        raise ValueError("--peers times ByzFL's and Flower's rules beside ours, in memory: drop --out-of-core "
                         "and --no-flower")
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
            json.dump({"machine": machine(resolve_device(args.device, "--device ")), "results": results}, out, indent=1)
        print(f"results written to {args.json}")
    return 0


def machine(device: torch.device) -> dict:
    """What the timings ran on: the CPU (its model, as spot checks name it), torch's threads,
    the device our rules ran on, and the versions of torch, flwr and byzfl (``None``: not
    installed)."""
    return {"cpu": profile_of(torch.device("cpu")), "torch_threads": torch.get_num_threads(),
            "device": device_name(device), "torch": torch.__version__,
            "flwr": _version("flwr"), "byzfl": byzfl.version()}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # agg-bench --no-flower runs without it
        return None


def prepare(args: argparse.Namespace) -> tuple[list[str], Callable, Callable[[dict], None]]:
    """The specs to time (checked), with the header printed; the timing and printing functions."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 (got {args.repeats})")
    device = resolve_device(args.device, "--device ")  # cuda without a GPU: refused before any timing
    specs = args.rules.split(",") if args.rules else aggregators.rules() + aggregators.pre_aggregators()
    for spec in specs:  # fail on a bad spec before any timing
        our_method(spec, 0, torch.zeros(1000, 1))
    about = machine(device)
    peers = f", byzfl {about['byzfl']}" if args.peers and about["byzfl"] else ""
    print(
        f"robust agg-bench: {about['cpu']}, {about['torch_threads']} torch threads, flwr {about['flwr']}{peers}, "
        f"{args.dtype}, f = n // 5, median of {args.repeats} calls after a warm-up, methods timed in turns, "
        f"our rules on {about['device']}"
    )
    if args.peers and byzfl.load() is None:
        print(f"ByzFL is not installed, so only Flower's rules are timed beside ours: {byzfl.INSTALL} to time it too")
    if args.peers:
        peer_ratios.print_header()
        return specs, bench_size, peer_ratios.print_row
    print(
        f"{'size':<13} {'method':<44} {'ms':>10} {'calls':>5} {'vs flwr':>8} "
        f"{'peak MB':>9} {'xinput':>6}"
    )
    return specs, bench_size, _print_row
