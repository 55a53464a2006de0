"""Rules that carry rows across rounds (FoolsGold, FLDetector) keep them in a row store on disk
(``robust.rowstore``, ``robust.row_keeper``) with the bits they keep in memory: aggregates, choices,
weights and states, through nodes coming and going and a resume; the store holds exactly the
rows a state names once collected, and a spooled coordinator keeps its rule state there, plays
the rounds of one that keeps it in memory, checkpoints 32 bytes a row, and its audit replays."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch

import aggregators
from aggregators import RoundInputs
from nodes import checkpoint
from nodes.coordinator import audit
from nodes.coordinator.coordinator import Coordinator
from nodes.coordinator.disk import project
from robust.params import sha256
from robust.rowstore import RowStore, names
from robust.source import BLOCK, Memory, Spooled, write_row

from .federation_kit import make_federation, play
from .test_spool_rounds import SETTINGS, VARIES

F64 = torch.float64
D = 2 * BLOCK + 5  # several blocks and a short last one
RULES = ["foolsgold", "fldetector:window=2", "fldetector:window=3,base=mean"]


def rounds(count: int, dtype: torch.dtype):
    """``(ids, rows, w)`` per round: 8 honest nodes follow the model (``x = h w + b_i`` + noise),
    2 sybils send one goal; node 3 is absent in round 2, node 10 joins in round 3. The model
    moves by the rows' mean (the rules' outputs are compared, not used)."""
    g = torch.Generator().manual_seed(0)
    h, b = torch.rand(D, generator=g, dtype=F64) + 0.5, torch.randn(11, D, generator=g, dtype=F64)
    goal, w = 3 * torch.randn(D, generator=g, dtype=F64), torch.randn(D, generator=g, dtype=F64)
    for t in range(count):
        nodes = [i for i in range(11 if t >= 3 else 10) if (i, t) != (3, 2)]
        X = torch.stack([goal if i in (8, 9) else h * w + b[i] for i in nodes])
        X += 0.01 * torch.randn(X.shape, generator=g, dtype=F64)
        yield tuple(f"node{i:02d}" for i in nodes), X.to(dtype), w.to(dtype)
        w = w - 0.1 * X.mean(dim=0)


def spooled(folder, X: torch.Tensor, tag: str) -> Spooled:
    paths = [folder / f"{tag}-{i}.npy" for i in range(X.shape[0])]
    for path, row in zip(paths, X):
        write_row(path, row)
    return Spooled(paths, chunk_bytes=2 * X.shape[0] * BLOCK * X.element_size())  # reads across blocks


def values(agg: aggregators.Chain, store: RowStore) -> dict[str, torch.Tensor]:
    """The chain's state with every reference replaced by the row it names."""
    def value(v: torch.Tensor) -> torch.Tensor:
        if v.dtype != torch.uint8:
            return v
        rows = [Spooled([store.path(sha)]).row(0) for sha in (bytes(r.tolist()).hex() for r in v.reshape(-1, 32))]
        return torch.stack(rows).reshape(*v.shape[:-1], -1)
    return {k: value(v) for k, v in agg.state().items()}


