"""The ``robust`` command. Subcommands import their packages lazily, so ``--help`` is instant."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from . import __version__


def _agg_bench(args: argparse.Namespace) -> int:
    from evaluation.microbench.aggregation_speed import main

    return main(args)


def _attacks(args: argparse.Namespace) -> int:
    import attacks

    rows = [("attack", "kind", "file"), *((name, *where) for name, where in attacks.sources().items())]
    name_width, kind_width = (max(len(row[i]) for row in rows) for i in (0, 1))
    for name, kind, file in rows:
        print(f"{name:<{name_width}}  {kind:<{kind_width}}  {file}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from evaluation.bench.run_grid import main

    return main(args)


def _deploy_bench(args: argparse.Namespace) -> int:
    from evaluation.field.round_overhead import main

    return main(args)


def _stress(args: argparse.Namespace) -> int:
    from evaluation.field.stress import main

    return main(args)


def _field(args: argparse.Namespace) -> int:
    from evaluation.field.lab.play import main

    return main(args)


def _federation(args: argparse.Namespace) -> int:
    from nodes.cli import run

    return run(args)


def _add_settings(p: argparse.ArgumentParser) -> None:
    """One option per coordinator setting, from their one declaration (``nodes.settings``)."""
    from nodes.settings import PARAMS  # declarations only: imports no torch

    for param in PARAMS.values():
        names = [f"--{param.key}", *(["--path"] if param.key == "code" else [])]
        help = f"{param.help} (default {param.default!r})"
        if param.kind is bool:
            p.add_argument(*names, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            p.add_argument(*names, type=param.kind, default=None, help=help)


# What `--attack` accepts (nodes.volunteer.faults.PROTOCOL_FAULTS and the node-side attacks): kept here,
# as text, so that `robust --help` imports neither torch nor Flower; a test checks it.
_NODE_BEHAVIOURS = ("label-flip, alie-local:z=1,estimates=3, backdoor:..., neurotoxin:k=5,stop_after=R, constrain-scale:alpha=0.7,norm=N, forge:scale=..., lazy, and the protocol faults nan, wrong-shape, huge-norm, inflated-count, "
                    "bad-signature, replay, stale-base, dtype-lie, shape-lie, oversize, slow-drip, decline, trainer-crash, "
                    "trainer-hang, trainer-garbage, clientapp-stall")


def _add_dashboard(p: argparse.ArgumentParser, help: str, default: str | None = None,
                   flags: tuple[str, str] = ("--dashboard", "--dashboard-token")) -> None:
    p.add_argument(flags[0], dest="dashboard", default=default, metavar="[HOST:]PORT", help=help)
    p.add_argument(flags[1], dest="dashboard_token", default="", metavar="TOKEN",
                   help="the token the dashboard asks for (off loopback it always asks for one; default: a new one, "
                        "printed in its URL)")


_RUN_DIR = "the coordinator folder, or the root of a demo (`robust demo --json` prints it as folder)"


def _federation_parsers(sub: argparse._SubParsersAction) -> None:
    coord = sub.add_parser("coordinator", help="run a coordinator: init, admit, start, status, replay")
    csub = coord.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = csub.add_parser("init", help="make DIR: CA and server certificate, settings, empty admission list")
    init.add_argument("dir", metavar="DIR")
    init.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                      help="a name or address volunteers use to reach this machine (repeatable; loopback is always in)")
    _add_settings(init)
    admit = csub.add_parser("admit", help="admit a volunteer's public key (NODE.pub)")
    admit.add_argument("dir", metavar="DIR")
    admit.add_argument("public", metavar="NODE.pub")
    start = csub.add_parser("start", help="start the SuperLink and train; started again, it resumes")
    start.add_argument("dir", metavar="DIR")
    _add_settings(start)
    _add_dashboard(start, "serve the run's web dashboard on [HOST:]PORT while it trains (127.0.0.1 unless a HOST is given)")
    status = csub.add_parser("status", help="the run at a glance from DIR alone: rounds, accuracy, nodes, rejections "
                             "(while it runs, or after)")
    status.add_argument("dir", metavar="DIR", help=_RUN_DIR)
    status.add_argument("--json", action="store_true", help="print one JSON object instead")
    replay = csub.add_parser("replay", help="recompute every round (async: every buffer, with its recorded staleness) "
                             "from DIR's round log and stored updates; exit 1 unless every model SHA-256 matches "
                             "(`robust audit verify` also checks the chain and signatures)")
    replay.add_argument("dir", metavar="DIR", help=_RUN_DIR)
    node = sub.add_parser("node", help="be a volunteer: keygen, join")
    nsub = node.add_subparsers(dest="action", metavar="ACTION", required=True)
    keygen = nsub.add_parser("keygen", help="make a volunteer identity (DIR/node.key, DIR/node.pub)")
    keygen.add_argument("dir", metavar="DIR")
    join = nsub.add_parser("join", help="join a coordinator and train for it until stopped")
    join.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    join.add_argument("--ca", required=True, metavar="CA.crt", help="the coordinator's tls/ca.crt")
    join.add_argument("--key", required=True, metavar="DIR", help="the folder `robust node keygen` made")
    join.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    join.add_argument("--data", default="digits", help="the data set this node trains on, or your loader package.module:load (default digits)")
    join.add_argument("--path", default="", metavar="DIR", help="folder of your own loader's module (for --data package.module:load)")
    join.add_argument("--trust-code", action="append", default=[], metavar="SHA256",
                      help="run the coordinator's code bundle with this SHA-256 (repeatable; else the node asks, or refuses)")
    join.add_argument("--data-root", help="folder of local files for mnist / fashion-mnist / cifar10 / hf-disk / text")
    join.add_argument("--partition", default="1/1", metavar="I/N", help="train on part I of N (iid split; default 1/1)")
    join.add_argument("--attack", default="", metavar="SPEC", help=f"Byzantine test node: {_NODE_BEHAVIOURS}")
    join.add_argument("--slow", type=float, default=0.0, metavar="S", help="wait a random 0..S seconds before each reply")
    join.add_argument("--profile", default="", metavar="SPEC",
                      help="compute profile: cpu:isa=default|avx2|avx512 (the level PyTorch and oneDNN run at, as "
                           "another CPU would) or cuda; its threads come from each task (default: this machine's best)")
    demo = sub.add_parser("demo", help="a whole federation on loopback: coordinator, 5 volunteers (1 Byzantine)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--rounds", type=int, default=5)
    demo.add_argument("--json", action="store_true", help="end with one JSON line: accuracy, SHA-256, rejected, flagged")
    demo.add_argument("--keep", metavar="DIR", help="run in DIR and keep it (default: a temporary folder)")
    demo.add_argument("--attack", default="label-flip", metavar="SPEC",
                      help=f"what the Byzantine volunteer (node5) plays, or none (default label-flip): {_NODE_BEHAVIOURS}")
    demo.add_argument("--spot-check", type=float, default=0.0, metavar="P",
                      help="share of updates recomputed by another volunteer each round; a fabricated one convicts its author")
    _add_dashboard(demo, "serve the run's web dashboard on [HOST:]PORT, and keep serving it after the run until Ctrl-C")
    board = sub.add_parser("dashboard", help="serve a run folder's web dashboard, read-only (while it runs, or after)")
    board.add_argument("dir", metavar="DIR", help=_RUN_DIR)
    _add_dashboard(board, "where to serve it (default 127.0.0.1:8050)", default="127.0.0.1:8050",
                   flags=("--bind", "--token"))
    audit = sub.add_parser("audit", help="verify a coordinator folder: hash chain, signatures, every aggregation recomputed")
    asub = audit.add_subparsers(dest="action", metavar="ACTION", required=True)
    verify = asub.add_parser("verify", help="check DIR's round log and stored updates; exit 0 when all holds")
    verify.add_argument("dir", metavar="DIR", help=_RUN_DIR)
    for p in (coord, node, demo, board, audit):
        p.set_defaults(run=_federation)


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors in one line, as every other usage error (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = Parser(
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
    run.add_argument("--cluster", metavar="ray|ray://HOST:PORT", help="run the cells as tasks on a running Ray cluster "
                     "(ray: the one at RAY_ADDRESS); robust[cluster] on every node")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a scenario key (repeatable)")
    run.add_argument("--path", metavar="DIR", help="folder of your model / dataset modules (the scenario key code)")
    run.add_argument("--no-vectorize", action="store_true", help="compute each node's update one by one, as a volunteer does")
    run.add_argument(
        "--engine", choices=("local", "flower", "deploy"), default="local",
        help="local (in-process, default); flower: Flower's simulation engine, one simulated SuperNode "
             "per node; deploy: real SuperLink and SuperNodes on loopback (node-side attacks only). "
             "flower and deploy give the same model_sha256 as --no-vectorize",
    )
    run.add_argument("--sweep", metavar="ATTACK:PARAM=LO..HI", help="stealth frontier: sweep any one parameter of an attack, "
                     "the others fixed, e.g. alie:z=0.1..3 or evade:detector=all,dir=ipm,max=0.5..4")
    run.add_argument("--sweep-points", type=int, default=8, help="values in the sweep (default 8)")
    run.add_argument("--speed", action="store_true", help="also time the engine against a plain per-node loop "
                     "on the first scenario (about 7 s; DIR/speed.json and the report's Speed section)")
    run.add_argument("--tune", action="store_true", help="first choose each rule's hyperparameters (declared ranges) by "
                     "their worst case over the scenario's attacks on validation seeds, then run the grid with the "
                     "chosen ones on the scenario's seeds (DIR/tune.json, the report's Tuning section)")
    run.add_argument("--tune-budget", type=float, default=3600.0, metavar="SECONDS",
                     help="--tune: wall seconds the choice may take (default 3600); candidates left are reported")
    run.add_argument("--tune-seeds", type=int, default=2, metavar="N",
                     help="--tune: validation seeds (1000, 1001, ...; default 2), none of them a seed of the scenario")
    run.set_defaults(run=_bench)
    listing = sub.add_parser("attacks", help="list every attack a spec may name: its kind (omniscient or node) and its file")
    listing.set_defaults(run=_attacks)
    _federation_parsers(sub)
    dep = sub.add_parser("deploy-bench", help="the deployment's round overhead beside Flower's FedAvg, on loopback")
    dep.add_argument("--nodes", type=int, default=10)
    dep.add_argument("--rounds", type=int, default=4)
    dep.add_argument("--model", default="wide-mlp", help="default wide-mlp: 1.1M parameters on digits")
    dep.add_argument("--aggregator", default="trimmed-mean")
    dep.add_argument("--tolerate", type=int, default=2)
    dep.add_argument("--keep", metavar="DIR", help="work in DIR and keep it")
    dep.add_argument("--json", metavar="FILE", help="also write every round's times")
    dep.set_defaults(run=_deploy_bench)

    stress = sub.add_parser("stress", help="reliability benchmark: N volunteers on loopback, faults, kills; replies lost, crashes, memory")
    stress.add_argument("--nodes", type=int, default=10)
    stress.add_argument("--rounds", type=int, default=3)
    stress.add_argument("--faults", metavar="FAULT,...", help="protocol faults, one node each, e.g. dtype-lie,oversize,decline,slow-drip")
    stress.add_argument("--light", action="store_true", help="light nodes: one process drives every node's authenticated "
                        "session, replaying precomputed rows (hundreds fit on one machine)")
    stress.add_argument("--attack", metavar="SPEC", help="with --light: what the last max(1, nodes/10) send "
                        "(any attack, omniscient ones too; none: every node honest; default alie)")
    stress.add_argument("--kill", type=float, default=0.0, metavar="P", help="share of volunteers SIGKILLed mid-round and restarted, each round")
    stress.add_argument("--deadline", type=float, default=0.0, metavar="S", help="round deadline (default max(60, 6 x nodes) s; 30 s with --light)")
    stress.add_argument("--seed", type=int, default=0, help="the nodes' keys and which nodes are killed")
    stress.add_argument("--keep", metavar="DIR", help="work in DIR and keep it")
    stress.add_argument("--json", action="store_true", help="end with one JSON line: every round's counts")
    stress.set_defaults(run=_stress)

    field = sub.add_parser("field", help="the field lab: a scenario deployed for real on this machine, each volunteer "
                           "in its own network namespace behind a shaped link (root)")
    field.add_argument("--config", metavar="FILE", help="scenario TOML (the bench's); it needs target-accuracy")
    field.add_argument("--out", metavar="DIR", required=True, help="results folder (DIR/results.jsonl)")
    field.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a scenario key (repeatable)")
    field.add_argument("--cpu", type=float, default=1.0, metavar="SHARE", help="each volunteer's trainer's share of "
                       "one CPU at speed 1 (a node k times slower gets SHARE/k; default 1)")
    field.add_argument("--json", action="store_true", help="end with one JSON line per cell")
    field.add_argument("--calibrate", metavar="FILE", help="write what Flower and the coordinator add to the clock, "
                       "measured on this (synchronous, unshaped) scenario; a scenario's calibration key then names FILE")
    field.set_defaults(run=_field)

    bench = sub.add_parser(
        "agg-bench",
        help="time every aggregation rule against Flower's built-in ones (and ByzFL's: --peers)",
        description="Time every aggregation rule (median of repeats) and Flower's built-in "
        "equivalents on the same inputs, in turns, each call on fresh inputs; print ms, speed-up over "
        "Flower and peak extra memory.",
    )
    bench.add_argument("--quick", action="store_true", help="one small size (20x100000): about a minute")
    bench.add_argument(
        "--sizes", metavar="NxD,...", help="sizes to time, e.g. 100x1000000,50x1000000 "
        "(default: 20x100000,50x1000000,100x1000000)",
    )
    bench.add_argument("--rules", metavar="SPEC,...", help="specs to time (default: every rule, and the pre-aggregators before trimmed-mean)")
    bench.add_argument("--repeats", type=int, default=5, help="timed calls per method (median reported; default 5)")
    bench.add_argument("--budget", type=float, default=60.0, metavar="S", help="begin no more turns of calls once they "
                       "have taken S seconds per method (default 60)")
    bench.add_argument("--no-flower", action="store_true", help="skip Flower's implementations")
    bench.add_argument("--peers", action="store_true", help="time ByzFL's equivalents too (pip install --no-deps "
                       "byzfl==0.0.11), in the same turns on the same input, and print per rule robust's, ByzFL's "
                       "and Flower's median ms, the ratio fastest peer / robust and issue 41's target at 100x1000000")
    bench.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.add_argument("--out-of-core", action="store_true", help="spool the rows to disk first (one file per row) "
                       "and run each rule from the spool: seconds, peak memory, bytes read, x one read of the spool")
    bench.add_argument("--spool", metavar="DIR", help="where --out-of-core writes its spool (default: the temp folder)")
    bench.add_argument("--keep-spool", action="store_true", help="leave the --out-of-core spool on disk")
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="where our rules run, as the coordinator's device setting: the rows' blocks are moved "
                       "there as they are read (auto: cuda when torch sees a GPU; default auto)")
    bench.set_defaults(run=_agg_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    # Before torch is imported: back large tensors with huge pages (first touch of a fresh
    # 400 MB update matrix: 126 ms -> 52 ms here). Flower/NumPy already do this for arrays.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # Flower (imported by the federation commands) must not phone home.
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    p = parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a usage error already said in one line
        return done.code if isinstance(done.code, int) else 2
    if not getattr(args, "run", None):
        p.print_help()
        return 0
    try:
        return args.run(args)
    except ValueError as err:  # a usage error: its message says what to change
        print(f"robust {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a runtime failure: its message says where to look
        print(f"robust {args.command}: failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"robust {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
