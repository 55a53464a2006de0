"""The bench on a GPU beside the CPU (issue 25, item 5): ``python -m evaluation.device_speed``.

Runs one grid twice with ``robust bench --jobs 1``, each in a fresh process: with
``device = cpu`` and with ``device = cuda`` (the batched training kernels, the rule and the
detectors on the GPU; ``evaluation.bench.drivers.inprocess``). Prints each one's seconds and cells a minute, and
how far apart the two runs' cells end: the GPU's float sums run in another order, so a cell's
bits differ across devices and its trajectory drifts; the comparison gives the mean and the
largest difference in final accuracy over the grid's cells, and how many kept the same bits.

    python -m evaluation.device_speed --config evaluation/scenarios/speed.toml --set 'seeds=[0]' --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from evaluation.peers.hand_vectorised import run_bench

DEVICES = ("cpu", "cuda")


def results(folder: Path) -> dict[tuple, dict]:
    """A bench folder's records by cell (defence, attack, seed)."""
    lines = (folder / "results.jsonl").read_text().splitlines()
    return {(r["aggregator"], r["attack"], r["seed"]): r for r in map(json.loads, lines)}


def compare(cpu: dict[tuple, dict], gpu: dict[tuple, dict]) -> dict:
    """How far the GPU's cells end from the CPU's: the same cells, final accuracies and bits."""
    if cpu.keys() != gpu.keys():
        raise ValueError(f"the two runs hold different cells ({len(cpu)} and {len(gpu)})")
    gaps = {k: abs(gpu[k]["final_accuracy"] - cpu[k]["final_accuracy"]) for k in cpu}
    worst = max(gaps, key=gaps.get)
    return {"cells": len(cpu), "same_bits": sum(gpu[k]["model_sha256"] == cpu[k]["model_sha256"] for k in cpu),
            "mean_accuracy_cpu": statistics.fmean(r["final_accuracy"] for r in cpu.values()),
            "mean_accuracy_gpu": statistics.fmean(r["final_accuracy"] for r in gpu.values()),
            "mean_abs_gap_pp": 100 * statistics.fmean(gaps.values()), "max_abs_gap_pp": 100 * gaps[worst],
            "max_gap_cell": "/".join(map(str, worst)),
            "false_quarantines": {d: sum(r["false_quarantines"] for r in run.values())
                                  for d, run in (("cpu", cpu), ("gpu", gpu))},
            "devices": sorted({r.get("device", "cpu") for r in gpu.values()})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="robust bench --jobs 1 on the CPU and on the GPU, on one grid")
    p.add_argument("--config", metavar="FILE", help="scenario TOML (default: the built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario key")
    p.add_argument("--out", metavar="DIR", required=True, help="folder for the two runs (cpu/, cuda/) and speed.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    seconds = {}
    for device in DEVICES:
        folder = out / device
        if folder.exists() and any(folder.iterdir()):  # the bench would skip the cells it finds done
            raise SystemExit(f"{folder} holds an earlier run: give --out a new folder, so both devices play every cell")
        folder.mkdir(parents=True, exist_ok=True)
        seconds[device] = run_bench(args.config, [*args.set, f'device="{device}"'], str(folder))
    summary = compare(results(out / "cpu"), results(out / "cuda"))
    summary["seconds"] = seconds
    summary["cells_per_minute"] = {d: 60 * summary["cells"] / s for d, s in seconds.items()}
    (out / "speed.json").write_text(json.dumps(summary, indent=1))
    rate = summary["cells_per_minute"]
    print(f"{summary['cells']} cells, robust bench --jobs 1: cpu {seconds['cpu']:.1f} s ({rate['cpu']:.1f} cells a "
          f"minute), {', '.join(summary['devices'])} {seconds['cuda']:.1f} s ({rate['cuda']:.1f} cells a minute): "
          f"the GPU at {seconds['cpu'] / seconds['cuda']:.2f}x the CPU's speed")
    print(f"final accuracy: cpu {100 * summary['mean_accuracy_cpu']:.2f}%, gpu {100 * summary['mean_accuracy_gpu']:.2f}% "
          f"(mean); cells apart by {summary['mean_abs_gap_pp']:.2f} pp on average, {summary['max_abs_gap_pp']:.2f} pp at "
          f"most ({summary['max_gap_cell']}); {summary['same_bits']} of {summary['cells']} with the same bits; "
          f"honest nodes quarantined: cpu {summary['false_quarantines']['cpu']}, gpu {summary['false_quarantines']['gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
