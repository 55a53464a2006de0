"""A coordinator whose rows wait on disk (``spool = disk``) plays the rounds of one whose rows
wait in memory, bit for bit, keeps only what ``keep-updates`` says, and its audit verifies."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil

import numpy as np
import pytest

from robust import codecs

from nodes import checkpoint, commands, launch
from nodes.coordinator import audit, disk
from nodes.coordinator.coordinator import Coordinator
from nodes.coordinator.disk import project
from nodes.settings import Settings

from .federation_kit import make_federation, play

SETTINGS = Settings(rounds=3, aggregator="nnm+trimmed-mean", tolerate=1, quorum=3, protocol="delta:steps=4",
                    spot_check=0.5, verifier="self")
# wall-clock figures, and what an ECDSA signature (randomised) changes: the only fields that may differ
VARIES = ("seconds", "train_seconds_max", "costs", "prev")


def run(root, spool: str, keep: str, compression: str = "none") -> tuple[list[dict], Coordinator]:
    settings = dataclasses.replace(SETTINGS, spool=spool, keep_updates=keep, compression=compression)
    folder, nodes = make_federation(root, 5, settings)
    coord = Coordinator(folder)
    while not coord.done:
        # node 5 sends a forged (scaled) update: spot checks and the flag policy act on spooled rows too
        play(coord, nodes, {5: "forge:scale=0.9", 2: "nan"})
    lines = (folder / checkpoint.ROUNDS).read_text().splitlines()
    records = [{k: v for k, v in json.loads(line).items() if k not in VARIES} for line in lines]
    for r in records:
        for update in r["updates"].values():
            update.pop("signature")
    return records, coord


@pytest.mark.parametrize("keep", ["all", "spot"])
def test_rows_spooled_on_disk_play_the_rounds_of_rows_in_memory(tmp_path, keep):
    in_memory, _ = run(tmp_path / "memory", "memory", keep)
    on_disk, coord = run(tmp_path / "disk", "disk", keep)
    assert coord.spooling and on_disk == in_memory
    assert any(r["spot"] for r in on_disk) and any(r["rejected"] for r in on_disk)
    # the store holds exactly the rows the records say were kept: spooled rows not kept are gone
    stored = {p.stem for p in (coord.folder / audit.UPDATES).glob("*.npy")}
    kept = {u["sha256"] for r in on_disk for fp, u in r["updates"].items()
            if keep == "all" or any(v["author"] == fp for v in r["spot"])}
    assert stored == kept and stored
    problems, rounds, replayed = audit.verify(coord.folder)
    assert problems == [] and rounds == 3 and replayed == (keep == "all")


def test_a_compressed_run_stores_the_encodings_at_the_codecs_size_and_its_audit_decodes_them(tmp_path):
    in_memory, _ = run(tmp_path / "memory", "memory", "all", "int8")
    on_disk, coord = run(tmp_path / "disk", "disk", "all", "int8")
    assert on_disk == in_memory and any(r["convicted"] for r in on_disk)
    codec, d = codecs.build("int8"), coord.engine.w.numel()
    for records, folder in ((in_memory, tmp_path / "memory"), (on_disk, coord.folder)):
        folder = folder if folder == coord.folder else next(folder.glob("**/" + audit.UPDATES)).parent
        stored = {p.name: p.stat().st_size for p in (folder / audit.UPDATES).iterdir()}
        kept = {u["sha256"] + ".npz" for r in records for u in r["updates"].values()}
        assert set(stored) == kept  # no float32 row left behind, spooled or not
        assert all(size < codec.nbytes(d) + 1024 < 4 * d / 3 for size in stored.values())
        assert audit.verify(folder) == ([], 3, True)
    projection = coord.disk()  # the forger is quarantined: 4 nodes asked
    assert (projection.row, projection.per_round) == (codec.nbytes(d), 4 * codec.nbytes(d))
    assert projection.spool == 4 * (4 * d + codec.nbytes(d))  # float32 rows for the rule, the encodings beside
    # a stored encoding changed by one code: the audit says which update, and why
    victim = next(iter((coord.folder / audit.UPDATES).iterdir()))
    with np.load(victim) as npz:
        enc = {name: npz[name].copy() for name in npz.files}
    enc["q"][0] = enc["q"][0] + 1 if enc["q"][0] < 127 else 0
    np.savez(victim, **enc)
    problems, _, _ = audit.verify(coord.folder)
    assert problems and all(f"{victim.name} does not match its SHA-256" in p for p in problems)


def test_auto_spools_once_a_round_would_pass_the_bound(tmp_path, monkeypatch):
    folder, _ = make_federation(tmp_path, 3, SETTINGS)
    coord = Coordinator(folder)
    assert coord.settings.spool == "auto" and not coord.spooling
    from nodes.coordinator import coordinator

    monkeypatch.setattr(coordinator, "SPOOL_ABOVE", 3 * coord.engine.w.numel() * 4 - 1)
    assert coord.spooling


def test_the_start_says_what_a_run_will_store_and_refuses_past_the_free_disk(tmp_path, monkeypatch):
    folder, _ = make_federation(tmp_path, 4, SETTINGS)
    coord = Coordinator(folder)
    d = coord.engine.w.numel()
    projection = coord.disk()
    assert (projection.row, projection.per_round, projection.spool) == (4 * d, 4 * 4 * d, 0)
    assert projection.total == 3 * 4 * 4 * d and "3 rounds" in projection.describe(3)
    spot = project(folder, dataclasses.replace(coord.settings, keep_updates="spot", spool="disk"), d, 4, 3, True)
    assert (spot.per_round, spot.spool) == (2 * 4 * d, 4 * 4 * d)  # spot-check = 0.5 of 4 nodes kept
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(ValueError, match=r"would store .* set keep-updates = spot \(or none\), train fewer rounds"):
        commands.coordinator_start(folder, {})
    assert not (folder / launch.LOGS / "superlink.log").exists()  # refused before any process started


def test_a_disk_that_fills_mid_round_stops_it_and_the_run_resumes_to_the_same_bits(tmp_path, monkeypatch):
    settings = dataclasses.replace(SETTINGS, spool="disk")
    ref_dir, ref_nodes = make_federation(tmp_path / "ref", 4, settings)
    ref = Coordinator(ref_dir)
    while not ref.done:
        play(ref, ref_nodes)
    folder, nodes = make_federation(tmp_path / "run", 4, settings)
    coord = Coordinator(folder)
    play(coord, nodes)
    write = checkpoint.write_atomic

    def full(path, what):  # the disk fills: every write into the store fails
        if path.parent.name == audit.UPDATES:
            with open(os.devnull, "wb") as sink:
                what(sink)
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, what)

    monkeypatch.setattr(checkpoint, "write_atomic", full)
    with pytest.raises(OSError, match="round 2 stopped: .*No space left on device.* resumes after round 1"):
        play(coord, nodes)
    monkeypatch.setattr(checkpoint, "write_atomic", write)  # space is back
    coord = Coordinator(folder)
    assert coord.round == 1
    while not coord.done:
        play(coord, nodes)
    result = lambda f: json.loads((f / checkpoint.RESULT).read_text())["model_sha256"]  # noqa: E731
    assert result(folder) == result(ref_dir)
    assert audit.verify(folder)[0] == []
    assert not list((folder / audit.UPDATES).glob("*.tmp"))
