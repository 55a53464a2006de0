"""Spot checks and the audit chain, on in-process federations (``federation_kit``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from .federation_kit import fingerprint, make_federation, play
from nodes import checkpoint
from nodes.coordinator import audit
from nodes.coordinator.admission import CONVICTED, admit
from nodes.coordinator.admission import short
from nodes.coordinator.coordinator import Coordinator
from nodes.coordinator.verifier import Checkers
from nodes.engine import spotcheck
from nodes.engine.training import NodeData
from nodes.settings import Settings
from nodes.volunteer.volunteer import check, prepare_data
from nodes.wire import read_task, reply_content, reply_payload
from robust import keys
from robust.params import sha256

SETTINGS = dict(rounds=3, aggregator="trimmed-mean", tolerate=1, protocol="delta:steps=2", batch_size=16)


def test_draw_is_a_seeded_share_and_assign_never_picks_the_author():
    ids = [f"{i:064x}" for i in range(4000)]
    seed = spotcheck.round_seed(0, 1, ids, ["a" * 64] * len(ids))
    drawn = spotcheck.draw(seed, ids, 0.1)
    assert 320 < len(drawn) < 480 and drawn == spotcheck.draw(seed, list(reversed(ids)), 0.1)
    other = spotcheck.round_seed(0, 1, ids, ["b"] + ["a" * 64] * (len(ids) - 1))  # one update differs
    assert spotcheck.draw(other, ids, 0.1) != drawn
    authors = ids[:6]
    chosen = spotcheck.assign(seed, authors, ids[:4])
    assert all(v != a for a, v in chosen.items()) and max(list(chosen.values()).count(v) for v in ids[:4]) == 2
    assert spotcheck.assign(seed, ids[:1], ids[:1]) == {ids[0]: None}


def test_compare_is_bitwise_on_one_profile_and_within_the_tolerance_across():
    honest = torch.linspace(-1, 1, 1000)
    nudged = honest + 1e-7
    assert spotcheck.compare(honest, honest.clone(), True) == (True, 0.0)
    assert not spotcheck.compare(nudged, honest, True)[0]
    assert spotcheck.compare(nudged, honest, False)[0]
    assert not spotcheck.compare(honest * 0.999, honest, False)[0]


def _federation(tmp_path: Path, **changes) -> tuple[Path, list[Path]]:
    return make_federation(tmp_path, 4, Settings(**(SETTINGS | changes)))


def test_self_checks_convict_a_forger_ban_it_and_the_audit_verifies(tmp_path):
    coord_dir, nodes = _federation(tmp_path, spot_check=1.0, verifier="self")
    coord = Coordinator(coord_dir)
    forger = fingerprint(nodes[3])
    first = play(coord, nodes, {4: "forge:scale=0.9"})
    assert first["convicted"] == [forger] and forger not in first["ids"]
    assert first["rejected"][forger].startswith("convicted: its update differs")
    verdict = {v["author"]: v for v in first["spot"]}
    assert verdict[forger]["distance"] > 0.05 and all(v["guilty"] == [] for a, v in verdict.items() if a != forger)
    assert (coord_dir / CONVICTED / f"{forger}.pub").exists() and forger not in coord.keys
    with pytest.raises(ValueError, match="convicted"):
        admit(coord_dir, nodes[3] / keys.PUBLIC_FILE)
    while not coord.done:
        record = play(coord, nodes, {4: "forge:scale=0.9"})
        assert forger not in record["ids"] and record["convicted"] == []
    result = json.loads((coord_dir / checkpoint.RESULT).read_text())
    assert list(result["convicted"]) == [short(forger)] and result["convicted"][short(forger)]["round"] == 1
    assert audit.main(str(coord_dir)) == 0


def test_the_audit_names_the_round_of_a_changed_byte(tmp_path, capsys):
    coord_dir, nodes = _federation(tmp_path)
    coord = Coordinator(coord_dir)
    while not coord.done:
        play(coord, nodes)
    assert audit.verify(coord_dir) == ([], 3, True)
    lines = (coord_dir / checkpoint.ROUNDS).read_text().splitlines()
    update = coord_dir / audit.UPDATES / f"{json.loads(lines[1])['updates'][fingerprint(nodes[0])]['sha256']}.npy"
    data = bytearray(update.read_bytes())
    data[-1] ^= 1  # one bit of the last value
    update.write_bytes(bytes(data))
    problems, _, _ = audit.verify(coord_dir)
    assert problems and all(p.startswith("round 2:") for p in problems) and "does not match its SHA-256" in problems[0]
    data[-1] ^= 1
    update.write_bytes(bytes(data))
    log = (coord_dir / checkpoint.ROUNDS).read_bytes()
    at = log.index(b'"accuracy": ') + len(b'"accuracy": 0.')  # a digit of round 1's accuracy
    (coord_dir / checkpoint.ROUNDS).write_bytes(log[:at] + bytes([(log[at] - 48 + 1) % 10 + 48]) + log[at + 1:])
    problems, _, _ = audit.verify(coord_dir)
    assert problems and problems[0].startswith("round 1:")
    assert audit.main(str(coord_dir)) == 1 and "FAILED round 1" in capsys.readouterr().out


def _checkers(nodes: list[Path], liar: Path | None = None) -> Checkers:
    """Verifiers that answer as ``robust node join``'s ClientApp does (``liar``: scales its checks)."""
    by_fp = {fingerprint(n): n for n in nodes}

    def ask(asked):
        out = {}
        for author, (verifier, content) in asked.items():
            folder = by_fp[verifier]
            task, w, (who, part) = read_task(content)
            reply, row = check(task, w, who, part, lambda d, p: NodeData.load(prepare_data(folder, d, None, p)),
                               keys.load_private(folder), torch.device("cpu"))
            if folder == liar and row is not None:
                row = row * np.float32(1.5)  # a false accusation, honestly signed
                reply = dataclasses.replace(reply, signature=keys.sign(keys.load_private(folder),
                                                                       reply_payload(reply, sha256(torch.from_numpy(row)))))
            out[author] = reply_content(reply, row)
        return out

    return Checkers(sorted(by_fp), ask)


