"""The dense fast path computes what the generic torch.func path computes (to float rounding)."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

from evaluation.batched import DenseNet, local_updates
from evaluation.engine import BatchDraws
from nodes.training import TrainConfig, local_update
from robust.models import build_model
from robust.params import flat_params, unflatten


def batches(model, n, steps, batch, shape, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = flat_params(model) + 0.3 * torch.randn(flat_params(model).numel(), generator=g)
    xs = 2.0 * torch.randn(n, steps, batch, *shape, generator=g)
    ys = torch.randint(classes, (n, steps, batch), generator=g)
    m = torch.randn(n, w.numel(), generator=g)
    return w, xs, ys, m


@pytest.mark.parametrize("name, shape", [("logreg", (7,)), ("mlp", (1, 4, 4)), ("mlp", (12,))])
@pytest.mark.parametrize("steps", [1, 3])
def test_dense_updates_match_the_generic_path(name, shape, steps):
    model = build_model(name, shape, 5, seed=1)
    net = DenseNet.of(model)
    cfg = TrainConfig(batch_size=6, lr=0.1, momentum=0.9, local_steps=steps)
    w, xs, ys, m = batches(model, 4, steps, 6, shape, 5)
    rows, moms = local_updates(net, cfg, w, xs, ys, m)
    generic = vmap(lambda *a: local_update(model, cfg, *a), in_dims=(None, 0, 0, 0))
    ref_rows, ref_moms = generic(unflatten(w, model), xs, ys, m)
    assert rows.shape == ref_rows.shape and moms.shape == ref_moms.shape
    assert torch.allclose(rows, ref_rows, rtol=1e-5, atol=1e-6)
    assert torch.allclose(moms, ref_moms, rtol=1e-5, atol=1e-6)


def test_dense_logits_match_the_model():
    model = build_model("mlp", (1, 4, 4), 5, seed=2)
    net = DenseNet.of(model)
    w, xs, _, _ = batches(model, 3, 1, 8, (1, 4, 4), 5)
    x = xs[:, 0]
    shared = functional_call(model, unflatten(w, model), (x[0],))
    assert torch.allclose(net.logits(w, x[0]), shared, atol=1e-6)
    per_node = w + 0.1 * torch.arange(3.0)[:, None]
    expected = torch.stack([functional_call(model, unflatten(per_node[i], model), (x[i],)) for i in range(3)])
    assert torch.allclose(net.logits(per_node, x), expected, atol=1e-5)


def test_only_flatten_linear_relu_stacks_are_dense():
    assert DenseNet.of(build_model("mlp", (8,), 3)).shapes == [(64, 8), (3, 64)]
    assert DenseNet.of(build_model("logreg", (8,), 3)).shapes == [(3, 8)]
    assert DenseNet.of(build_model("cnn", (1, 8, 8), 3)) is None
    assert DenseNet.of(nn.Sequential(nn.Linear(4, 2))) is None  # no Flatten: Linear acts on the last dim
    assert DenseNet.of(nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))) is None
    assert DenseNet.of(nn.Sequential(nn.Flatten(), nn.Linear(4, 2, bias=False))) is None
    assert DenseNet.of(nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU())) is None


def test_batch_draws_of_all_nodes_equal_each_node_drawn_alone():
    parts = [torch.arange(0, 40), torch.arange(40, 45), torch.arange(45, 145)]  # one node smaller than a batch
    draws = BatchDraws(parts, TrainConfig(batch_size=8, local_steps=2), seed=3)
    draws.chunk = 4  # rounds 0-3 come from one call, 4-7 from the next
    for t in (0, 3, 4, 9, 2):  # forwards across chunks, and back
        together = draws(t)
        assert together.shape == (3, 2, 8)
        for i in range(3):
            assert torch.equal(together[i], draws.node(i, t))
            assert set(together[i].flatten().tolist()) <= set(parts[i].tolist())
