"""``robust agg-bench --out-of-core``: every rule run from rows spooled on disk.

For each size, ``n`` rows of ``d`` float32 values are written one ``.npy`` file per row (what
the coordinator's spool and audit store hold), then one plain sequential read of the spool is
timed, then each rule is run from the spool (``robust.source.Spooled``). Per rule: seconds,
peak resident memory of the process while it ran (the kernel's high-water mark, reset before
each rule), bytes read from the spool, and seconds as a multiple of the one read. With
``--device cuda`` each block goes to the GPU as it is read (``Spooled``'s ``device``), the rule
runs there under the compute profile, the timer stops after ``torch.cuda.synchronize()``, and
each row also gives the peak GPU memory the rule allocated.

Each rule runs on an aggregator of its own, and each of its rounds on a ``Spooled`` object of
its own (the same files: a source keeps the statistics computed on it, ``Rows.memo``), so the
round measured computes everything it uses, as a coordinator's round does. A rule that carries
rows across rounds (foolsgold, fldetector) keeps them in a row store in the spool folder
(``robust.rowstore``, as a spooled coordinator does) and plays ``WARM`` rounds first on its
aggregator (the model moving), so the round measured reads and writes its state: the
histories, or the last rows and a pair; that state is all it takes from the rounds before.
``state_bytes``: what the store holds after that round (old and new rows, before the rows no
state names are collected).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import aggregators
from robust.compute import device_name, profile, resolve_device, synced
from robust.geometry import weighted_sum
from robust.rowstore import RowStore, names
from robust.source import Spooled, write_row

from .peak_memory import peak_rss_bytes

DEFAULT_RULES = ["mean", "median", "trimmed-mean", "meamed", "krum", "multi-krum", "geometric-median",
                 "centered-clipping", "bulyan", "caf", "dnc", "signguard", "flame", "fltrust",
                 "foolsgold", "fldetector", "nnm+trimmed-mean", "nnm+krum", "bucketing:s=2+krum",
                 "arc+nnm+trimmed-mean"]
WARM = 2  # rounds a rule that carries rows plays before the measured one (fldetector scores from its third)


def write_spool(folder: Path, n: int, d: int, progress: Progress) -> list[Path]:
    """``n`` rows like a round's updates (a shared direction plus noise), one file each."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(d, generator=g)
    paths = []
    for i in progress.track(range(n), description=f"spooling {n} rows of {d:,}"):
        row = shared + 0.5 * torch.randn(d, generator=g)
        paths.append(folder / f"row{i:04d}.npy")
        write_row(paths[-1], row)
        del row
    return paths


def read_once(paths: list[Path]) -> float:
    """Seconds of one sequential read of the whole spool, through the same reader, once the
    spool's writes have reached the disk (a read racing their write-back is 5x slower here)."""
    os.sync()
    start = time.perf_counter()
    for _ in Spooled(paths, validated=True).blocks():
        pass
    return time.perf_counter() - start


def check_disk(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need * 1.05:
        raise ValueError(
            f"the spool needs {need / 1e9:.1f} GB and {folder} has {free / 1e9:.1f} GB free: "
            "pass --spool DIR on a larger disk, or a smaller --sizes"
        )


def bench_size(n: int, d: int, specs: list[str], args: argparse.Namespace, emit: Callable[[dict], None]) -> None:
    f = n // 5
    device = resolve_device(args.device, "--device ")
    root = Path(args.spool) if args.spool else Path(tempfile.gettempdir())
    check_disk(root, (n + max(aggregators.build(spec, f).kept_rows(n) for spec in specs)) * d * 4)
    folder = Path(tempfile.mkdtemp(prefix="robust-spool-", dir=root))
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    try:
        with progress:
            paths = write_spool(folder, n, d, progress)
            reading = progress.add_task("one read of the spool", total=None)
            read_seconds = read_once(paths)
            progress.remove_task(reading)
            ids = tuple(f"node{i}" for i in range(n))
            mean = torch.full((n,), 1.0 / n, dtype=torch.float64)
            reference = weighted_sum(Spooled(paths, validated=True), mean)
            inputs = lambda t: aggregators.RoundInputs(ids=ids, w=torch.full((d,), 1e-3 * t),  # noqa: E731
                                                       reference=reference).to(device)
            for spec in progress.track(specs, description=f"rules at {n}x{d:,}"):
                agg = aggregators.build(spec, f)
                try:
                    agg.check_n(n)
                except ValueError as err:
                    print(f"{n:>4}x{d:<10} {spec:<28} skipped: {err}", flush=True)
                    continue
                emit({"rule": spec, "n": n, "d": d, "f": f, "read_seconds": read_seconds, "spool_bytes": n * d * 4,
                      "device": device_name(device),
                      **run_rule(agg, paths, inputs, RowStore(folder / "state"), read_seconds, device)})
    finally:
        if args.keep_spool:
            print(f"spool kept in {folder}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def run_rule(agg: aggregators.Chain, paths: list[Path], inputs: Callable[[int], aggregators.RoundInputs],
             store: RowStore, read_seconds: float, device: torch.device) -> dict:
    """One round of ``agg`` (fresh: never called before) from the spool on ``device``, measured
    (after ``WARM`` rounds when it carries rows, which it keeps in ``store``; the store is
    emptied after); each round reads a new ``Spooled`` source; ``inputs(t)``: round ``t``'s. On
    CUDA the rule runs deterministic, as a coordinator runs it, and the timer stops after a sync."""
    agg.spill(store)
    warm = WARM if agg.kept_rows(len(paths)) else 0
    with profile(torch.get_num_threads(), device):
        for t in range(warm):
            agg(Spooled(paths, validated=True, device=device), inputs(t))
            store.collect(names(agg.state()))
        source, now = Spooled(paths, validated=True, device=device), inputs(warm)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        result, peak = peak_rss_bytes(lambda: synced(device, agg(source, now)))
        seconds = time.perf_counter() - start
    del result
    state = sum(p.stat().st_size for p in store.folder.glob("*.npy")) if store.folder.exists() else 0
    store.collect(set())
    row = {"seconds": seconds, "peak_rss_mb": peak / 2**20, "bytes_read": source.bytes_read,
           "reads": seconds / read_seconds, "state_bytes": state}
    if device.type == "cuda":
        row["gpu_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return row


def print_row(row: dict) -> None:
    print(f"{row['n']:>4}x{row['d']:<10} {row['rule']:<28} {row['seconds']:>9.1f} {row['reads']:>7.2f} "
          f"{row['peak_rss_mb']:>9.0f} {row['bytes_read'] / row['spool_bytes']:>9.2f} "
          f"{row['state_bytes'] / row['spool_bytes']:>7.2f}", flush=True)


def prepare(args: argparse.Namespace) -> tuple[list[str], Callable, Callable[[dict], None]]:
    """The specs to run (checked before any disk is spent), with the header printed; the
    functions that run a size and print a row (``evaluation.microbench.aggregation_speed.main`` drives them)."""
    specs = args.rules.split(",") if args.rules else DEFAULT_RULES
    for spec in specs:
        aggregators.build(spec, 0)
    device = resolve_device(args.device, "--device ")  # cuda without a GPU: refused before any disk is spent
    print(f"robust agg-bench --out-of-core: {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"float32 rows spooled one file per row, f = n // 5, rules on {device_name(device)}")
    print(f"{'size':<15} {'rule':<28} {'seconds':>9} {'x read':>7} {'peak MB':>9} {'x spool':>9} {'state':>7}")
    return specs, bench_size, print_row