@pytest.mark.parametrize("spool, keep", [("memory", "all"), ("disk", "none")])
def test_volunteers_check_each_other_a_lazy_node_is_convicted_a_false_accuser_too(tmp_path, spool, keep):
    coord_dir, nodes = _federation(tmp_path, spot_check=1.0, verifier="nodes", rounds=2, spool=spool,
                                   keep_updates=keep)
    coord = Coordinator(coord_dir)
    lazy, liar = fingerprint(nodes[0]), fingerprint(nodes[1])
    first = play(coord, nodes, {1: "lazy"}, checkers=_checkers(nodes, liar=nodes[1]))
    verdicts = {v["author"]: v for v in first["spot"]}
    # round 1: the lazy node is honest; whoever node 2 checked is cleared by the coordinator, node 2 convicted
    assert first["convicted"] == [liar]
    accused = next(a for a, v in verdicts.items() if v["verifier"] == liar)
    assert verdicts[accused]["guilty"] == [liar] and verdicts[accused]["note"] == "refereed by the coordinator"
    assert all(v["distance"] == 0.0 for a, v in verdicts.items() if v["verifier"] != liar)  # same profile: bit for bit
    # the evidence (the accused's row and the false check) is kept, whatever keep-updates and spool say
    evidence = {first["updates"][accused]["sha256"], verdicts[accused]["check"]["sha256"]}
    assert all(audit.row_path(coord_dir, sha).exists() for sha in evidence)
    if keep == "none":
        assert {p.stem for p in (coord_dir / audit.UPDATES).iterdir()} == evidence
    second = play(coord, nodes, {1: "lazy"}, checkers=_checkers(nodes))
    assert second["convicted"] == [lazy] and sorted(second["ids"]) == sorted(map(fingerprint, nodes[2:]))
    assert audit.verify(coord_dir) == ([], 2, keep == "all")


def test_a_silent_verifier_leaves_the_check_to_the_coordinator(tmp_path):
    coord_dir, nodes = _federation(tmp_path, spot_check=1.0, verifier="nodes", rounds=1)
    coord = Coordinator(coord_dir)
    record = play(coord, nodes, {3: "forge:scale=0.9"}, checkers=Checkers([fingerprint(n) for n in nodes], lambda asked: {}))
    assert record["convicted"] == [fingerprint(nodes[2])]
    assert all(v["note"].endswith("no reply before the deadline; checked by the coordinator") for v in record["spot"])
