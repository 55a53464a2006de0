"""``robust.flower.RobustStrategy``: a drop-in for Flower's FedAvg that survives bad replies.

The pure parts on hand-made replies (canonical order, each malformed kind rejected with its
reason, sample counts, quarantine, parameters), then a user's quickstart-style app through
Flower's simulation engine with one node replying NaN weights."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, Metadata, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity
from sklearn.datasets import load_digits
from torch import nn

from robust.compute import profile
from robust.flower import RobustStrategy

BASE = {"fc.weight": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3),
        "fc.bias": np.zeros(4, dtype=np.float32),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64)}
HONEST = [17, 3, 42, 8, 25]  # Flower node ids, deliberately not sorted
BAD = 99
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """A ServerApp's identity, which Flower sets when it runs one: messages are made with it."""
    for name, value in {"_run_id": 1, "_task_id": 1, "_node_id": 1}.items():
        monkeypatch.setattr(TaskIdentity, name, value)


class FakeGrid:
    """What the strategy's sampling asks of a Grid."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return self.nodes


def record(arrays):
    return ArrayRecord({k: v if isinstance(v, Array) else Array(np.asarray(v)) for k, v in arrays.items()})


def meta(node):
    return Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="t",
                    group_id="1", created_at=time.time(), ttl=3600.0, message_type="train")


def reply(node, arrays, count=10, metrics=None):
    records = {"metrics": MetricRecord(metrics if metrics is not None else {"num-examples": count})}
    if arrays is not None:
        records["arrays"] = record(arrays)
    return Message(RecordDict(records), metadata=meta(node))


def trained(node, scale=0.01):
    """Node ``node``'s honest weights: the base model plus its own small step."""
    g = torch.Generator().manual_seed(node)
    out = dict(BASE)
    for k in ("fc.weight", "fc.bias"):
        out[k] = BASE[k] + scale * torch.randn(BASE[k].shape, generator=g).numpy()
    out["bn.num_batches_tracked"] = np.array(9, dtype=np.int64)  # trained: ignored, the base's is kept
    return out


def play(strategy, replies, nodes, server_round=1):
    """One training round: configure (which nodes are asked), then aggregate ``replies(asked)``."""
    asked = [m.metadata.dst_node_id for m in strategy.configure_train(server_round, record(BASE), ConfigRecord(),
                                                                       FakeGrid(nodes))]
    arrays, _ = strategy.aggregate_train(server_round, replies(asked))
    return asked, arrays


def values(arrays):
    return {k: a.numpy() for k, a in arrays.items()}


def same_bits(a, b):
    va, vb = values(a), values(b)
    return va.keys() == vb.keys() and all(va[k].dtype == vb[k].dtype and va[k].tobytes() == vb[k].tobytes() for k in va)


def honest_only(**kwargs):
    arrays = play(RobustStrategy(**kwargs), lambda asked: [reply(n, trained(n)) for n in HONEST], HONEST)[1]
    assert arrays is not None
    return arrays


@pytest.mark.parametrize("spec", ["mean", "nnm+trimmed-mean", "krum"])
def test_the_aggregate_does_not_depend_on_the_order_of_the_replies(spec):
    nodes = HONEST + [60, 5]
    results = []
    for order in (nodes, sorted(nodes), sorted(nodes, reverse=True), nodes[3:] + nodes[:3]):
        strategy = RobustStrategy(spec, 1)
        _, arrays = play(strategy, lambda asked: [reply(n, trained(n, scale=0.3)) for n in order], nodes)
        results.append((arrays, strategy.history[0]))
    first, record0 = results[0]
    assert record0["ids"] == sorted(nodes) and record0["aggregate_sha256"]
    assert not same_bits(first, record(BASE))  # the round moved the model
    for arrays, rec in results[1:]:
        assert same_bits(arrays, first)
        assert rec == record0