def resumed(agg: aggregators.Chain, store: RowStore | None) -> aggregators.Chain:
    """A new chain loaded from ``agg.state()`` through torch.save/load, given ``store`` first."""
    buffer = io.BytesIO()
    torch.save(agg.state(), buffer)
    other = aggregators.build(agg.spec, agg.f)
    if store is not None:
        other.spill(store)
    other.load_state(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    return other


def assert_same(a: aggregators.Chain, b: aggregators.Chain, store: RowStore) -> None:
    assert torch.equal(a.last_kept, b.last_kept)
    if a.rule.name == "foolsgold":
        assert torch.equal(a.rule.last_weights, b.rule.last_weights)
    mine, theirs = a.state(), values(b, store)
    assert list(mine) == list(theirs)
    for k, v in mine.items():
        assert v.dtype == theirs[k].dtype and torch.equal(v, theirs[k]), k
        assert torch.equal(v.signbit(), theirs[k].signbit()), k  # zeros keep their sign


@pytest.mark.parametrize("spec", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("kind", ["memory", "spooled"])
def test_a_rule_keeps_the_bits_of_its_state_on_disk(tmp_path, spec, dtype, kind):
    store = RowStore(tmp_path / "state")
    in_memory, on_disk = aggregators.build(spec, 2), aggregators.build(spec, 2)
    on_disk.spill(store)
    again = again_memory = None
    dropped = False
    for t, (ids, X, w) in enumerate(rounds(6, dtype)):
        source = spooled(tmp_path, X, f"r{t}") if kind == "spooled" else Memory(X)
        expected = in_memory(X, RoundInputs(ids=ids, w=w))
        assert torch.equal(on_disk(source, RoundInputs(ids=ids, w=w)), expected)
        assert_same(in_memory, on_disk, store)
        if again is not None:  # resumed from the states after round 2: the same bits again
            assert torch.equal(again(source, RoundInputs(ids=ids, w=w)), expected)
            assert torch.equal(again_memory(X, RoundInputs(ids=ids, w=w)), expected)
            assert_same(in_memory, again, store)
        named = names(on_disk.state()) | (names(again.state()) if again is not None else set())
        dropped |= bool(store.collect(named))
        assert {p.stem for p in store.folder.iterdir()} == named  # exactly the named rows, nothing else
        if t == 2:
            again, again_memory = resumed(on_disk, store), resumed(in_memory, None)
    assert dropped and not bool(in_memory.last_kept.all())  # old rows went; the rounds include exclusions
    assert all(v.dtype == torch.uint8 and v.shape[-1] == 32 for k, v in on_disk.state().items()
               if not k.startswith("0.scores."))  # 32 bytes a row in a checkpoint


def test_state_kept_in_memory_moves_to_the_store_when_spilled(tmp_path):
    a, b = aggregators.build("fldetector:window=2", 2), aggregators.build("fldetector:window=2", 2)
    store = RowStore(tmp_path / "state")
    for t, (ids, X, w) in enumerate(rounds(5, torch.float32)):
        if t == 3:  # rows spooled from now on: the rows held in memory are written to the store
            b.spill(store)
        assert torch.equal(a(X, RoundInputs(ids=ids, w=w)), b(X, RoundInputs(ids=ids, w=w)))
    assert_same(a, b, store)
    b.spill(store)  # again, the same store: nothing changes
    with pytest.raises(ValueError, match="keeps its rows in .* already: build a new aggregator"):
        b.spill(RowStore(tmp_path / "elsewhere"))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_row_written_block_by_block_is_the_file_write_row_writes(tmp_path, dtype):
    row = torch.randn(D, dtype=dtype)
    row[7] = -0.0
    writer = RowStore(tmp_path / "state").writer(D, dtype)
    for s in range(0, D, 1000):  # blocks of any width
        writer.add(row[s : s + 1000])
    sha = writer.finish()
    write_row(tmp_path / "whole.npy", row)
    assert sha == sha256(row)  # the row's identity, as the audit's store names rows
    assert (tmp_path / "state" / f"{sha}.npy").read_bytes() == (tmp_path / "whole.npy").read_bytes()
    assert [p.name for p in (tmp_path / "state").iterdir()] == [f"{sha}.npy"]  # no temporary file left


def played(tmp_path) -> tuple[aggregators.Chain, dict, RowStore]:
    store = RowStore(tmp_path / "state")
    agg = aggregators.build("foolsgold", 2)
    agg.spill(store)
    for ids, X, w in rounds(2, torch.float32):
        agg(X, RoundInputs(ids=ids, w=w))
    store.collect(names(agg.state()))
    return agg, agg.state(), store


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.unlink(), "is missing from"),
    (lambda p: p.write_bytes(p.read_bytes()[:-8]), "is cut short or too long in"),
    (lambda p: p.write_bytes(b"not a row"), r"does not load \(ValueError\) in"),
])
def test_a_missing_or_damaged_row_says_what_to_do(tmp_path, damage, message):
    agg, state, store = played(tmp_path)
    sha = sorted(names(state))[0]
    damage(store.path(sha))
    what = rf"^rule state row {sha[:12]} {message} .*state: .*\({sha}\.npy\).* restore .*state together with that"
    with pytest.raises(ValueError, match=what):  # on resume
        fresh = aggregators.build("foolsgold", 2)
        fresh.spill(store)
        fresh.load_state(state)
    ids, X, w = next(rounds(1, torch.float32))
    with pytest.raises(ValueError, match=what):  # on the next read
        agg(X, RoundInputs(ids=ids, w=w))


def test_a_rule_in_memory_refuses_a_state_that_names_stored_rows(tmp_path):
    _, state, _ = played(tmp_path)
    message = r"keeps its rows in memory: resume with the rule's row store \(spool = disk\)"
    with pytest.raises(ValueError, match=message):
        aggregators.build("foolsgold", 2).load_state(state)


# ------------------------------------------------------------------ the coordinator


