"""The dense fast path computes what the generic torch.func path computes (to float rounding)."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

from evaluation.bench.drivers.batched_dense import DenseNet, local_updates
from evaluation.bench.drivers.inprocess import BatchDraws
from nodes.engine.protocol import Protocol
from robust.batches import draw_batches, node_key
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
@pytest.mark.parametrize("spec, steps", [("momentum", 1), ("delta:steps=1", 1), ("delta:steps=3", 3)])
def test_dense_updates_match_the_generic_path(name, shape, spec, steps):
    model = build_model(name, shape, 5, seed=1)
    net = DenseNet.of(model)
    protocol = Protocol.parse(spec, lr=0.1, momentum=0.9, batch_size=6)
    w, xs, ys, m = batches(model, 4, steps, 6, shape, 5)
    rows, moms = local_updates(net, protocol, w, xs, ys, m)
    generic = vmap(lambda *a: protocol.node_update(model, *a), in_dims=(None, 0, 0, 0))
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
    keys = [node_key(3, name) for name in ("a", "b", "c")]
    draws = BatchDraws(parts, Protocol.parse("delta:steps=2", lr=0.1, momentum=0.0, batch_size=8), keys)
    draws.chunk = 4  # rounds 1-4 come from one call, 5-8 from the next
    for t in (1, 4, 5, 10, 3):  # forwards across chunks, and back
        together = draws(t)
        assert together.shape == (3, 2, 8)
        for i in range(3):  # what the volunteer draws alone, in its own process
            alone = parts[i][draw_batches([parts[i].numel()], 8, [keys[i]], t, 2)[0]]
            assert torch.equal(together[i], alone)
            assert set(together[i].flatten().tolist()) <= set(parts[i].tolist())
