"""Dispatch of ``robust coordinator|node|demo|dashboard|audit`` (parsed in ``robust/cli.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .settings import Settings

def _overrides(args: argparse.Namespace) -> dict:
    """The Settings fields given on the command line (``None``: not given)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)}


def run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from .demo import demo

        return demo(args.seed, args.rounds, args.json, args.keep, args.attack, args.spot_check,
                    args.dashboard, args.dashboard_token)
    if args.command == "dashboard":
        from .dashboard.server import main

        return main(args.dir, args.dashboard, args.dashboard_token)
    if args.command == "audit":
        from .coordinator.audit import main

        return main(args.dir)
    folder = Path(getattr(args, "dir", None) or args.key)
    if args.command == "node" and args.action == "join":
        from .volunteer.join import node_join  # loads no PyTorch: the volunteer's trainer does

        return node_join(folder, args.coordinator, Path(args.ca), args.device, args.data, args.data_root,
                         args.partition, args.attack, args.slow, args.path, args.trust_code, args.profile)
    from . import commands

    if args.command == "coordinator":
        if args.action == "init":
            commands.coordinator_init(folder, args.host, Settings.of(_overrides(args)))
            return 0
        if args.action == "admit":
            commands.coordinator_admit(folder, Path(args.public))
            return 0
        if args.action == "status":
            from .coordinator.status import main

            return main(folder, args.json)
        if args.action == "replay":
            from .coordinator.audit import replay_main

            return replay_main(str(folder))
        return commands.coordinator_start(folder, _overrides(args), dashboard=(args.dashboard, args.dashboard_token))
    commands.node_keygen(folder)
    return 0
