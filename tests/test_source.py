"""Rows spooled on disk give every rule and chain the same bits as the same rows in memory."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import aggregators
from aggregators.base import RoundInputs
from robust.source import BLOCK, Memory, Spooled, take_columns, write_row

N = 13
D = 3 * BLOCK + 123  # several blocks and a short last one
CHAINS = [f"{p}+{r}" for p in aggregators.pre_aggregators() for r in ("trimmed-mean", "krum")]
CHAINS += ["arc+nnm+krum", "bucketing:s=2+multi-krum", "clip:c=5+nnm+centered-clipping",
           "arc+foolsgold", "clip:c=3+fldetector:base=mean",
           "centered-clipping:iters=3"]  # 13 rows at iters=1 clip by passes, at iters=3 by the Gram matrix


def rows(dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, D, generator=g, dtype=dtype) + 0.5
    X[:2] *= 40.0  # two loud rows, so the rules have something to choose
    X[5, 17] = 0.0  # a zero, for signs and ties
    return X


def spool(tmp_path, X: torch.Tensor, name: str = "r") -> Spooled:
    paths = []
    for i in range(X.shape[0]):
        paths.append(tmp_path / f"{name}{i}.npy")
        write_row(paths[-1], X[i])
    # two blocks per read: the reads and the read-ahead cross block boundaries
    return Spooled(paths, chunk_bytes=2 * X.shape[0] * BLOCK * X.element_size())


def inputs(X: torch.Tensor, step: int) -> RoundInputs:
    ids = tuple(f"node{i:02d}" for i in range(X.shape[0]))
    return RoundInputs(ids=ids, w=torch.full((X.shape[1],), 0.01 * step, dtype=X.dtype), reference=X[3:].mean(dim=0),
                       ratings=torch.arange(X.shape[0], dtype=torch.float64).remainder(step + 2))


@pytest.mark.parametrize("spec", aggregators.rules() + CHAINS)
def test_spooled_rows_give_the_in_memory_bits(spec, tmp_path):
    # two rounds each: the stateful rules (centered clipping, foolsgold, fldetector) read their state too
    in_memory, on_disk = aggregators.build(spec, f=2), aggregators.build(spec, f=2)
    for step in range(3):
        X = rows(seed=step)
        expected = in_memory(X, inputs(X, step))
        got = on_disk(spool(tmp_path, X, f"s{step}_"), inputs(X, step))
        assert got.dtype == expected.dtype and torch.equal(got, expected), spec
        if in_memory.last_kept is None:
            assert on_disk.last_kept is None
        else:
            assert torch.equal(on_disk.last_kept, in_memory.last_kept)


@pytest.mark.parametrize("spec", ["median", "krum", "geometric-median", "nnm+trimmed-mean", "centered-clipping"])
def test_float64_rows_too(spec, tmp_path):
    X = rows(torch.float64)
    expected = aggregators.build(spec, f=2)(X)
    got = aggregators.build(spec, f=2)(spool(tmp_path, X))
    assert got.dtype == torch.float64 and torch.equal(got, expected)


def test_a_spool_reads_what_was_written_and_counts_the_bytes(tmp_path):
    X = rows()
    source = spool(tmp_path, X)
    assert source.shape == (N, D) and source.dtype == torch.float32
    assert torch.equal(source.tensor(), X)
    assert source.bytes_read == X.numel() * 4  # one pass: each value read once
    assert torch.equal(source.row(4), X[4])
    starts = [s for s, _ in source.blocks()]
    assert starts == list(range(0, D, BLOCK))
    for s, block in Memory(X).blocks():  # the same blocks, in the same layout
        assert block.is_contiguous() and block.shape == (N, min(BLOCK, D - s))
    columns = torch.tensor([D - 1, 5, BLOCK, 2 * BLOCK + 7])
    assert torch.equal(take_columns(source, columns), X[:, columns])


def test_a_spool_refuses_rows_that_do_not_match(tmp_path):
    write_row(tmp_path / "a.npy", torch.zeros(10))
    write_row(tmp_path / "b.npy", torch.zeros(11))
    with pytest.raises(ValueError, match="one shape and dtype"):
        Spooled([tmp_path / "a.npy", tmp_path / "b.npy"])
    np.save(tmp_path / "c.npy", np.zeros((2, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="1-D float32 or float64"):
        Spooled([tmp_path / "c.npy"])
    with pytest.raises(ValueError, match="at least one row"):
        Spooled([])


def test_a_truncated_spool_is_an_error_not_garbage(tmp_path):
    source = spool(tmp_path, rows())
    path = source.paths[3]
    path.write_bytes(path.read_bytes()[:-400])
    with pytest.raises(OSError, match="ends before"):
        aggregators.build("median", f=2)(source)


def test_a_non_finite_spooled_row_is_refused_unless_validated(tmp_path):
    X = rows()
    X[6, D - 2] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[6\] contain NaN"):
        aggregators.build("median", f=2)(spool(tmp_path, X))


def test_agg_bench_out_of_core_runs_each_rule_from_a_spool(tmp_path):
    out = tmp_path / "ooc.json"
    proc = subprocess.run(
        [sys.executable, "-m", "robust.cli", "agg-bench", "--out-of-core", "--sizes", "10x20000", "--spool",
         str(tmp_path), "--rules", "median,nnm+krum,bulyan,foolsgold", "--json", str(out)],
        capture_output=True, text=True, check=True,
    )
    rows = {r["rule"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"median", "nnm+krum", "foolsgold"}  # bulyan needs n >= 4f + 3 = 11: skipped, saying why
    assert "bulyan" in proc.stdout and "skipped: bulyan needs n >= 4f + 3" in proc.stdout
    spool = 10 * 20000 * 4
    assert rows["median"]["bytes_read"] == spool  # one pass
    assert rows["nnm+krum"]["bytes_read"] == 3 * spool  # distances, the mixed rows' distances, the chosen row
    # foolsgold, its histories in a row store: one pass adds the rows and makes the Gram matrix, one weighs;
    # the store holds the old and the new histories until the rows no state names are collected
    assert rows["foolsgold"]["bytes_read"] == 2 * spool
    assert 2 * spool < rows["foolsgold"]["state_bytes"] <= 2 * spool + 2 * 10 * 128  # + each file's header
    assert rows["median"]["state_bytes"] == 0
    for r in rows.values():
        assert {"seconds", "peak_rss_mb", "read_seconds"} <= set(r) and r["peak_rss_mb"] > 0
    assert list(tmp_path.glob("robust-spool-*")) == []  # the spool is removed
