"""Models, flat parameters, seeds, the training protocol, a volunteer's update and the row checks."""

import copy
import json
import re
import subprocess
import sys

import pytest
import torch
from torch.func import vmap


from nodes.engine.protocol import Protocol, loss_fn
from nodes.engine.rows import rejected_rows, rejection_reason, stacked
from nodes.engine.training import compute
from nodes.wire import Task
from robust.batches import draw_batches, node_key
from robust.models import AveragePool, Scorer, build_model
from robust.params import flat_params, sha256, unflatten
from robust.seeds import derive, generator


@pytest.mark.parametrize(
    "name, shape", [("logreg", (32,)), ("mlp", (1, 8, 8)), ("wide-mlp", (1, 8, 8)), ("cnn", (1, 40)), ("cnn", (3, 32, 32))]
)
def test_models_are_seeded_and_shaped(name, shape):
    a, b = build_model(name, shape, 10, seed=3), build_model(name, shape, 10, seed=3)
    assert torch.equal(flat_params(a), flat_params(b))
    assert not torch.equal(flat_params(a), flat_params(build_model(name, shape, 10, seed=4)))
    assert a(torch.zeros(2, *shape)).shape == (2, 10)


@pytest.mark.parametrize("size_in, size_out", [((40,), (4,)), ((7,), (4,)), ((4, 4), (2, 2)), ((7, 5), (2, 2)),
                                               ((16, 16), (2, 2))])
def test_the_cnns_pooling_is_adaptive_average_pooling_with_a_deterministic_backward(size_in, size_out):
    x = torch.randn(3, 5, *size_in, generator=torch.Generator().manual_seed(0), requires_grad=True)
    reference = (torch.nn.AdaptiveAvgPool1d if len(size_in) == 1 else torch.nn.AdaptiveAvgPool2d)(size_out)(x)
    pool = AveragePool(size_in, size_out)
    out = pool(x)
    assert torch.allclose(out, reference, atol=1e-6) and not list(pool.parameters()) and not pool.state_dict()
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    (want,) = torch.autograd.grad(reference.square().sum(), x)
    assert torch.allclose(grad, want, atol=1e-6)


def test_model_errors_say_what_to_use():
    with pytest.raises(ValueError, match="unknown model 'resnet': choose from logreg, mlp, wide-mlp, cnn"):
        build_model("resnet", (4,), 2)
    with pytest.raises(ValueError, match="cnn needs samples shaped"):
        build_model("cnn", (4,), 2)


def test_build_model_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    build_model("mlp", (8,), 3, seed=1)
    assert torch.equal(state, torch.random.get_rng_state())


def test_flat_params_round_trip_and_hash():
    model = build_model("mlp", (1, 8, 8), 10)
    w = flat_params(model)
    assert w.numel() == sum(p.numel() for p in model.parameters())
    views = unflatten(w, model)
    assert all(torch.equal(views[k], p) for k, p in model.named_parameters())
    assert sha256(w) == sha256(w.clone()) != sha256(w + 1e-7)
    with pytest.raises(ValueError, match="vector has 3 values"):
        unflatten(torch.zeros(3), model)


@pytest.mark.parametrize("name,shape", [("mlp", (1, 8, 8)), ("cnn", (1, 8, 8)), ("cnn", (1, 40))])
def test_a_scorer_gives_the_accuracy_of_each_vector_it_is_handed(name, shape):
    model = build_model(name, shape, 10, seed=3)
    before = {k: p.clone() for k, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, *shape, generator=gen), torch.randint(0, 10, (200,), generator=gen)
    w0 = flat_params(model)
    scorer = Scorer(model)
    reference = copy.deepcopy(model).eval()  # the same forward pass, through functional_call
    seen = set()
    for k in range(4):
        w = w0 + 0.5 * k * torch.randn(w0.shape, generator=gen)
        got = scorer(w, x, y)
        with torch.no_grad():
            logits = torch.func.functional_call(reference, unflatten(w, reference), (x,))
        assert got == float((logits.argmax(dim=1) == y).float().mean())
        seen.add(got)
        # the copy holds no trained values of its own: its parameters are views of the vector
        assert all(p.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for p in scorer.params)
    assert len(seen) > 1  # the vectors' accuracies differ: each call used its own vector
    assert model.training and all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    with pytest.raises(ValueError, match=r"a vector of shape \(3,\) for a model of"):
        scorer(torch.zeros(3), x, y)


