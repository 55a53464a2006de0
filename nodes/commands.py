"""``robust coordinator ...`` and ``robust node keygen``: what each command does, step by step
(``robust node join``, which loads no PyTorch, is ``nodes.volunteer.join``)."""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from robust import keys, tls

from . import checkpoint, launch
from .checkpoint import RUN_ID
from .coordinator.admission import ADMITTED, admit, scan, short
from .coordinator.disk import check as check_disk
from .coordinator.precheck import checked
from .coordinator.status import live_bar, read_rounds
from .dashboard.server import parse_bind, serving
from .settings import COORDINATOR, SETTINGS_FILE, Settings


def coordinator_init(folder: Path, hosts: list[str], settings: Settings, run_id: str | None = None) -> None:
    if (folder / SETTINGS_FILE).exists():
        raise ValueError(f"{folder} already holds a coordinator: use it with `robust coordinator start {folder}`, or pick a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    ca = tls.make_certificates(folder / "tls", hosts)
    (folder / SETTINGS_FILE).write_text(settings.to_toml())
    (folder / RUN_ID).write_text((run_id or secrets.token_hex(8)) + "\n")
    (folder / ADMITTED).mkdir(exist_ok=True)
    launch.prepare_coordinator(folder, settings.port, settings.code)
    print(f"coordinator folder {folder} ready")
    _say_code(folder, settings)
    print(f"  give volunteers the CA certificate {ca}")
    print(f"  admit each volunteer's key:  robust coordinator admit {folder} NODE.pub")
    print(f"  then:                        robust coordinator start {folder}")


def _say_code(folder: Path, settings: Settings) -> None:
    if settings.code:
        sha = (folder / launch.CODE_SHA).read_text().strip()
        print(f"  code bundle {sha} ({settings.code}, also in {folder / launch.CODE_SHA}): volunteers run it "
              f"once they accept it (robust node join ... --trust-code {sha})", flush=True)


def coordinator_admit(folder: Path, public_file: Path) -> None:
    settings = Settings.read(folder)
    fp = admit(folder, public_file)
    print(f"admitted node {fp[:12]} ({fp})")
    if launch.answers(settings.port):  # a running coordinator: let the node in now
        failed = launch.register(folder, [folder / ADMITTED / f"{fp}.pub"])
        print("  registered with the running SuperLink: it is asked from the next round" if not failed
              else f"  the running SuperLink refused it ({next(iter(failed.values()))}); it is registered at the next start")


def _describe(record: dict, rounds: int) -> str:
    def names(ids) -> str:
        return " ".join(short(fp) for fp in ids)

    what = "buffer" if "staleness" in record else "round"
    parts = [f"{what} {record['round']}/{rounds}", f"accepted {record['accepted']}/{record['asked']}"]
    if record["rejected"]:
        parts.append("rejected " + ", ".join(f"{short(k)}: {v}" for k, v in record["rejected"].items()))
    if record["failed"]:
        parts.append("failed " + ", ".join(f"{short(k)}: {v}" for k, v in record["failed"].items()))
    if record["missing"]:
        parts.append("no reply " + names(record["missing"]))
    if record["flagged"]:
        parts.append("flagged " + names(record["flagged"]))
    if record.get("rested"):
        parts.append("rested " + names(record["rested"]))
    if record.get("staleness"):
        parts.append("staleness " + " ".join(f"{short(k)}:{v}" for k, v in record["staleness"].items()))
    if record["skipped"]:
        parts.append(record["skipped"])
    parts.append(f"accuracy {record['accuracy']:.3f}")
    parts.append(f"{record['seconds']:.1f} s")
    return "  ".join(parts)


def coordinator_start(folder: Path, overrides: dict, on_ready: Callable[[], None] | None = None,
                      dashboard: tuple[str | None, str] = (None, "")) -> int:
    """Start the SuperLink, register the admitted keys, submit the run and follow it.
    ``on_ready`` is called once volunteers can connect (the demo starts its nodes there);
    ``dashboard``: ``([HOST:]PORT, token)`` to serve the run's dashboard meanwhile."""
    if dashboard[0]:
        parse_bind(dashboard[0])  # a bad address is said before anything starts
    settings, done_rounds, disk = checked(folder, overrides)  # in a child process: see there
    found, _ = scan(folder)
    if done_rounds >= settings.rounds:
        print(f"{folder} already finished {done_rounds} rounds: pass --rounds N (N > {done_rounds}) to train more")
        return 0
    check_disk(disk, folder, settings.rounds - done_rounds)
    launch.prepare_coordinator(folder, settings.port, settings.code)
    (folder / checkpoint.RESULT).unlink(missing_ok=True)
    (folder / checkpoint.FAILED).unlink(missing_ok=True)
    print(f"starting SuperLink on {settings.bind}:{settings.port} (TLS, node authentication on), "
          f"{len(found)} admitted node(s)" + (f", resuming after round {done_rounds}" if done_rounds else ""), flush=True)
    print(f"  the run {disk.describe(settings.rounds - done_rounds)}", flush=True)
    _say_code(folder, settings)
    with serving(folder, *dashboard):
        return _run(folder, settings, found, on_ready)


def _run(folder: Path, settings: Settings, found: dict, on_ready: Callable[[], None] | None) -> int:
    superlink = launch.start_superlink(folder, settings.bind, settings.port)
    run_id = None
    launch.stop_on_sigterm()
    try:
        failed = launch.register(folder, sorted(path for path, _ in found.values()))
        for path, message in failed.items():
            print(f"warning: could not register {path.name}: {message}", flush=True)
        if on_ready is not None:
            on_ready()
        run_id = launch.submit_run(folder)
        if settings.round == "async":  # `rounds` counts buffers
            print(f"run {run_id} submitted: {settings.rounds} asynchronous buffers of "
                  f"{settings.buffer_for(len(found))} replies, {settings.aggregator} (f={settings.tolerate}), "
                  f"staleness {settings.staleness}" + (f", max-staleness {settings.max_staleness}"
                                                       if settings.max_staleness else ""), flush=True)
        else:
            print(f"run {run_id} submitted: {settings.rounds} rounds of {settings.aggregator} (f={settings.tolerate}), "
                  f"quorum {settings.quorum_needed}, deadline {settings.deadline:g} s", flush=True)
        return _follow(folder, run_id, settings, superlink)
    except KeyboardInterrupt:
        if run_id:
            launch.flwr(folder, "stop", run_id, launch.CONNECTION, timeout=30)
        print(f"\nstopped after round {len(read_rounds(folder))}; "
              f"`robust coordinator start {folder}` resumes from there", flush=True)
        return 130
    finally:
        launch.stop(superlink)


STATUS_EVERY = 30.0  # seconds between asking Flower whether the run died (each `flwr ls` costs ~2 s of CPU)


def _follow(folder: Path, run_id: str, settings: Settings, superlink) -> int:
    """Print each round as the ServerApp records it; return when the run ends. At a terminal a
    live bar under the lines shows the rounds done of the total and the latest accuracy."""
    rounds_file, seen, last_check = folder / checkpoint.ROUNDS, rounds_file_size(folder), 0.0
    bar = live_bar("rounds", transient=True)  # the round lines stay, the bar goes when the run ends
    task = bar.add_task("", total=settings.rounds, completed=len(read_rounds(folder)), last="")

    def print_new_rounds() -> None:
        nonlocal seen
        if rounds_file.exists() and rounds_file.stat().st_size > seen:
            with open(rounds_file, "rb") as src:
                src.seek(seen)
                chunk = src.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next look
            seen += len(complete)
            for line in complete.decode().splitlines():
                record = json.loads(line)
                print(_describe(record, settings.rounds), flush=True)
                bar.update(task, completed=record["round"], last=f"accuracy {record['accuracy']:.3f}")

    with bar:
        while True:
            finished = (folder / checkpoint.RESULT).exists()  # looked at before the rounds: none is missed
            print_new_rounds()
            if finished:
                summary = json.loads((folder / checkpoint.RESULT).read_text())
                print(f"done: final accuracy {summary['final_accuracy']:.4f}, model SHA-256 {summary['model_sha256']}")
                print(f"  model {folder / 'model.pt'}, per-round log {rounds_file}")
                return 0
            if (folder / checkpoint.FAILED).exists():
                print(f"error: the coordinator stopped: {(folder / checkpoint.FAILED).read_text().strip()}")
                return 1
            if superlink.poll() is not None:
                print(f"error: the SuperLink exited (code {superlink.returncode}): see {folder / launch.LOGS / 'superlink.log'}")
                return 1
            if time.monotonic() - last_check > STATUS_EVERY:
                last_check = time.monotonic()
                status, details = launch.run_status(folder, run_id)
                if status.startswith("finished") and not (folder / checkpoint.RESULT).exists():
                    print(f"error: the run ended ({status}): {details}\n" + launch.run_log(folder, run_id)[-3000:])
                    return 1
            time.sleep(0.5)
            launch.raise_if_terminated()


def rounds_file_size(folder: Path) -> int:
    path = folder / checkpoint.ROUNDS
    return path.stat().st_size if path.exists() else 0


def node_keygen(folder: Path, seed: object | None = None) -> None:
    public = keys.write_identity(folder, keys.generate(seed))
    fp = keys.fingerprint(keys.load_private(folder).public_key())
    print(f"node {fp[:12]}: give {public} to the coordinator (robust coordinator admit DIR {public})")


def local_federation(root: Path, nodes: int, settings: Settings, run_id: str, key_seed: tuple) -> tuple[Path, list[Path]]:
    """A coordinator folder ``root/coordinator`` and ``nodes`` admitted volunteers
    ``root/node1..N`` on one machine, their throwaway keys derived from ``(*key_seed, i)``.
    Quiet: the step-by-step hints are for people doing it by hand."""
    coord = root / COORDINATOR
    with contextlib.redirect_stdout(io.StringIO()):
        coordinator_init(coord, [], settings, run_id=run_id)
        for i in range(1, nodes + 1):
            node_keygen(root / f"node{i}", seed=(*key_seed, i))
            coordinator_admit(coord, root / f"node{i}" / keys.PUBLIC_FILE)
    return coord, [root / f"node{i}" for i in range(1, nodes + 1)]