def _bad_arrays(kind):
    """A node's reply arrays of kind ``kind`` (``None``: no ArrayRecord at all)."""
    w = trained(BAD)
    if kind == "nan":
        w["fc.weight"] = np.full((4, 3), np.nan, dtype=np.float32)
    elif kind == "inf":
        w["fc.bias"] = np.array([0, np.inf, 0, 0], dtype=np.float32)
    elif kind == "huge-norm":
        w["fc.weight"] = w["fc.weight"] + 1e4
    elif kind == "wrong-shape":
        w["fc.weight"] = w["fc.weight"].reshape(3, 4)
    elif kind == "wrong-dtype":
        w["fc.weight"] = w["fc.weight"].astype(np.float64)
    elif kind == "int-as-float":
        w["bn.num_batches_tracked"] = np.array(9, dtype=np.float32)
    elif kind == "missing-key":
        del w["fc.bias"]
    elif kind == "extra-key":
        w["evil"] = np.zeros(3, dtype=np.float32)
    elif kind == "not-numpy":
        w["fc.bias"] = Array(dtype="float32", shape=(4,), stype="torch.raw", data=b"\0" * 16)
    elif kind == "oversize":
        w["fc.bias"] = Array(np.zeros(4000, dtype=np.float32))
    elif kind == "no-arrays":
        return None
    return w


@pytest.mark.parametrize("kind, reason", [
    ("nan", "non-finite values"),
    ("inf", "non-finite values"),
    ("huge-norm", "above the bound 1000"),
    ("wrong-shape", "array 'fc.weight' has shape (3, 4), expected (4, 3)"),
    ("wrong-dtype", "array 'fc.weight' is float64, expected float32"),
    ("int-as-float", "array 'bn.num_batches_tracked' is float32, expected int64"),
    ("missing-key", "arrays differ from the model sent: missing ['fc.bias']"),
    ("extra-key", "arrays differ from the model sent: unexpected ['evil']"),
    ("not-numpy", "array 'fc.bias' is not a numpy array"),
    ("oversize", "array 'fc.bias' is 16128 bytes, the model's takes at most 1040"),
    ("no-arrays", "0 ArrayRecords in the reply, expected 1"),
])
def test_a_malformed_reply_is_rejected_with_its_reason_and_the_round_goes_on(kind, reason):
    strategy = RobustStrategy("trimmed-mean", 1)
    asked, arrays = play(strategy, lambda asked: [reply(n, trained(n)) for n in HONEST] + [reply(BAD, _bad_arrays(kind))],
                         HONEST + [BAD])
    rec = strategy.history[0]
    assert BAD in asked and rec["ids"] == sorted(HONEST)
    assert list(rec["rejected"]) == [BAD] and reason in rec["rejected"][BAD], rec["rejected"]
    assert rec["flagged"] == [BAD] and strategy.flags.flags == {BAD: 1}
    assert same_bits(arrays, honest_only(aggregator="trimmed-mean", tolerate=1))  # the bad reply changed nothing
    assert values(arrays)["bn.num_batches_tracked"] == 7  # integer arrays keep the values sent


def test_an_error_reply_is_recorded_without_a_flag():
    strategy = RobustStrategy("trimmed-mean", 1)
    failure = Message(error=Error(code=0, reason="ClientApp raised MemoryError"), metadata=meta(BAD))
    _, arrays = play(strategy, lambda asked: [reply(n, trained(n)) for n in HONEST] + [failure], HONEST + [BAD])
    rec = strategy.history[0]
    assert rec["failed"] == {BAD: "node error: ClientApp raised MemoryError"}
    assert rec["rejected"] == {} and rec["flagged"] == [] and rec["missing"] == []
    assert same_bits(arrays, honest_only(aggregator="trimmed-mean", tolerate=1))


def test_a_round_with_too_few_valid_updates_keeps_the_model_and_says_why():
    strategy = RobustStrategy("trimmed-mean", 2)  # needs n > 4
    _, arrays = play(strategy, lambda asked: [reply(n, trained(n)) for n in HONEST[:3]] + [reply(BAD, _bad_arrays("nan"))],
                     HONEST + [BAD])
    rec = strategy.history[0]
    assert arrays is None and rec["aggregate_sha256"] is None
    assert rec["skipped"] == "3 valid rows, quorum is 5: no step"  # the engine's words: the rule serves n >= 5
    assert rec["missing"] == sorted(HONEST[3:]) and rec["flagged"] == [BAD]


def _mean_of(counts, weighted):
    strategy = RobustStrategy("mean", 0, weighted=weighted)
    _, arrays = play(strategy, lambda asked: [reply(n, trained(n), count=c) for n, c in zip(HONEST, counts)], HONEST)
    return arrays


