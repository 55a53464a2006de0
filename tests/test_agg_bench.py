"""``robust agg-bench`` times real work: every call of a rule starts from a fresh source, a fresh
aggregator and a fresh input tensor, so no call reuses what an earlier one computed (issue 41)."""

import pytest
import torch

import aggregators
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
        for kind in (Memory, Spooled):
            monkeypatch.setattr(kind, "blocks", self.counted(kind.blocks))

    def counted(self, blocks):
        def spied_blocks(source):
            for start, block in blocks(source):
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
