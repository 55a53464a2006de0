"""``robust agg-bench`` times real work: every call of a rule starts from a fresh source, a fresh
aggregator and a fresh input tensor, so no call reuses what an earlier one computed; ``--peers``
times robust's rules, ByzFL's and Flower's in turns on the same input (issue 41)."""

import contextlib
import io
import json

import pytest
import torch

import aggregators
from evaluation.microbench import peer_ratios
from evaluation.microbench.aggregation_speed import round_inputs
from evaluation.peers import byzfl_aggregators as byzfl
from evaluation.peers import gram_pass
from robust import cli
from robust.source import BLOCK, Memory, OnDevice, Spooled

N, D = 15, 20000  # f = 3, so bulyan (n >= 4f + 3) runs; three blocks of columns
STARTS = set(range(0, D, BLOCK))
# the rules that keep what they computed with their source (distances, the median) or in their object
RULES = ["krum", "multi-krum", "nnm+krum", "bulyan", "geometric-median", "centered-clipping", "median",
         "trimmed-mean"]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


class Spy:
    """Every chain call (its aggregator, its source, the memos it found) and, per source
    object, the block starts read from it. Everything seen is held, so no id is reused."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[aggregators.Chain, object, int]] = []
        self.read: dict[object, list[int]] = {}
        call = aggregators.Chain.__call__

        def spied_call(agg, X, inputs=None):
            self.calls.append((agg, X, len(X.memo) + len(base(X).memo)))
            return call(agg, X, inputs)

        monkeypatch.setattr(aggregators.Chain, "__call__", spied_call)
        for kind in (Memory, Spooled):  # either way a pass reads a source's blocks
            for way in ("blocks", "views"):  # read() copies views
                monkeypatch.setattr(kind, way, self.counted(getattr(kind, way)))

    def counted(self, blocks):
        def spied_blocks(source, *args):
            for start, block in blocks(source, *args):
                self.read.setdefault(source, []).append(start)
                yield start, block
        return spied_blocks

    def check_every_call_fresh(self) -> None:
        """Each call found no statistics computed, read every block of its input, and had a
        source of its own."""
        for agg, X, memo in self.calls:
            assert memo == 0, f"{agg.spec}: a call found {memo} statistics already computed"
            assert set(self.read.get(base(X), [])) == STARTS, f"{agg.spec}: a call skipped blocks of its input"
        assert len({id(X) for _, X, _ in self.calls}) == len(self.calls), "a source served two calls"
        assert len({id(base(X)) for _, X, _ in self.calls}) == len(self.calls), "a source served two calls"


def base(X):
    """The source that holds the rows (under the move to the device)."""
    return X.source if isinstance(X, OnDevice) else X


@pytest.mark.parametrize("device", DEVICES)
def test_each_timed_call_starts_from_nothing_an_earlier_call_computed(monkeypatch, capsys, device):
    spy = Spy(monkeypatch)
    assert cli.main(["agg-bench", "--sizes", f"{N}x{D}", "--rules", ",".join(RULES), "--repeats", "2",
                     "--no-flower", "--device", device]) == 0
    assert "skipped" not in capsys.readouterr().out
    assert [agg.spec for agg, _, _ in spy.calls] == [r for r in RULES for _ in range(3)]  # a warm-up, 2 timed
    spy.check_every_call_fresh()
    assert len({id(agg) for agg, _, _ in spy.calls}) == len(spy.calls), "an aggregator served two calls"
    tensors = {base(X).X.data_ptr() for _, X, _ in spy.calls}
    assert len(tensors) == len(spy.calls), "an input tensor served two calls"


def test_out_of_core_reads_a_fresh_spool_source_for_each_call(monkeypatch, tmp_path):
    from evaluation.microbench.out_of_core import WARM

    spy = Spy(monkeypatch)
    rules = ["krum", "median", "centered-clipping", "foolsgold"]
    assert cli.main(["agg-bench", "--out-of-core", "--sizes", f"{N}x{D}", "--spool", str(tmp_path),
                     "--rules", ",".join(rules)]) == 0
    # foolsgold carries rows across rounds: WARM rounds on its aggregator before the measured one
    assert [agg.spec for agg, _, _ in spy.calls] == ["krum", "median", "centered-clipping", *["foolsgold"] * (WARM + 1)]
    spy.check_every_call_fresh()
    assert len({id(agg) for agg, _, _ in spy.calls}) == len(rules), "a rule's aggregator served another rule"


BYZFL = pytest.mark.skipif(byzfl.load() is None, reason=f"ByzFL is not installed here: {byzfl.INSTALL}")
PEER_RULES = ["krum", "median", "centered-clipping"]


@pytest.fixture(scope="module")
def peers(tmp_path_factory) -> tuple[dict, str]:
    """One small ``--peers`` run: its JSON and what it printed."""
    out = tmp_path_factory.mktemp("peers") / "peers.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["agg-bench", "--sizes", "10x20000", "--rules", ",".join(PEER_RULES), "--peers",
                         "--repeats", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_peers_times_robust_and_its_peers_in_turns_on_the_same_input(peers):
    data, printed = peers
    rows = {r["rule"]: r for r in data["results"] if r["kind"] == "peers"}
    assert list(rows) == PEER_RULES
    for rule, row in rows.items():
        methods = [r for r in data["results"] if r["rule"] == rule and r["kind"] != "peers"]
        assert methods[0]["kind"] == "robust"
        assert ("flower" in {r["kind"] for r in methods}) == (rule != "centered-clipping")  # Flower ships no clipping
        # a warm-up turn and two timed ones, every method once per turn, always in the same order
        assert row["order"] == [r["method"] for r in methods] * 3
        assert all(len(r["ms_all"]) == r["calls"] == 2 for r in methods)
        peer_ms = [r["ms"] for r in methods[1:] if r["kind"] != "floor"]
        assert row["ratio"] == pytest.approx(min(peer_ms) / row["robust_ms"])
        assert "target_ratio" not in row  # the targets are set at 100x1000000 only
        assert f"  10x20000    {rule:<28}" in printed
    machine = data["machine"]
    assert machine["torch_threads"] >= 1 and machine["flwr"] and machine["cpu"].startswith("cpu/")


def test_peers_without_byzfl_times_flower_and_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(byzfl, "load", lambda: None)
    out = tmp_path / "peers.json"
    assert cli.main(["agg-bench", "--sizes", "10x20000", "--rules", "krum", "--peers", "--repeats", "1",
                     "--json", str(out)]) == 0
    assert f"ByzFL is not installed, so only Flower's rules are timed beside ours: {byzfl.INSTALL}" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [r["kind"] for r in results] == ["robust", "floor", "flower", "flower", "peers"]
    assert results[-1]["byzfl_ms"] is None and results[-1]["fastest_peer"].startswith("flwr ")


@BYZFL
def test_peers_times_byzfl_beside_flower(peers):
    data, printed = peers
    kinds = {r.get("method"): r["kind"] for r in data["results"] if r["rule"] == "krum"}
    assert sorted(kinds.values()) == ["byzfl", "floor", "flower", "flower", "peers", "robust"]
    assert kinds["byzfl Krum(f=2)"] == "byzfl"
    assert data["machine"]["byzfl"] == "0.0.11"
    row = next(r for r in data["results"] if r["kind"] == "peers" and r["rule"] == "centered-clipping")
    assert row["byzfl_ms"] > 0 and row["flower_ms"] is None  # Flower ships no centered clipping
    assert row["fastest_peer"] == "byzfl CenteredClipping(tau=10.0, L=1)"


@BYZFL
@pytest.mark.parametrize("spec", ["mean", "median", "trimmed-mean", "meamed", "multi-krum", "centered-clipping",
                                  "mda", "monna:idx=3", "smea", "nnm+trimmed-mean", "arc+median", "clip:c=5+mean"])
def test_byzfl_equivalents_take_our_parameters(spec):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(12, 3000, generator=g) + 0.3
    X[:2] *= 20.0  # two loud rows: the clipping and the selections have work to do
    (base,) = byzfl.baselines(spec, X, 2)
    theirs = base.run(base.prepare())
    ours = aggregators.build(spec, 2)(X, round_inputs(X))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_peers_refuses_what_it_cannot_compare(capsys):
    for extra in (["--no-flower"], ["--out-of-core"]):
        assert cli.main(["agg-bench", "--sizes", "10x20000", "--rules", "krum", "--peers", *extra]) == 2
        assert "drop --out-of-core and --no-flower" in capsys.readouterr().err


def test_a_distance_rule_is_timed_against_one_float64_gram_pass(peers):
    data, printed = peers
    krum = next(r for r in data["results"] if r["kind"] == "peers" and r["rule"] == "krum")
    assert krum["x_gram"] == pytest.approx(krum["robust_ms"] / krum["gram_ms"])
    assert "one float64 Gram pass" not in krum["fastest_peer"]  # the floor is no peer
    assert "gram_ms" not in next(r for r in data["results"] if r["kind"] == "peers" and r["rule"] == "median")
    assert "x one float64 Gram pass" in printed
    blocks = gram_pass.baselines("krum", torch.ones(3, 5)), gram_pass.baselines("median", torch.ones(3, 5))
    assert len(blocks[0]) == 1 and blocks[1] == []
    g = torch.Generator().manual_seed(2)
    X = torch.randn(4, BLOCK + 5, generator=g)
    (floor,) = gram_pass.baselines("nnm+trimmed-mean", X)
    torch.testing.assert_close(floor.run(floor.prepare()), X.double() @ X.double().T)


def test_the_targets_are_ratios_to_the_fastest_peer_at_100x1000000():
    def record(kind, method, ms):
        return {"kind": kind, "method": method, "ms": ms, "rule": "krum", "n": 100, "d": 1_000_000, "f": 20}

    ours = record("robust", "krum", 100.0)
    peers = [record("byzfl", "byzfl Krum(f=20)", 150.0), record("flower", "flwr aggregate_krum (legacy)", 300.0)]
    row = peer_ratios.compared(ours, peers, [], "float32")
    assert (row["fastest_peer"], row["ratio"], row["target_ratio"], row["met"]) == ("byzfl Krum(f=20)", 1.5, 2.0, False)
    assert peer_ratios.compared({**ours, "ms": 75.0}, peers, [], "float32")["met"]
    assert "target_ratio" not in peer_ratios.compared(ours, peers, [], "float64")