def test_sample_counts_are_no_weights_unless_asked():
    counts = [1, 1, 1, 1, 10_000]
    assert same_bits(_mean_of(counts, weighted=False), _mean_of([7] * 5, weighted=False))
    weighted = values(_mean_of(counts, weighted=True))
    expected = sum(c * trained(n)["fc.weight"].astype(np.float64) for n, c in zip(HONEST, counts)) / sum(counts)
    assert np.allclose(weighted["fc.weight"], expected, rtol=0, atol=1e-6)
    assert not np.allclose(values(_mean_of(counts, weighted=False))["fc.weight"], expected, rtol=0, atol=1e-4)


def test_claimed_counts_cannot_overflow_the_weights():
    huge = values(_mean_of([1.7e308, 1.7e308, 1, 1, 1], weighted=True))["fc.weight"]
    assert np.allclose(huge, (trained(HONEST[0])["fc.weight"] + trained(HONEST[1])["fc.weight"]) / 2, rtol=0, atol=1e-6)


def test_a_node_answers_once_and_only_if_asked():
    strategy = RobustStrategy("trimmed-mean", 1)
    _, arrays = play(strategy, lambda asked: [reply(n, trained(n)) for n in HONEST + [BAD, BAD, 1234]], HONEST + [BAD])
    rec = strategy.history[0]
    assert rec["rejected"] == {BAD: "2 replies to one task"} and 1234 not in rec["ids"]
    assert same_bits(arrays, honest_only(aggregator="trimmed-mean", tolerate=1))


@pytest.mark.parametrize("metrics, reason", [
    ({"loss": 0.5}, "one 'num-examples' metric expected in the reply, found 0"),
    ({"num-examples": 0}, "'num-examples' is 0, not a number > 0"),
    ({"num-examples": float("inf")}, "'num-examples' is inf, not a number > 0"),
])
def test_with_weights_a_reply_needs_a_sample_count(metrics, reason):
    strategy = RobustStrategy("mean", 0, weighted=True)
    play(strategy, lambda asked: [reply(n, trained(n)) for n in HONEST] + [reply(BAD, trained(BAD), metrics=metrics)],
         HONEST + [BAD])
    assert strategy.history[0]["rejected"] == {BAD: reason}
    assert strategy.history[0]["ids"] == sorted(HONEST)


def test_a_node_flagged_repeatedly_is_quarantined_and_no_longer_asked():
    strategy = RobustStrategy("trimmed-mean", 1, quarantine_after=2)
    nodes = HONEST + [BAD]
    for t in (1, 2, 3):
        asked, arrays = play(strategy, lambda asked: [reply(n, trained(n) if n != BAD else _bad_arrays("nan"))
                                                      for n in asked], nodes, server_round=t)
        assert arrays is not None
        assert (BAD in asked) == (t < 3)
    assert [r["rejected"] for r in strategy.history] == [{BAD: "non-finite values"}] * 2 + [{}]
    assert [r["quarantined"] for r in strategy.history] == [[], [BAD], [BAD]]
    evaluate = strategy.configure_evaluate(4, record(BASE), ConfigRecord(), FakeGrid(nodes))
    assert sorted(m.metadata.dst_node_id for m in evaluate) == sorted(HONEST)


def test_a_fraction_draws_nodes_from_the_seed_alone():
    def asked(seed, server_round):
        strategy = RobustStrategy(seed=seed, fraction_train=0.5, min_train_nodes=2)
        messages = strategy.configure_train(server_round, record(BASE), ConfigRecord(), FakeGrid(range(1, 11)))
        return [m.metadata.dst_node_id for m in messages]

    assert asked(0, 1) == asked(0, 1) and len(asked(0, 1)) == 5
    assert len({tuple(asked(seed, t)) for seed in range(3) for t in (1, 2)}) > 1


def test_metrics_a_node_garbled_cost_nothing_but_its_own():
    strategy = RobustStrategy("trimmed-mean", 1)
    replies = [reply(n, None, metrics={"num-examples": 10, "acc": 0.5}) for n in HONEST]
    replies.append(reply(BAD, None, metrics={"acc": 1.0}))  # no num-examples: FedAvg would end the run
    assert dict(strategy.aggregate_evaluate(1, replies)) == {"acc": 0.5}


