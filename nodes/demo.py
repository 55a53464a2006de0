"""``robust demo``: a whole federation on loopback, in one command.

A coordinator and five volunteers (the fifth plays ``--attack``: by default it flips its
labels; any node-side attack or protocol fault of ``robust node join --attack``) train digits for a few rounds
over TLS with node authentication; each round is printed; the run ends with the final
accuracy and model SHA-256, and every process started is stopped. Keys and the run id are
derived from ``--seed``, so two demos with the same seed end with the same SHA-256. With
``--spot-check P`` a share ``P`` of the updates is recomputed by another volunteer each
round; ``--dashboard [HOST:]PORT`` serves the run's web page (``nodes.dashboard``) while it
runs and after, until Ctrl-C; ``--json`` ends with one line: the result, the Byzantine node's name, each round's
wall-clock seconds (``round_seconds``, from the round log: tasks sent to round recorded) and
the folder (kept, for ``robust audit verify``).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from robust import keys, tls

from . import commands, launch
from .coordinator.admission import short
from .coordinator.status import read_rounds
from .dashboard.server import serving, wait_for_interrupt
from .settings import Settings

NODES, BYZANTINE = 5, (5,)


def demo(seed: int, rounds: int, as_json: bool, keep: str | None, attack: str = "label-flip",
         spot_check: float = 0.0, dashboard: str | None = None, token: str = "") -> int:
    from .volunteer.volunteer import check_attack

    check_attack(attack)
    settings = Settings(seed=seed, rounds=rounds, aggregator="trimmed-mean", tolerate=1, deadline=60.0,
                        protocol="delta:steps=16", spot_check=spot_check, port=launch.free_port())
    port = settings.port
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="robust-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    procs = []
    coord, _ = commands.local_federation(root, NODES, settings, f"demo-{seed}", ("demo", seed))
    print(f"demo in {root}: coordinator initialised (CA, server certificate), {NODES} volunteer keys "
          "made and admitted", flush=True)

    def start_nodes() -> None:
        for i in range(1, NODES + 1):
            plays = ["--attack", attack] if i in BYZANTINE and attack not in ("", "none") else []
            procs.append(launch.spawn([
                sys.executable, "-m", "robust.cli", "node", "join", "--coordinator", f"127.0.0.1:{port}",
                "--ca", str(coord / "tls" / tls.CA_CERT), "--key", str(root / f"node{i}"),
                "--partition", f"{i}/{NODES}", "--device", "cpu", *plays,
            ], root / f"node{i}", root / f"node{i}" / "join.log"))
        print(f"started {NODES} volunteers (node{', node'.join(map(str, BYZANTINE))} plays {attack or 'none'}); "
              f"their logs: {root}/node*/join.log", flush=True)

    with serving(coord, dashboard, token) as board:
        try:
            code = commands.coordinator_start(coord, {}, on_ready=start_nodes)
        finally:
            for proc in procs:
                launch.stop(proc)
        result = coord / "result.json"
        if code == 0 and result.exists() and as_json:
            byzantine = [short(keys.fingerprint(keys.load_private(root / f"node{i}").public_key()))
                         for i in BYZANTINE]
            seconds = [record["seconds"] for record in read_rounds(coord)]
            print(json.dumps(json.loads(result.read_text()) | {"byzantine": byzantine, "round_seconds": seconds,
                                                                "folder": str(root)}), flush=True)
        if board is not None:
            print(f"the run ended; its dashboard stays at {board.url} until Ctrl-C", flush=True)
            wait_for_interrupt()
    if not keep and code == 0 and not as_json:
        shutil.rmtree(root, ignore_errors=True)
    elif code != 0 or as_json:
        print(f"the demo's files are kept in {root} (`robust audit verify {coord}` checks its log)", file=sys.stderr)
    return code
