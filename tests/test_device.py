"""The coordinator's ``device`` (issue 23, GPU where there is one): the round's rule and detectors
read the rows on a device block by block (``robust.source.on_device``, ``nodes.engine.engine.assess``).
Without a GPU here, these tests run the CUDA path's CPU twin: the same code, every block moved
with ``.to(device)``, must give today's bits; ``cuda`` without a GPU is refused up front; and no
tensor in the rules' code is made without naming its device."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aggregators
from nodes import checkpoint
from nodes.coordinator import audit
from nodes.coordinator.coordinator import Coordinator
from nodes.engine.detectors import score_round
from nodes.engine.engine import assess, replay_note
from nodes.settings import Settings
from nodes.volunteer.volunteer import pick_device
from robust import cli
from robust.compute import profile, resolve_device
from robust.source import Memory, on_device

from .federation_kit import make_federation, play
from .test_source import CHAINS, inputs, rows, spool

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default on a machine without a GPU")
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run in a GPU session)")
SETTINGS = Settings(rounds=3, aggregator="centered-clipping", tolerate=1, quorum=3, protocol="delta:steps=4",
                    spot_check=0.5, verifier="self")
VARIES = ("seconds", "train_seconds_max", "costs", "prev")  # wall-clock figures, and what a randomised signature changes


def run(root: Path, settings: Settings) -> tuple[list[dict], Coordinator]:
    folder, nodes = make_federation(root, 4, settings)
    coord = Coordinator(folder)
    while not coord.done:
        play(coord, nodes, {4: "forge:scale=0.9"})
    records = [json.loads(line) for line in (folder / checkpoint.ROUNDS).read_text().splitlines()]
    for r in records:
        for k in VARIES:
            r.pop(k, None)
        for update in r["updates"].values():
            update.pop("signature")
    return records, coord


@NO_GPU
def test_device_cpu_plays_the_rounds_of_the_default_bit_for_bit(tmp_path):
    default, coord = run(tmp_path / "default", SETTINGS)
    assert coord.settings.device == "auto"
    on_cpu, coord = run(tmp_path / "cpu", dataclasses.replace(SETTINGS, device="cpu", spool="disk"))
    assert coord.engine.device == torch.device("cpu") and coord.spooling
    assert on_cpu == default and len(on_cpu) == 3
    assert all("device" not in r for r in on_cpu)  # a CPU round's record is as it was before the setting
    assert any(r["spot"] for r in on_cpu) and default[-1]["aggregate_sha256"]
    # the stateful rule's state leaves the engine on the CPU, so a checkpoint loads anywhere
    assert all(v.device.type == "cpu" for v in coord.engine.state()["chain"].values())
    assert audit.verify(coord.folder) == ([], 3, True)


def test_a_replay_says_when_the_run_ran_on_another_device(tmp_path, caplog):
    _, coord = run(tmp_path, dataclasses.replace(SETTINGS, device="cpu"))  # a CPU run, GPU or not
    log = coord.folder / checkpoint.ROUNDS
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert replay_note(lines, torch.device("cpu")) == ""
    # the records of a run on a GPU name it (Engine.step: ran_on); the replay runs here, on the CPU
    log.write_text("".join(json.dumps({**r, "device": "cuda/NVIDIA H100 80GB HBM3"}) + "\n" for r in lines))
    with caplog.at_level(logging.WARNING, logger=audit.__name__):
        problems, rounds, replayed = audit.verify(coord.folder, full=False)
    assert (problems, rounds, replayed) == ([], 3, True)  # CPU rows replayed on the CPU: the bits hold
    assert "the run ran on cuda/NVIDIA H100 80GB HBM3, this replay on cpu" in caplog.text
    assert "replay on the run's kind of device" in caplog.text


@pytest.mark.parametrize("spec", aggregators.rules() + CHAINS)
def test_every_rule_and_chain_gives_todays_bits_through_the_device_path(spec, tmp_path):
    today = aggregators.build(spec, f=2)
    from_memory, from_spool = aggregators.build(spec, f=2), aggregators.build(spec, f=2)
    for step in range(3):  # three rounds: the stateful rules read their state on the device too
        X = rows(seed=step)
        expected = today(X, inputs(X, step))
        kept = today.last_kept
        scores = score_round(X, 2, kept)
        for chain, source in ((from_memory, Memory(X)), (from_spool, spool(tmp_path, X, f"s{step}_"))):
            aggregate, got = assess(chain, source, True, inputs(X, step), "cpu")
            assert aggregate.dtype == expected.dtype and torch.equal(aggregate, expected), (spec, step)
            assert (chain.last_kept is None) == (kept is None)
            assert kept is None or torch.equal(chain.last_kept, kept)
            assert got.keys() == scores.keys() and all(torch.equal(got[k], scores[k]) for k in scores)


@GPU
def test_a_run_on_the_gpu_gives_its_bits_again_names_the_gpu_and_passes_its_audit(tmp_path):
    gpu = dataclasses.replace(SETTINGS, device="cuda")
    first, coord = run(tmp_path / "memory", gpu)
    again, _ = run(tmp_path / "spool", dataclasses.replace(gpu, spool="disk"))
    assert first == again and len(first) == 3  # deterministic kernels: the same bits from memory and a spool
    assert all(r["device"].startswith("cuda/") for r in first)
    assert all(v.device.type == "cpu" for v in coord.engine.state()["chain"].values())
    assert audit.verify(coord.folder) == ([], 3, True)  # replayed on the kind of device it ran on


@GPU
@pytest.mark.parametrize("spec", aggregators.rules() + CHAINS)
def test_every_rule_and_chain_on_the_gpu_gives_its_bits_twice_and_the_cpus_to_rounding(spec):
    on_cpu, on_gpu, twice = (aggregators.build(spec, f=2) for _ in range(3))
    for step in range(3):
        X = rows(seed=step)
        cpu, _ = assess(on_cpu, Memory(X), True, inputs(X, step), "cpu")
        with profile(1, "cuda"):  # as the engine runs a round on the device: deterministic kernels
            gpu, scores = assess(on_gpu, Memory(X), True, inputs(X, step), "cuda")
            again, _ = assess(twice, Memory(X), True, inputs(X, step), "cuda")
        assert torch.equal(gpu, again), (spec, step)  # both back on the CPU, as the engine reads them
        assert torch.allclose(gpu, cpu, rtol=1e-4, atol=1e-5), (spec, step, (gpu - cpu).abs().max())
        assert scores.keys() == score_round(X, 2, on_cpu.last_kept).keys()


def test_a_source_on_a_device_hands_out_the_sources_values():
    X = rows()
    source = on_device(Memory(X), "cpu")
    assert (source.shape, source.dtype, source.device) == (X.shape, X.dtype, torch.device("cpu"))
    assert torch.equal(source.tensor(), X) and torch.equal(source.row(4), X[4])
    taken = source.take([7, 2])
    assert type(taken) is type(source) and torch.equal(taken.tensor(), X[[7, 2]])
    assert source.sha256s() == Memory(X).sha256s()


@NO_GPU
def test_cuda_without_a_gpu_is_refused_up_front_and_auto_is_the_cpu(tmp_path, capsys):
    advice = "device = cuda but torch sees no GPU: use device = auto or cpu, or install a CUDA build of PyTorch"
    with pytest.raises(ValueError) as err:
        Settings(device="cuda")
    assert str(err.value) == f"settings: {advice}"
    with pytest.raises(ValueError, match=r"^settings: device = 'gpu': choose auto, cpu or cuda"):
        Settings(device="gpu")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(ValueError, match="--device cuda but torch sees no GPU: use --device auto or cpu"):
        pick_device("cuda")  # a volunteer's option: the same rule, in its own words
    # the coordinator's option comes from the setting's one declaration, refused before any process starts
    folder, _ = make_federation(tmp_path, 3, SETTINGS)
    assert cli.main(["coordinator", "start", str(folder), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"robust coordinator: error: settings: {advice}" and "\n" not in err
    assert Settings.read(folder).device == "auto"  # nothing was written


@NO_GPU
def test_agg_bench_runs_on_the_device_it_is_given(tmp_path):
    out = tmp_path / "bench.json"
    bench = [sys.executable, "-m", "robust.cli", "agg-bench", "--sizes", "10x20000", "--rules", "median,nnm+krum",
             "--repeats", "1", "--no-flower"]
    proc = subprocess.run([*bench, "--device", "cpu", "--json", str(out)], capture_output=True, text=True, check=True)
    assert "our rules on cpu" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert [(r["rule"], r["device"]) for r in results] == [("median", "cpu"), ("nnm+krum", "cpu")]
    refused = subprocess.run([*bench, "--device", "cuda"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--device cuda but torch sees no GPU" in refused.stderr
    assert "timing" not in refused.stderr  # refused before any timing


# Tensor factories: each call in the rules' code names its device, so that no tensor lands on
# the CPU beside rows on a GPU. Where a CPU tensor is meant (a seeded draw from a CPU generator,
# moved afterwards), the call says device="cpu".
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "eye", "tensor", "linspace", "randn", "rand", "randperm",
             "randint", "as_tensor", "triu_indices"}
GUARDED = [*sorted((ROOT / "aggregators").glob("*.py")), ROOT / "robust/geometry.py", ROOT / "robust/source.py",
           ROOT / "nodes/engine/detectors.py"]
# ``x.numpy()`` must read ``x.cpu()``, except where the tensor is known to be on the CPU:
NUMPY_ON_CPU = {
    ("aggregators/_columns.py", "block.numpy()"),  # the branch taken only when not block.is_cuda
    ("robust/source.py", "block[i].numpy()"),  # row_hashes: block = block.cpu() just before
}


def device_less_calls(path: Path) -> list[str]:
    """The calls in ``path`` that make a tensor without naming its device, or read one into
    NumPy without ``.cpu()`` (and not exempted above), as ``file:line: call``."""
    name = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        factory = (f.attr in FACTORIES and isinstance(f.value, ast.Name) and f.value.id == "torch"
                   and not any(k.arg == "device" for k in node.keywords))
        to_numpy = f.attr == "numpy" and not via_cpu(f.value) and (name, ast.unparse(node)) not in NUMPY_ON_CPU
        if factory or to_numpy:
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def via_cpu(expr: ast.expr) -> bool:
    """Whether the method chain ``expr`` (``x.detach().cpu().contiguous()``) passes through ``.cpu()``."""
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        if expr.func.attr == "cpu":
            return True
        expr = expr.func.value
    return False


def test_the_rules_code_names_the_device_of_every_tensor_it_makes():
    assert len(GUARDED) > 20 and all(p.exists() for p in GUARDED)
    assert [call for path in GUARDED for call in device_less_calls(path)] == []


def test_the_guard_finds_a_tensor_made_without_its_device(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = tmp_path / "rule.py"
    bad.write_text("import torch\n\ndef f(X):\n    w = torch.full((3,), 1.0, dtype=torch.float64)\n"
                   "    ok = torch.zeros(3, device=X.device)\n    return X.numpy(), X.cpu().clone().numpy(), X.clone().numpy()\n")
    assert device_less_calls(bad) == ["rule.py:4: torch.full((3,), 1.0, dtype=torch.float64)", "rule.py:6: X.numpy()",
                                      "rule.py:6: X.clone().numpy()"]