@pytest.mark.parametrize("kwargs, message", [
    ({"max_norm": -1.0}, "RobustStrategy: max_norm must be a number > 0 (got max_norm=-1.0)"),
    ({"tolerate": -1}, "RobustStrategy: tolerate must be an integer >= 0 (got tolerate=-1)"),
    ({"aggregator": "nope"}, "RobustStrategy: aggregator: unknown aggregator 'nope' in 'nope': choose from"),
    ({"weighted": "yes"}, "RobustStrategy: weighted must be true or false (got weighted='yes')"),
    ({"fraction_train": 1.5}, "RobustStrategy: fraction_train must be a number in [0, 1] (got fraction_train=1.5)"),
    ({"quarantine_after": 0}, "RobustStrategy: quarantine_after must be an integer >= 1 (got quarantine_after=0)"),
    ({"protocol": "delta:server_lr=0"}, "RobustStrategy: protocol: delta: server_lr must be a number > 0"),
    ({"protocol": "momentum"}, "RobustStrategy: protocol 'momentum' steps w - lr F on momenta the nodes send"),
])
def test_bad_parameters_fail_up_front_saying_what_to_do(kwargs, message):
    with pytest.raises(ValueError) as err:
        RobustStrategy(**kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_misuse_is_refused_with_what_to_do():
    strategy = RobustStrategy()
    with pytest.raises(ValueError, match="the model sent has no float16, float32 or float64 array"):
        strategy.configure_train(1, record({"steps": np.zeros(3, dtype=np.int64)}), ConfigRecord(), FakeGrid(HONEST))
    with pytest.raises(RuntimeError, match="call configure_train first"):
        strategy.aggregate_train(1, [])


STEP = 2.0**-8  # deltas and values in multiples of it: every sum below is exact in float16 and up


def test_every_array_comes_back_in_its_own_shape_and_dtype_with_float64_precision():
    """Scalars stay 0-dim; float16, float32 and float64 arrays are aggregated (rows in float32,
    the step added in float64) and rounded to their own dtypes; integers keep the values sent."""
    base = {"half": np.array([[-1, -0.5, 0], [0.25, 0.5, 1]], np.float16), "single": np.full(4, 0.25, np.float32),
            "double": np.array([0.1, 1 / 3, -2.7]), "scale": np.array(1.5, np.float32),
            "count": np.array(7, np.int64)}
    nodes = HONEST  # node i moves every float value by (its rank + 1) STEP: the mean moves them by 3 STEP

    def moved(node):
        k = sorted(nodes).index(node) + 1
        return {key: a + a.dtype.type(k * STEP) if a.dtype.kind == "f" else a + 1 for key, a in base.items()}

    strategy = RobustStrategy("mean", 0)
    messages = strategy.configure_train(1, record(base), ConfigRecord(), FakeGrid(nodes))
    arrays, _ = strategy.aggregate_train(1, [reply(m.metadata.dst_node_id, moved(m.metadata.dst_node_id))
                                             for m in messages])
    out = values(arrays)
    assert {k: (a.dtype, a.shape) for k, a in out.items()} == {k: (a.dtype, a.shape) for k, a in base.items()}
    for key in ("half", "single", "double", "scale"):
        assert out[key].tobytes() == (base[key] + base[key].dtype.type(3 * STEP)).tobytes(), key
    assert not np.array_equal(out["double"], out["double"].astype(np.float32).astype(np.float64))  # not rounded
    assert out["count"] == 7
    strategy.configure_train(2, arrays, ConfigRecord(), FakeGrid(nodes))
    arrays2, _ = strategy.aggregate_train(2, [reply(n, {k: a.copy() for k, a in out.items()}) for n in nodes])
    assert strategy.history[1]["accepted"] == len(nodes) and strategy.history[1]["rejected"] == {}
    assert same_bits(arrays2, arrays)  # round 2 takes the model round 1 returned, scalars included


@pytest.mark.parametrize("spec", ["mean", "centered-clipping", "trimmed-mean"])
@pytest.mark.parametrize("bad", ["rejected", "failed"])
def test_a_round_without_a_usable_reply_makes_no_step_and_the_next_one_does(spec, bad):
    strategy = RobustStrategy(spec, 1)
    needed = strategy.chain.least_n()
    spoilt = (lambda n: reply(n, _bad_arrays("nan"))) if bad == "rejected" else (
        lambda n: Message(error=Error(code=0, reason="ClientApp raised MemoryError"), metadata=meta(n)))
    _, arrays = play(strategy, lambda asked: [spoilt(n) for n in asked], HONEST)
    rec = strategy.history[0]
    assert arrays is None and rec["skipped"] == f"0 valid rows, quorum is {needed}: no step"
    assert rec["accepted"] == 0 and rec["aggregate_sha256"] is None and rec["scores"] == {}
    assert list(rec[bad]) == sorted(HONEST) and rec["flagged"] == (sorted(HONEST) if bad == "rejected" else [])
    _, arrays = play(strategy, lambda asked: [reply(n, trained(n)) for n in asked], HONEST, server_round=2)
    assert arrays is not None and strategy.history[1]["accepted"] == len(HONEST) and not strategy.history[1]["skipped"]


def test_the_server_step_is_the_delta_protocols_with_its_outer_momentum():
    """``w + server_lr F``, and with momentum mu the buffer ``b <- mu b - F``, ``w <- w - server_lr b``."""
    base = {"fc.weight": (np.arange(12, dtype=np.float32).reshape(4, 3) - 6) / 16, "fc.bias": np.zeros(4, np.float32),
            "bn.num_batches_tracked": np.array(7)}  # dyadic: every value below is exact
    moves = [{"fc.weight": 4 * STEP, "fc.bias": -2 * STEP}, {"fc.weight": 8 * STEP, "fc.bias": 8 * STEP}]
    # each protocol's step in rounds 1 and 2, as multiples of the aggregates F1 and F2 (every node moves alike)
    for protocol, steps in {"delta": [(1, 0), (0, 1)], "delta:server_lr=0.5": [(0.5, 0), (0, 0.5)],
                            "delta:server_momentum=0.5": [(1, 0), (0.5, 1)]}.items():
        strategy, sent, expected = RobustStrategy("mean", 0, protocol=protocol), record(base), dict(base)
        for t, (a, b) in enumerate(steps, start=1):
            strategy.configure_train(t, sent, ConfigRecord(), FakeGrid(HONEST))
            moved = {k: v + np.float32(moves[t - 1][k]) if k in moves[0] else v for k, v in values(sent).items()}
            sent, _ = strategy.aggregate_train(t, [reply(n, moved) for n in HONEST])
            expected = {k: v + np.float32(a * moves[0][k] + b * moves[1][k]) if k in moves[0] else v
                        for k, v in expected.items()}
            assert same_bits(sent, record(expected)), (protocol, t)


def test_robust_flower_imports_nodes_only_when_used():
    code = ("import sys, robust.flower; assert 'nodes' not in sys.modules and 'flwr' not in sys.modules; "
            "from robust.flower import RobustStrategy; print(RobustStrategy.__mro__[1].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "FedAvg", out.stderr[-2000:]


# --- A user's app, written like Flower's quickstart-pytorch, with RobustStrategy for FedAvg ---

NODES, ROUNDS, GARBAGE = 6, 4, 0  # GARBAGE: the partition whose node replies NaN weights


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def digits(partition=None):
    """Digits, split 1400 train / 397 test; ``partition`` i of ``NODES`` gets every NODES-th train sample."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = torch.tensor(x[order] / 16, dtype=torch.float32), torch.tensor(y[order])
    if partition is None:
        return x[1400:], y[1400:]
    return x[:1400][partition::NODES], y[:1400][partition::NODES]


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = digits(partition)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1000 * partition + int(msg.content["config"]["server-round"]))
    for _ in range(3):  # local epochs
        for batch in torch.randperm(len(y), generator=g).split(32):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    state = model.state_dict()
    if partition == GARBAGE:
        state = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": len(y)})})
    return Message(content=content, reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = digits(partition)
    acc = float((model(x).argmax(1) == y).float().mean())
    metrics = {"eval-acc": acc} if partition == GARBAGE else {"eval-acc": acc, "num-examples": len(y)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def simulate(server: ServerApp, client: ClientApp, nodes: int, tmp_path: Path, monkeypatch) -> float:
    """Run ``server`` against ``nodes`` simulated SuperNodes running ``client`` (Flower's
    simulation engine, Ray, CPU); returns the seconds it took."""
    from flwr.simulation import run_simulation

    for name, value in {"FLWR_HOME": str(tmp_path / "flwr"), "FLWR_TELEMETRY_ENABLED": "0",
                        "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}.items():
        monkeypatch.setenv(name, value)  # PYTHONPATH: Ray's workers import this module for the ClientApp
    started = time.monotonic()
    run_simulation(server_app=server, client_app=client, num_supernodes=nodes, backend_config={
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": os.cpu_count() or 1, "include_dashboard": False, "logging_level": "ERROR",
                      "log_to_driver": False},
    })
    return time.monotonic() - started


def test_a_flower_app_trains_through_a_node_that_replies_garbage(tmp_path, monkeypatch):
    x_test, y_test = digits()
    out = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Net()

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            with torch.no_grad():
                return MetricRecord({"accuracy": float((model(x_test).argmax(1) == y_test).float().mean())})

        strategy = RobustStrategy(aggregator="nnm+trimmed-mean", tolerate=1, quarantine_after=2,
                                  min_available_nodes=NODES)
        out["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=ROUNDS,
                                       evaluate_fn=central)
        out["strategy"] = strategy

    seconds = simulate(server, client, NODES, tmp_path, monkeypatch)
    strategy, result = out["strategy"], out["result"]
    history = strategy.history
    assert [r["round"] for r in history] == list(range(1, ROUNDS + 1))
    garbage = {node for r in history for node in r["rejected"]}
    assert len(garbage) == 1, history
    (node,) = garbage
    assert [r["rejected"] for r in history[:2]] == [{node: "non-finite values"}] * 2
    assert [r["flagged"] for r in history] == [[node]] * 2 + [[]] * (ROUNDS - 2)  # no honest node flagged
    assert history[-1]["quarantined"] == [node]
    assert [r["asked"] for r in history] == [NODES] * 2 + [NODES - 1] * (ROUNDS - 2)  # quarantined: not asked
    assert all(r["accepted"] == NODES - 1 and node not in r["ids"] and not r["skipped"] for r in history)
    final = result.arrays.to_torch_state_dict()
    assert all(bool(torch.isfinite(v).all()) for v in final.values())
    accuracy = [float(result.evaluate_metrics_serverapp[t]["accuracy"]) for t in range(ROUNDS + 1)]
    assert accuracy[-1] > 0.8 and accuracy[0] < 0.3, accuracy
    assert sorted(result.evaluate_metrics_clientapp) == list(range(1, ROUNDS + 1))  # the garbled metrics cost nothing
    print(f"accuracy by round {accuracy}; rejected {node} twice; simulation {seconds:.1f} s")


# --- The drop-in tried as Flower's own strategy tests try FedAvg: a BatchNorm model in its own dtype ---

PAIR, SPOILT, BN_ROUNDS = 2, 3, 4  # nodes; the round no reply can be used in (one node fails, one sends NaN)
DTYPES = [torch.float16, torch.float32, torch.float64]


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def local_train(state: dict, partition: int, server_round: int) -> dict:
    """Two SGD steps from ``state``, in its dtype, on the node's own data (BatchNorm's running
    statistics and ``num_batches_tracked`` move too): the ClientApp's reply, which the test
    recomputes bit for bit (one thread)."""
    dtype = state["fc1.weight"].dtype
    model = BatchNormNet().to(dtype)
    model.load_state_dict(state)
    g = torch.Generator().manual_seed(100 * partition + server_round)
    x, y = torch.randn(32, 8, generator=g).to(dtype), torch.randint(0, 3, (32,), generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(1):
        for batch in (slice(0, 16), slice(16, 32)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    return model.state_dict()


bn_client = ClientApp()


@bn_client.train()
def train_batchnorm(msg: Message, context: Context) -> Message:
    partition, t = int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"])
    if t == SPOILT and partition == 0:
        raise MemoryError("the node ran out of memory")  # Flower replies with an error
    state = local_train(msg.content["arrays"].to_torch_state_dict(), partition, t)
    if t == SPOILT:
        state = {k: v.fill_(float("nan")) if v.is_floating_point() else v for k, v in state.items()}
    content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": 32})})
    return Message(content=content, reply_to=msg)


def expected_mean_step(sent: dict[str, np.ndarray], partitions: range, server_round: int) -> dict[str, np.ndarray]:
    """The model sent plus the mean of the nodes' updates, written out: rows in float32, the step
    added in float64 if the model has a float64 array (else float32), each array rounded to its
    dtype, integer arrays as sent. (The mean of two rows does not depend on their order.)"""
    floats = [k for k, a in sent.items() if a.dtype.kind == "f"]
    wide = np.float64 if any(sent[k].dtype == np.float64 for k in floats) else np.float32
    replies = [local_train({k: torch.from_numpy(a.copy()) for k, a in sent.items()}, p, server_round)
               for p in partitions]
    rows = torch.stack([torch.cat([torch.from_numpy((r[k].numpy().astype(wide) - sent[k].astype(wide)).astype(np.float32)
                                                     .reshape(-1)) for k in floats]) for r in replies])
    step = iter(torch.split(rows.mean(dim=0), [sent[k].size for k in floats]))  # mean's own reduction
    return {k: (a.astype(wide) + next(step).numpy().astype(wide).reshape(a.shape)).astype(a.dtype) if k in floats else a
            for k, a in sent.items()}


@pytest.fixture(scope="module")
def batchnorm_runs(tmp_path_factory) -> dict:
    """One simulation whose ServerApp trains the BatchNorm model in each float dtype in turn (one
    Ray start for all): by dtype, the run's history, its model after each round (as Flower hands
    it to ``evaluate_fn``; 0: the initial one) and its result."""
    runs = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for dtype in DTYPES:
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = BatchNormNet().to(dtype)
            models = {}
            strategy = RobustStrategy("mean", 1, fraction_evaluate=0.0, min_available_nodes=PAIR)
            result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=BN_ROUNDS,
                                    evaluate_fn=lambda t, arrays: models.update({t: values(arrays)}))
            runs[dtype] = strategy.history, models, result

    with pytest.MonkeyPatch.context() as monkeypatch:
        simulate(server, bn_client, PAIR, tmp_path_factory.mktemp("batchnorm"), monkeypatch)
    return runs


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batchnorm_model_keeps_its_shapes_and_dtypes_and_a_round_without_usable_replies_makes_no_step(
        batchnorm_runs, dtype):
    history, models, result = batchnorm_runs[dtype]
    sent = models[0]
    assert sent["bn.num_batches_tracked"].shape == () and sent["fc1.weight"].dtype == np.dtype(str(dtype)[6:])
    assert sorted(models) == list(range(BN_ROUNDS + 1))
    for t in range(1, BN_ROUNDS + 1):  # every array in its own shape and dtype, scalars included, every round
        assert {k: (a.dtype, a.shape) for k, a in models[t].items()} == {k: (a.dtype, a.shape) for k, a in sent.items()}
        assert models[t]["bn.num_batches_tracked"] == 0  # integers keep the values sent (the nodes' say 2)
    for t in (t for t in range(1, BN_ROUNDS + 1) if t != SPOILT):  # round 2 on: replies to round 1's model accepted
        rec = history[t - 1]
        assert (rec["accepted"], rec["rejected"], rec["failed"], rec["flagged"], rec["skipped"]) == (PAIR, {}, {}, [], "")
        assert same_bits(record(models[t]), record(expected_mean_step(models[t - 1], range(PAIR), t))), t
    spoilt = history[SPOILT - 1]
    assert spoilt["accepted"] == 0 and spoilt["skipped"] == "0 valid rows, quorum is 1: no step"
    assert list(spoilt["rejected"].values()) == ["non-finite values"] and spoilt["aggregate_sha256"] is None
    assert [reason.startswith("node error:") for reason in spoilt["failed"].values()] == [True]
    assert spoilt["flagged"] == list(spoilt["rejected"])  # a lie is flagged, a crash is not
    assert same_bits(record(models[SPOILT]), record(models[SPOILT - 1]))  # no step, and the run went on
    assert same_bits(result.arrays, record(models[BN_ROUNDS]))
    if dtype == torch.float64:  # stepped in float64, not rounded through float32
        w = models[BN_ROUNDS]["fc1.weight"]
        assert not np.array_equal(w, w.astype(np.float32).astype(np.float64))