def test_a_big_model_is_evaluated_in_pieces_with_the_whole_passs_results(monkeypatch):
    """A model too big to evaluate every sample in one pass is evaluated a few samples at a
    time: the same accuracy (every prediction counted once), the same loss to rounding."""
    import robust.models

    model = build_model("gpt:layers=1,width=16,heads=2,context=8", (8,), 256, seed=0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(256, (50, 8), generator=gen), torch.randint(256, (50, 8), generator=gen)
    w = flat_params(model) + 0.5 * torch.randn(flat_params(model).shape, generator=gen)
    whole = Scorer(model).evaluate(w, x, y)
    assert robust.models.eval_rows(100_411_648) == 21 and robust.models.eval_rows(w.numel()) > len(x)  # one pass
    monkeypatch.setattr(robust.models, "EVAL_VALUES", 7 * w.numel())  # 7 samples a pass: 8 passes, the last of 1
    assert robust.models.eval_rows(w.numel()) == 7
    pieces = Scorer(model).evaluate(w, x, y)
    assert pieces[0] == whole[0] and pieces[1] == pytest.approx(whole[1], rel=1e-6)


def test_seeds_depend_only_on_their_parts():
    assert derive(0, 1, "batch") == derive(0, 1, "batch") != derive(0, 2, "batch")
    assert torch.equal(torch.rand(3, generator=generator(5, "x")), torch.rand(3, generator=generator(5, "x")))


def test_batches_stay_in_their_partition_distinct_unless_small():
    sizes, keys = torch.tensor([4, 40, 2]), torch.tensor([node_key(0, i) for i in range(3)])
    pos = draw_batches(sizes, 4, keys, round=7, steps=5)
    assert pos.shape == (3, 5, 4) and pos.dtype == torch.int64
    assert bool((pos >= 0).all()) and bool((pos < sizes[:, None, None]).all())
    assert all(len(set(pos[i, s].tolist())) == 4 for i in (0, 1) for s in range(5))  # without replacement
    assert sorted(pos[0, 0].tolist()) == [0, 1, 2, 3]  # a node with exactly `batch` samples uses them all
    assert set(pos[2].flatten().tolist()) == {0, 1}  # with replacement when smaller than a batch


def test_batches_are_a_function_of_node_round_and_step_only():
    sizes, keys = torch.tensor([50, 30, 90]), torch.tensor([node_key(3, i) for i in range(3)])
    together = draw_batches(sizes, 8, keys, round=2, steps=3)
    for i in range(3):  # a volunteer draws alone what the harness draws for everyone
        assert torch.equal(draw_batches(sizes[i : i + 1], 8, keys[i : i + 1], round=2, steps=3)[0], together[i])
    assert torch.equal(draw_batches(sizes, 8, keys, round=2, steps=2), together[:, :2])
    assert not torch.equal(draw_batches(sizes, 8, keys, round=3, steps=3), together)
    assert not torch.equal(together[0, 0], together[0, 1])
    with pytest.raises(ValueError, match="between 1 and"):
        draw_batches(torch.tensor([5, 0]), 2, keys[:2], round=0, steps=1)


def test_batches_cover_a_partition_uniformly():
    # 2,000 rounds x 8 of 20 positions: each position is drawn 800 times in expectation; a
    # biased hash (say, low bits that do not mix) would leave some far from it
    counts = torch.zeros(20)
    for t in range(2000):
        counts += torch.bincount(draw_batches(torch.tensor([20]), 8, torch.tensor([node_key(1, "n")]), t, 1).flatten(), minlength=20)
    chi2 = float(((counts - 800) ** 2 / 800).sum())
    assert chi2 < 45  # 19 degrees of freedom: P(chi2 > 45) < 0.001 for a uniform draw


@pytest.mark.parametrize("spec, steps", [("momentum", 1), ("delta:steps=3", 3)])
def test_vmapped_updates_equal_per_node_updates(spec, steps):
    """The harness's vectorised mode computes what each volunteer computes (to rounding)."""
    model = build_model("mlp", (6,), 3, seed=0)
    protocol = Protocol.parse(spec, lr=0.1, momentum=0.9, batch_size=5)
    w = flat_params(model)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(4, steps, 5, 6, generator=g), torch.randint(3, (4, steps, 5), generator=g)
    m = torch.randn(4, w.numel(), generator=g)
    params = unflatten(w, model)
    rows, moms = vmap(lambda *a: protocol.node_update(model, *a), in_dims=(None, 0, 0, 0))(params, xs, ys, m)
    for i in range(4):
        row, mom = protocol.node_update(model, params, xs[i], ys[i], m[i])
        assert torch.allclose(rows[i], row, atol=1e-6) and torch.allclose(moms[i], mom, atol=1e-6)


@pytest.mark.parametrize("spec", ["momentum", "delta:steps=3", "delta:steps=3,clip=0.5",
                                  "delta:steps=3,inner=adamw,clip=0.5", "delta:steps=3,inner=adamw"])
@pytest.mark.parametrize("model_name, shape", [("mlp", (6,)), ("gpt:layers=1,width=16,heads=2,context=8", (8,))])
def test_the_in_place_kernel_gives_the_functional_kernels_bits_and_leaves_the_model_alone(spec, model_name, shape,
                                                                                          monkeypatch):
    """A volunteer's kernel (in place: each state held once, updated in pieces; its gradient
    through autograd, a ``gpt`` recomputing each block's activations in the backward pass) and
    the batched driver's (functional, as ``vmap`` needs) do the same operations in the same
    order: the same bits, every state."""
    import nodes.engine.protocol

    monkeypatch.setattr(nodes.engine.protocol, "PIECE", 7)  # pieces that cut every tensor, unevenly
    classes = 256 if model_name.startswith("gpt") else 3
    model = build_model(model_name, shape, classes, seed=0)
    protocol = Protocol.parse(spec, lr=0.05, momentum=0.9, batch_size=5)
    w = flat_params(model)
    g = torch.Generator().manual_seed(1)
    if model_name.startswith("gpt"):
        xs, ys = torch.randint(256, (3, 5, 8), generator=g), torch.randint(256, (3, 5, 8), generator=g)
    else:
        xs, ys = torch.randn(3, 5, 6, generator=g), torch.randint(3, (3, 5), generator=g)
    m, before = torch.randn(w.numel(), generator=g), w.clone()
    seen = {False: [], True: []}
    for in_place in (False, True):
        params = unflatten(w, model)
        row, mom = protocol.node_update(model, params, xs, ys, m, in_place=in_place,
                                        on_state=lambda s, local, state: seen[in_place].append(
                                            sha256(torch.cat([p.reshape(-1) for b in (local, *state) for p in b.values()]))))
        seen[in_place] += [sha256(row), sha256(mom)]
    assert seen[True] == seen[False] and len(seen[True]) == (2 if spec == "momentum" else 6)
    assert torch.equal(w, before)  # the task's model is not trained in place


RECOMPUTED = """
import json, torch
from evaluation.microbench.peak_memory import peak_extra_bytes
from nodes.engine.protocol import Protocol
from robust.models import build_model
from robust.params import flat_params, unflatten

model = build_model("gpt:layers=8,width=64,heads=4,context=128", (128,), 256, seed=0)
w = flat_params(model)
g = torch.Generator().manual_seed(2)
params = unflatten(w + 0.02 * torch.randn(w.numel(), generator=g), model)  # not the model's own
x, y = torch.randint(256, (32, 128), generator=g), torch.randint(256, (32, 128), generator=g)
protocol = Protocol.parse("delta", lr=0.1, momentum=0.0, batch_size=32)
functional, held = peak_extra_bytes(lambda: protocol.gradient(model, params)(params, x, y))
eager, recomputed = peak_extra_bytes(lambda: protocol.gradient(model, params, eager=True)(params, x, y))
print(json.dumps({"equal": all(torch.equal(eager[k], functional[k]) for k in params), "held": held,
                  "recomputed": recomputed, "left": not model.recompute and torch.equal(flat_params(model), w)}))
"""


def test_a_gpt_recomputing_its_activations_gives_its_gradient_with_a_fraction_of_the_memory():
    """A volunteer's gradient of a ``gpt`` (autograd, each block's activations recomputed in the
    backward pass) is the functional gradient, bit for bit, from parameters that are not the
    model's own (a volunteer's, past its first step); the memory it takes at its peak
    (resident, the kernel's high-water mark, in a fresh process) is under half the functional
    gradient's, which holds every block's activations at once (measured: 258 against 613 MB)."""
    out = subprocess.run([sys.executable, "-c", RECOMPUTED], capture_output=True, text=True, check=True, timeout=300)
    got = json.loads(out.stdout)
    assert got["equal"] and got["left"]  # the same bits; the model left as it was
    assert got["recomputed"] < 0.5 * got["held"], got


def test_one_step_update_is_worker_momentum_of_the_gradient():
    model = build_model("logreg", (2,), 2, seed=0)
    protocol = Protocol.parse("momentum", lr=0.5, momentum=0.5, batch_size=2)
    w = flat_params(model).requires_grad_(True)
    x, y = torch.tensor([[1.0, 2.0], [0.0, -1.0]]), torch.tensor([0, 1])
    (g,) = torch.autograd.grad(loss_fn(model, unflatten(w, model), x, y), w)
    m0 = torch.ones_like(w)
    row, m1 = protocol.node_update(model, unflatten(w.detach(), model), x[None], y[None], m0)
    assert torch.allclose(row, 0.5 * m0 + g) and torch.equal(row, m1)
    assert torch.allclose(protocol.apply(w.detach(), row, None)[0], w.detach() - 0.5 * row)


@pytest.mark.parametrize("nesterov", [False, True])
def test_outer_momentum_is_pytorch_sgd_on_the_pseudo_gradient(nesterov):
    """DiLoCo's outer step: SGD with momentum on -aggregate, as torch.optim.SGD takes it."""
    spec = f"delta:steps=2,server_lr=0.7,server_momentum=0.9,nesterov={str(nesterov).lower()}"
    protocol = Protocol.parse(spec, lr=0.1, momentum=0.0, batch_size=4)
    g = torch.Generator().manual_seed(1)
    w, buffer = torch.randn(5, generator=g), None
    param = torch.nn.Parameter(w.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=nesterov)
    for _ in range(4):
        aggregate = torch.randn(5, generator=g)
        w, buffer = protocol.apply(w, aggregate, buffer)
        param.grad = -aggregate
        sgd.step()
        assert torch.allclose(w, param.detach(), atol=1e-6)


@pytest.mark.parametrize("spec, words", [
    ("delta:steps=0", "delta: steps must be an integer in [1, 100000] (got steps=0)"),
    ("delta:step=3", "unknown key step"),
    ("delta:nesterov=true",
     "delta: nesterov must be false while server_momentum is 0 (got nesterov=True, server_momentum=0.0)"),
    ("momentum:steps=2", "unknown key steps"),
    ("fedprox", "write momentum, or delta"),
])
def test_protocol_errors_say_what_to_change(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        Protocol.parse(spec, lr=0.1, momentum=0.9, batch_size=32)


@pytest.mark.parametrize("spec", ["delta:steps=5", "momentum"])
def test_a_partition_smaller_than_two_batches_lowers_its_loss(spec):
    """40 samples, batch 32: the node still runs the protocol's steps (with replacement where
    a batch does not fit), and the server's step with its row lowers the node's loss."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 8, generator=g), torch.randint(3, (40,), generator=g)
    model = build_model("logreg", (8,), 3, seed=0)
    w = flat_params(model)
    protocol = Protocol.parse(spec, lr=0.1, momentum=0.9, batch_size=32)
    task = Task(run="r", round=1, base="", seed=0, dataset="synthetic", model="logreg", protocol=spec,
                batch_size=32, lr=0.1, momentum=0.9, threads=1, deadline=60.0)
    row, _ = compute(task, w, x, y, 3, "node", torch.device("cpu"))
    stepped, _ = protocol.apply(w, row, None)
    before = float(loss_fn(model, unflatten(w, model), x, y))
    after = float(loss_fn(model, unflatten(stepped, model), x, y))
    assert after < before, (before, after)  # a raw gradient added as a delta raised it (2.53 -> 4.42)


def test_rejection_reasons():
    assert rejection_reason(torch.ones(4), 4, None) is None
    assert rejection_reason(torch.ones(3), 4, None) == "wrong shape (3,), expected (4,)"
    assert rejection_reason(torch.ones(4, dtype=torch.int64), 4, None) == "wrong dtype torch.int64, expected torch.float32 (the model's)"
    assert rejection_reason(torch.tensor([1.0, float("nan"), 0, 0]), 4, None) == "non-finite values"
    assert rejection_reason(torch.full((4,), 3.0), 4, 5.0) == "norm 6 above the bound 5"
    assert rejection_reason("junk", 4, None) == "wrong shape str, expected (4,)"


def test_canonical_order_is_by_node_id():
    ids, X = stacked({"c": torch.tensor([7.0]), "a": torch.tensor([2.0]), "b": torch.tensor([5.0])}, 1)
    assert ids == ["a", "b", "c"] and X[:, 0].tolist() == [2.0, 5.0, 7.0]
    assert stacked({}, 3)[1].shape == (0, 3)


def test_rejected_rows_screens_a_stack():
    rows = torch.tensor([[1.0, 1.0], [float("inf"), 0.0], [3.0e38, 3.0e38], [4.0, 4.0]])
    assert rejected_rows(rows, None) == {1: "non-finite values"}  # row 2 overflows float32 only
    assert rejected_rows(rows, 5.0) == {1: "non-finite values", 2: "norm 4.243e+38 above the bound 5", 3: "norm 5.657 above the bound 5"}


def test_the_stack_screen_and_a_single_reply_agree_at_the_norm_bound():
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(200, 1000, generator=g)
    exact = torch.linalg.vector_norm(rows.double(), dim=1)
    rows = (rows.double() / exact[:, None] * 10.0 * (1 + torch.linspace(-3e-7, 3e-7, 200))[:, None]).float()
    single = {i: r for i in range(200) if (r := rejection_reason(rows[i], 1000, 10.0))}
    assert 0 < len(single) < 200 and rejected_rows(rows, 10.0) == single


def test_a_cuda_profile_is_deterministic_in_full_precision_and_restores_what_it_found():
    from robust.compute import profile

    flags = torch.backends.cudnn
    saved = flags.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.are_deterministic_algorithms_enabled()
    flags.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True  # PyTorch's cuDNN default: TF32 convolutions
    try:
        with profile(1, "cuda"):  # the flags are process-wide: settable without a GPU
            assert not flags.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
            assert torch.are_deterministic_algorithms_enabled()
        assert flags.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        assert torch.are_deterministic_algorithms_enabled() == saved[2]
    finally:
        flags.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:2]
