"""The bench's training device (issue 25, item 5): a cell's batched kernels, its momenta and
training tensors live on the cell's ``device`` (``evaluation.bench.drivers.inprocess``), its rows come back to
the CPU for the threat model, the codecs and the engine. Without a GPU the CPU path is the
default's, bit for bit, and ``device = cuda`` is refused up front; with one (the GPU session's
run of this file), a cell trains there, gives the same bits run after run, and ends within a
few points of the CPU's (float sums in another order: another trajectory)."""

from __future__ import annotations

import pytest
import torch

from evaluation.bench.cell import Cell
from evaluation.microbench.gpu_vs_cpu import compare
from evaluation.bench.drivers.inprocess import run_cell
from evaluation.bench.scenario import grid, load_scenario

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run in a GPU session)")
SMALL = ["nodes=8", "byzantine=2", "rounds=12", "seeds=[0]", 'partition="dirichlet"']


def cell(device: str, model: str = "mlp", attack: str = "alie", *more: str) -> Cell:
    config = grid(load_scenario(None, [*SMALL, f'model="{model}"', f'device="{device}"', *more]))[0]
    return Cell(config, "nnm+trimmed-mean", attack, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default on a machine without a GPU")
def test_without_a_gpu_cells_train_on_the_cpu_with_the_defaults_bits():
    default, cpu = run_cell(cell("auto")), run_cell(cell("cpu"))
    assert default["device"] == cpu["device"] == "cpu"
    assert default["model_sha256"] == cpu["model_sha256"]
    assert default["accuracy"] == cpu["accuracy"]
    with pytest.raises(ValueError, match="device = cuda but torch sees no GPU: use device = auto or cpu"):
        cell("cuda")


def test_the_comparison_pairs_cells_and_measures_their_gaps():
    def rec(agg, acc, sha, fq=0):
        return {"aggregator": agg, "attack": "none", "seed": 0, "final_accuracy": acc, "model_sha256": sha,
                "false_quarantines": fq, "device": "cuda/X"}
    cpu = {(a, "none", 0): rec(a, acc, a) for a, acc in (("mean", 0.9), ("median", 0.8))}
    gpu = {(a, "none", 0): rec(a, acc, sha, 1) for a, acc, sha in (("mean", 0.93, "mean"), ("median", 0.79, "x"))}
    out = compare(cpu, gpu)
    assert out["cells"] == 2 and out["same_bits"] == 1 and out["devices"] == ["cuda/X"]
    assert out["mean_abs_gap_pp"] == pytest.approx(2.0) and out["max_abs_gap_pp"] == pytest.approx(3.0)
    assert out["max_gap_cell"] == "mean/none/0" and out["false_quarantines"] == {"cpu": 0, "gpu": 2}
    with pytest.raises(ValueError, match="different cells"):
        compare(cpu, {k: v for k, v in gpu.items() if k[0] == "mean"})


@GPU
@pytest.mark.parametrize("model", ["mlp", "cnn"])  # the hand-written dense kernels, and vmap over a model copy
def test_a_cell_trains_on_the_gpu_with_the_same_bits_twice_and_near_the_cpus(model):
    first, again, cpu = run_cell(cell("cuda", model)), run_cell(cell("cuda", model)), run_cell(cell("cpu", model))
    assert first["device"].startswith("cuda/") and cpu["device"] == "cpu"
    assert first["model_sha256"] == again["model_sha256"] and first["accuracy"] == again["accuracy"]
    assert abs(first["final_accuracy"] - cpu["final_accuracy"]) <= 0.05
    assert first["false_quarantines"] == 0


@GPU
def test_a_gpu_cell_with_node_side_attackers_and_spot_checks_convicts_no_honest_node():
    # label-flip trains on the GPU in the batch; neurotoxin trains alone, on the CPU, per node
    for attack in ("label-flip", "neurotoxin"):
        record = run_cell(cell("cuda", "mlp", attack, "spot-check=0.5"))
        assert record["device"].startswith("cuda/") and record["false_convictions"] == 0, attack
        assert record["spot_checks"] > 0
