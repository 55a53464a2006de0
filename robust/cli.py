"""The ``robust`` command. Subcommands import their packages lazily, so ``--help`` is instant."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__


def _agg_bench(args: argparse.Namespace) -> int:
    from evaluation.agg_bench import main

    return main(args)


def _bench(args: argparse.Namespace) -> int:
    from evaluation.bench import main

    return main(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="robust",
        description="Byzantine-robust training on untrusted volunteer machines.",
    )
    p.add_argument("--version", action="version", version=f"robust {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "bench",
        help="play attacks against defences on a scenario grid; report damage and detectability",
        description="Run every cell (aggregator x attack x seed x scenario values) of a scenario "
        "file, append results to DIR/results.jsonl, and write DIR/summary.md and plots. "
        "Re-running skips finished cells.",
    )
    run.add_argument("--config", metavar="FILE", help="scenario TOML, e.g. evaluation/scenarios/quick.toml")
    run.add_argument("--out", metavar="DIR", required=True, help="results and report folder")
    run.add_argument("--jobs", type=int, default=1, help="cells run in parallel processes (default 1)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a scenario key (repeatable)")
    run.add_argument("--no-vectorize", action="store_true", help="compute each node's update one by one, as a volunteer does")
    run.add_argument("--sweep", metavar="ATTACK:PARAM=LO..HI", help="stealth frontier: sweep one attack parameter, e.g. alie:z=0.1..3")
    run.add_argument("--sweep-points", type=int, default=8, help="values in the sweep (default 8)")
    run.set_defaults(run=_bench)

    bench = sub.add_parser(
        "agg-bench",
        help="time every aggregation rule against Flower's built-in ones",
        description="Time every aggregation rule (median of repeats) and Flower's built-in "
        "equivalents on the same inputs; print ms, speed-up over Flower and peak extra memory.",
    )
    bench.add_argument("--quick", action="store_true", help="one small size (20x100000): about a minute")
    bench.add_argument(
        "--sizes", metavar="NxD,...", help="sizes to time, e.g. 100x1000000,50x1000000 "
        "(default: 20x100000,50x1000000,100x1000000)",
    )
    bench.add_argument("--rules", metavar="SPEC,...", help="specs to time (default: every rule, and the pre-aggregators before trimmed-mean)")
    bench.add_argument("--repeats", type=int, default=5, help="timed calls per method (median reported; default 5)")
    bench.add_argument("--budget", type=float, default=60.0, metavar="S", help="stop repeating a method after S seconds (default 60)")
    bench.add_argument("--no-flower", action="store_true", help="skip Flower's implementations")
    bench.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.set_defaults(run=_agg_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    # Before torch is imported: back large tensors with huge pages (first touch of a fresh
    # 400 MB update matrix: 126 ms -> 52 ms here). Flower/NumPy already do this for arrays.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    p = parser()
    args = p.parse_args(argv)
    if not getattr(args, "run", None):
        p.print_help()
        return 0
    try:
        return args.run(args)
    except ValueError as err:  # user errors carry their fix in the message
        print(f"robust {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"robust {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