ATTACKS = {5: "forge:scale=0.9", 2: "nan"}


def federation(root, spec: str, spool: str):
    settings = dataclasses.replace(SETTINGS, rounds=4, aggregator=spec, spool=spool, keep_updates="all")
    return make_federation(root, 5, settings)


def records(folder) -> list[dict]:
    """The round log, less what may differ between two runs of the same rounds."""
    out = [{k: v for k, v in json.loads(line).items() if k not in VARIES}
           for line in (folder / checkpoint.ROUNDS).read_text().splitlines()]
    for r in out:
        for update in r["updates"].values():
            update.pop("signature")
    return out


def coordinate(root, spec: str, spool: str, resume_after: int | None = None) -> tuple[list[dict], Coordinator]:
    folder, nodes = federation(root, spec, spool)
    coord = Coordinator(folder)
    while not coord.done:
        play(coord, nodes, ATTACKS)
        if coord.round == resume_after:  # a restart: the rule's state comes back from the checkpoint
            coord = Coordinator(folder)
    return records(folder), coord


def stored(folder) -> set[str]:
    return {p.name for p in (folder / audit.STATE).iterdir()}


@pytest.mark.parametrize("spec", ["foolsgold", "fldetector:window=2"])
def test_a_spooled_coordinator_keeps_its_rule_state_on_disk(tmp_path, spec, monkeypatch):
    in_memory, coord = coordinate(tmp_path / "memory", spec, "memory")
    assert coord.rowstore is None and not (coord.folder / audit.STATE).exists()
    on_disk, coord = coordinate(tmp_path / "disk", spec, "disk", resume_after=2)
    assert coord.rowstore is not None and on_disk == in_memory
    chain = checkpoint.load(coord.folder)["engine"]["chain"]
    rows = {k: v for k, v in chain.items() if ".scores." not in k}
    assert rows and all(v.dtype == torch.uint8 and v.shape[-1] == 32 for v in rows.values())  # no (d,) tensor
    assert stored(coord.folder) == {f"{sha}.npy" for sha in names(chain)}  # rows no checkpoint names are gone
    replay, real = [], audit._replay_store
    monkeypatch.setattr(audit, "_replay_store", lambda *a: replay.append(real(*a)) or replay[-1])
    problems, count, replayed = audit.verify(coord.folder)
    assert problems == [] and count == 4 and replayed  # every round recomputed bit for bit
    assert replay[0] is not None and replay[0].folder.parent.parent == coord.folder  # its rows on the run's disk
    assert not list(coord.folder.glob(".replay-*"))  # in its own store, removed after
    next((coord.folder / audit.STATE).iterdir()).unlink()
    with pytest.raises(ValueError, match=r"does not fit this run \(ValueError: rule state row [0-9a-f]{12} is missing"):
        Coordinator(coord.folder)  # a restart says so, before any round


def test_a_round_that_dies_before_its_checkpoint_resumes_from_the_rows_the_last_one_names(tmp_path, monkeypatch):
    reference, _ = coordinate(tmp_path / "memory", "foolsgold", "memory")
    folder, nodes = federation(tmp_path / "disk", "foolsgold", "disk")
    coord = Coordinator(folder)
    for _ in range(2):
        play(coord, nodes, ATTACKS)
    named = stored(folder)
    save = checkpoint.save

    def dies(*_):  # the process dies as it writes round 3's checkpoint
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        play(coord, nodes, ATTACKS)
    monkeypatch.setattr(checkpoint, "save", save)
    assert stored(folder) > named  # round 3 wrote its histories; the ones round 2's checkpoint names are kept
    coord = Coordinator(folder)
    assert coord.round == 2 and stored(folder) == named  # the dead round's rows are collected
    while not coord.done:
        play(coord, nodes, ATTACKS)
    assert records(folder) == reference


def test_the_projection_counts_the_rule_state(tmp_path):
    settings = dataclasses.replace(SETTINGS, aggregator="foolsgold", spool="disk")
    folder, _ = make_federation(tmp_path, 4, settings)
    coord = Coordinator(folder)
    d = coord.engine.w.numel()
    projection = coord.disk()
    assert projection.state == 2 * 4 * 4 * d  # old and new histories of 4 nodes
    assert projection.total == 3 * 4 * 4 * d + 4 * 4 * d + projection.state
    assert "keeps up to" in projection.describe(3) and "of rule state in state/" in projection.describe(3)
    plain = project(folder, settings, d, 4, 3, True)
    assert plain.state == 0 and "rule state" not in plain.describe(3)
