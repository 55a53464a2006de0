"""``python -m evaluation.flower_memory``: what Flower's SuperLink and the coordinator's
ServerApp hold per round, for ``n`` volunteers.

For each ``n`` of ``--volunteers``, a deployment on loopback as users run it
(``evaluation.field.large_model_memory.deploy``: ``robust coordinator start``, ``n`` x ``robust node join``,
TLS, signed updates, rows spooled to disk as they arrive) trains ``--model`` (default
``bignet:make``, a 42 MB float32 model) for ``--rounds`` rounds, and the same deployment with
the built-in ``mlp`` (a few KB) as the baseline. Measured:

- the most bytes the SuperLink's object store held (every task and reply object Flower keeps,
  sampled every 50 ms by ``evaluation/probe``, a probe loaded in the SuperLink process only);
- the peak resident memory of the SuperLink (``flower-superlink``) and of the ServerApp
  (``flwr-serverapp``: the round loop and the engine), each its kernel's high-water mark, and of
  the coordinator's whole process tree (``robust coordinator start`` and all it started: the
  most resident at once), read every half second.

The table gives each as a multiple of the model's bytes (a process's peak: its excess over the
baseline's): what grows with ``n`` is what Flower holds per volunteer. ``--in-flight K`` runs
the deployments with ``in-flight = K`` (``nodes.settings``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .large_model_memory import MB, deploy

MODEL, BASELINE = "bignet:make", "mlp"
ROUNDS = 2  # the first round warms every process up; the second is a steady round
PROBE = Path(__file__).resolve().parents[1] / "probe"  # evaluation/probe
PEAK_FILE = "store-peak"
# what the table shows: the SuperLink's and the ServerApp's own peaks (high-water marks), and the
# coordinator's process tree (``robust coordinator start`` and all it started) at its fullest
SHOWN = {"superlink": "SuperLink", "serverapp": "ServerApp", "tree": "coordinator tree"}


def settings_for(in_flight: int | None) -> dict:
    """The deployment's settings: no tolerance (any ``n`` serves), rows spooled to disk (so the
    ServerApp's rows do not hide what Flower holds), and ``in-flight`` if given (else its
    default, auto)."""
    return {"tolerate": 0, "spool": "disk", "in_flight": 0 if in_flight is None else in_flight}


@contextmanager
def store_probe(path: Path) -> Iterator[None]:
    """The processes started in the block load ``evaluation/probe``: the SuperLink's then
    writes the most bytes its object store held to ``path``."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "ROBUST_STORE_PEAK")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE), saved["PYTHONPATH"]]))
    os.environ["ROBUST_STORE_PEAK"] = str(path)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def peaks(root: Path, model: str, n: int, rounds: int, in_flight: int | None) -> dict:
    """Peak MB of each coordinator process and of the SuperLink's store, for one deployment of
    ``n`` volunteers (its folder is kept if it fails: the error names the logs in it)."""
    folder = root / f"{model.replace(':', '-')}-{n}"
    folder.mkdir(parents=True)
    with store_probe(folder / PEAK_FILE):
        report = deploy(folder / "federation", rounds, model, n, changes=settings_for(in_flight))
    peak = folder / PEAK_FILE
    store = int(peak.read_text()) / MB if peak.exists() else float("nan")
    shutil.rmtree(folder, ignore_errors=True)
    return {"model_bytes": report["model_bytes"], "seconds": report["seconds"], "store": store,
            "rounds": [{"round": r["round"], "seconds": r["seconds"], "accepted": r["accepted"]}
                       for r in report["rounds"]], **report["parts_peak_mb"], "tree": report["coordinator_peak_mb"]}


def measure(root: Path, model: str, volunteers: list[int], rounds: int, in_flight: int | None) -> list[dict]:
    """One row per ``n``: the peaks with ``model``, the baseline's, and the excess in models."""
    rows = []
    for n in volunteers:
        big, small = peaks(root, model, n, rounds, in_flight), peaks(root, BASELINE, n, rounds, in_flight)
        size = big["model_bytes"] - small["model_bytes"]
        rows.append({"n": n, "model_mb": round(big["model_bytes"] / MB, 1), "in_flight": in_flight,
                     "store_mb": round(big["store"], 1), "store_x_model": round(big["store"] * MB / size, 2),
                     "peak_mb": {part: big[part] for part in SHOWN}, "baseline_mb": {part: small[part] for part in SHOWN},
                     "x_model": {part: round((big[part] - small[part]) * MB / size, 2) for part in SHOWN},
                     "seconds": big["seconds"], "rounds": big["rounds"]})
        print_rows(rows[-1:], header=len(rows) == 1)
    return rows


def print_rows(rows: list[dict], header: bool = True) -> None:
    if header:
        print("| n | in-flight | model MB | SuperLink store peak MB (x model) | "
              + " | ".join(f"{name} peak MB (+x model)" for name in SHOWN.values()) + " | round seconds |")
        print("|---" * (5 + len(SHOWN)) + "|")
    for r in rows:
        cells = " | ".join(f"{r['peak_mb'][p]:.0f} ({r['x_model'][p]:+.1f})" for p in SHOWN)
        seconds = " ".join(f"{x['seconds']:.0f}" for x in r["rounds"])
        print(f"| {r['n']} | {r['in_flight'] if r['in_flight'] is not None else 'default'} | {r['model_mb']:.0f} "
              f"| {r['store_mb']:.0f} ({r['store_x_model']:.1f}) | {cells} | {seconds} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Peak memory of the SuperLink and the ServerApp per round, for n "
                                            "volunteers on loopback (x model: the excess over a tiny model's run).")
    p.add_argument("--volunteers", type=int, nargs="+", default=[1, 2, 3], metavar="N",
                   help="volunteer counts to deploy (default 1 2 3; each volunteer takes about 1.5 GB)")
    p.add_argument("--model", default=MODEL, help=f"the model factory in examples/large (default {MODEL})")
    p.add_argument("--rounds", type=int, default=ROUNDS, metavar="R", help=f"rounds per deployment (default {ROUNDS})")
    p.add_argument("--in-flight", type=int, metavar="K", help="the in-flight setting (default: the setting's default)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if min(args.volunteers) < 1 or args.rounds < 1:
        p.error("--volunteers must be >= 1 and --rounds >= 1")
    root = Path(tempfile.mkdtemp(prefix="robust-flower-memory-"))
    rows = measure(root, args.model, args.volunteers, args.rounds, args.in_flight)
    shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
