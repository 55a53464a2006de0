"""Distances must stay exact where rows share a large common component (float32 input)."""

import pytest
import torch

import aggregators


def offset_rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Rows = 1000 * u + 1e-2 noise, float32: the common component dwarfs the differences."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g)
    u /= u.norm()
    return (1000.0 * u + 1e-2 * torch.randn(n, d, generator=g)).float()


def exact_scores(X: torch.Tensor, f: int) -> torch.Tensor:
    """Krum scores from float64 differences, row by row (the reference computation)."""
    X64 = X.double()
    n = X.shape[0]
    dist = torch.stack([(X64 - X64[i]).square().sum(dim=1) for i in range(n)])
    dist.fill_diagonal_(float("inf"))
    return torch.sort(dist, dim=1).values[:, : n - f - 2].sum(dim=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_krum_picks_the_exact_row_under_a_large_common_component(seed):
    n, f, d = 15, 3, 2_000_000
    X = offset_rows(n, d, seed)
    scores = exact_scores(X, f)
    assert torch.equal(aggregators.build("krum", f)(X), X[int(torch.argmin(scores))])
    m = 5
    chosen = torch.sort(scores, stable=True).indices[:m]
    expected = X[chosen].double().sum(dim=0) / m
    got = aggregators.build(f"multi-krum:m={m}", f)(X).double()
    assert torch.allclose(got, expected, rtol=0, atol=1e-4)


def test_float32_gram_would_not_be_exact_here():
    """The test above is not vacuous: the naive float32 Gram matrix misranks these rows."""
    n, f, d = 15, 3, 2_000_000
    X = offset_rows(n, d, 0)
    sq = X.square().sum(dim=1)
    naive = sq[:, None] + sq[None, :] - 2.0 * (X @ X.T)
    naive.fill_diagonal_(float("inf"))
    naive_scores = torch.sort(naive, dim=1).values[:, : n - f - 2].sum(dim=1)
    exact = exact_scores(X, f)
    assert not torch.equal(torch.argsort(naive_scores), torch.argsort(exact))
