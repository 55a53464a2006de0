"""Several kernels behind one function agree (parity), and the fast reads hand out the values
of the plain ones."""

import numpy as np
import pytest
import torch

import aggregators
from aggregators.centered_clipping import GRAM_ROWS_PER_PASS, clip_by_gram, clip_by_passes
from robust.source import BLOCK, Memory, Spooled, mixed, on_device, write_row

D = 2 * BLOCK + 77  # two full blocks and a short one


def rows(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(D, generator=g, dtype=dtype) + torch.randn(n, D, generator=g, dtype=dtype)
    X[: n // 4] *= 30.0  # loud rows, so that clipping bites
    return X


@pytest.mark.parametrize("n,iters", [(5, 1), (5, 3), (40, 1), (40, 4)])
def test_centered_clipping_kernels_agree_call_after_call(n, iters):
    v_passes = v_gram = None
    for call in range(3):
        X = Memory(rows(n, seed=call))
        v_passes = clip_by_passes(X, v_passes, 100.0, iters)
        v_gram = clip_by_gram(X, v_gram, 100.0, iters)
        assert v_passes.dtype == v_gram.dtype == torch.float64
        torch.testing.assert_close(v_passes, v_gram, rtol=1e-9, atol=1e-9)


def test_centered_clipping_picks_its_kernel_by_shape_alone(monkeypatch):
    picked = []
    import aggregators.centered_clipping as cc

    monkeypatch.setattr(cc, "clip_by_gram", lambda *a: picked.append("gram") or clip_by_gram(*a))
    monkeypatch.setattr(cc, "clip_by_passes", lambda *a: picked.append("passes") or clip_by_passes(*a))
    few = GRAM_ROWS_PER_PASS - 2  # n + 1 < GRAM_ROWS_PER_PASS at iters=1: the Gram kernel
    for n, iters in [(few, 1), (few + 1, 1), (40, 1), (40, 3)]:
        aggregators.build(f"centered-clipping:iters={iters}", 1)(rows(n))
    assert picked == ["gram", "passes", "passes", "gram"]


def spooled(tmp_path, X: torch.Tensor) -> Spooled:
    paths = []
    for i, row in enumerate(X):
        paths.append(tmp_path / f"r{i}.npy")
        write_row(paths[-1], row)
    return Spooled(paths, chunk_bytes=X.shape[0] * BLOCK * X.element_size())  # a block a read


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_read_hands_out_the_blocks_converted(tmp_path, dtype):
    X = rows(7)
    M = torch.arange(14, dtype=torch.float32).reshape(2, 7) / 10
    for source in (Memory(X), spooled(tmp_path, X), mixed(Memory(X), M), on_device(Memory(X), "cpu")):
        plain = [(s, b.to(dtype)) for s, b in source.blocks()]
        read = [(s, b.clone()) for s, b in source.read(dtype)]  # scratch: copied before the next
        assert [s for s, _ in read] == [s for s, _ in plain]
        for (_, a), (_, b) in zip(read, plain):
            assert a.dtype == dtype and a.is_contiguous() and torch.equal(a, b)


def test_read_reuses_one_buffer_in_memory_and_on_disk(tmp_path):
    X = rows(7)
    for source in (Memory(X), spooled(tmp_path, X), on_device(Memory(X), "cpu")):
        pointers = {b.data_ptr() for _, b in source.read(torch.float64)}
        assert len(pointers) == 1  # every block, the short last one too, in one buffer
    assert np.load(tmp_path / "r0.npy").shape == (D,)
