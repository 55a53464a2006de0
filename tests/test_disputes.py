"""Committed trajectories and refereed disputes (``nodes.engine.trajectory``, ``dispute``,
``near_ties``, ``committed``): honest work is cleared, every cheat is convicted on what it did
wrong, and honest machines that differ (real processes at other CPU levels) are cleared."""

from types import SimpleNamespace

import pytest
import torch

import attacks
from nodes.engine import near_ties, trajectory
from nodes.engine.committed import author
from nodes.engine.referee import STEP_TOLERANCE, Claim, settle, step_check
from nodes.engine.training import compute, part_of, redo_step
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, sha256
from robust.profiles import Profile

CPU = torch.device("cpu")
STEPS = 6


@pytest.fixture(scope="module")
def crowd():
    data = load("digits", seed=0)
    w = flat_params(build_model("cnn", data.shape, data.classes, 0))
    return data, w, part_of(data, "2/10")


def task(round: int, w: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(run="t", round=round, base=sha256(w), seed=0, dataset="digits", model="cnn",
                           protocol=f"delta:steps={STEPS}", batch_size=16, lr=0.05, momentum=0.9, threads=1,
                           deadline=60.0)


def ruling(w, part, t, done, claim=None):
    return settle(t, w, part.x, part.y, part.classes, "node-a", done.row, done.root,
                  done.claim() if claim is None else claim, CPU)


def test_an_honest_trajectory_is_committed_reproduced_bit_for_bit_and_cleared(crowd):
    data, w, part = crowd
    t = task(1, w)
    sent, _ = author(t, w, part.x, part.y, part.classes, "node-a", CPU)
    assert sent.committed == [] and len(sent.hashes) == STEPS + 1  # an honest node keeps only its hashes
    done, row = author(t, w, part.x, part.y, part.classes, "node-a", CPU, answering=True)
    assert done.root == sent.root and torch.equal(done.row, sent.row)  # a dispute's answer is recomputed
    assert torch.equal(done.row, compute(t, w, part.x, part.y, part.classes, "node-a", CPU)[0])  # no new bits
    assert torch.equal(done.committed[0], trajectory.start(w))
    assert done.hashes == [sha256(s) for s in done.committed]
    verdict = ruling(w, part, t, done)
    assert not verdict.guilty and verdict.gap == 0.0 and verdict.steps_checked == STEPS
    assert verdict.bytes == 32 * (STEPS + 1) + 4 * 2 * w.numel() * (STEPS + 1)


def test_no_answer_and_a_tampered_commitment_convict(crowd):
    data, w, part = crowd
    t = task(1, w)
    done, _ = author(t, w, part.x, part.y, part.classes, "node-a", CPU, answering=True)
    assert settle(t, w, part.x, part.y, part.classes, "node-a", done.row, done.root, None, CPU).reason.startswith(
        "did not answer")
    other = Claim(done.hashes[:-1] + ["0" * 64], dict(enumerate(done.answered)))
    assert ruling(w, part, t, done, other).reason == "its state hashes do not give the root it signed"
    short = Claim(list(done.hashes), dict(list(enumerate(done.answered))[:-1]))
    assert ruling(w, part, t, done, short).guilty


@pytest.mark.parametrize("cheat, why", [
    ("lazy", "its last state does not give the row it signed"),
    ("forge:scale=0.999", "its last state does not give the row it signed"),
    ("forge:scale=0.9999,consistent=true", "step 1 is not the task's step"),
    ("fewer-steps", f"step {STEPS // 2 + 1} is not the task's step"),
    ("other-data", "step 1 is not the task's step"),
    ("replay-row", "its trajectory does not start at the task's base model"),
    ("bad-dispute", "state 1 does not match its commitment"),
])
def test_each_cheat_is_convicted_on_what_it_did_wrong(crowd, cheat, why):
    data, w0, part = crowd
    first, row = author(task(1, w0), w0, part.x, part.y, part.classes, "node-a", CPU, cheat)
    w = w0 + first.row  # round 2 from a moved model, remembering round 1 as a node does
    t = task(2, w)
    # its answer to the dispute: its work done again, keeping its states, as a volunteer answers one
    done, _ = author(t, w, part.x, part.y, part.classes, "node-a", CPU, cheat, last=first.memory(1, w0, row),
                     answering=True)
    verdict = ruling(w, part, t, done)
    assert verdict.guilty and verdict.reason.startswith(why), verdict.reason


def test_a_near_tie_resolved_otherwise_is_cleared_and_a_flipped_sure_unit_is_not(crowd, monkeypatch):
    """Another machine may resolve a ReLU whose input is within rounding of 0 the other way; the
    referee accepts that, and only that (``nodes.engine.near_ties``)."""
    data, w, part = crowd
    t = task(1, w)
    done, _ = author(t, w, part.x, part.y, part.classes, "node-a", CPU, answering=True)
    states = done.committed
    for relative in (1e-5, 3e-5, 6e-5, 1e-4, 3e-4):  # widen "fragile" until the step has a few such units
        monkeypatch.setattr(near_ties, "RELATIVE", relative)
        found: list = []
        redo_step(t, states[2], part.x, part.y, part.classes, "node-a", 3, CPU, found=found)
        if 1 <= len(set(found)) <= 10:
            break
    fragile = sorted(set(found))
    assert 1 <= len(fragile) <= 10
    moved = [redo_step(t, states[2], part.x, part.y, part.classes, "node-a", 3, CPU, [unit]) for unit in fragile]
    moved = [s for s in moved if not torch.equal(s, states[3])]  # a unit max-pooling ignores moves nothing
    assert moved  # a flip that moves the step: a whole unit's gradient for one sample
    elsewhere = moved[0]

    # the author's whole trajectory as that other machine computes it: step 3 resolved otherwise,
    # every later step honest from there, and the row its last state gives
    fake = [*states[:3], elsewhere]
    for i in range(4, STEPS + 1):
        fake.append(redo_step(t, fake[i - 1], part.x, part.y, part.classes, "node-a", i, CPU))
    row = fake[-1][: w.numel()] - fake[0][: w.numel()]
    claim = Claim([sha256(s) for s in fake], dict(enumerate(fake)))
    root = trajectory.root(claim.hashes)
    verdict = settle(t, w, part.x, part.y, part.classes, "node-a", row, root, claim, CPU)
    assert not verdict.guilty and verdict.near_ties == 1 and verdict.gap <= STEP_TOLERANCE, verdict.reason

    monkeypatch.setattr(near_ties, "RELATIVE", 0.0)  # the unit is no longer fragile: the same flip convicts
    verdict = settle(t, w, part.x, part.y, part.classes, "node-a", row, root, claim, CPU)
    assert verdict.guilty and verdict.step == 3, verdict.reason


def test_a_step_passes_within_rounding_of_its_float64_value_and_a_scaled_step_does_not():
    g = torch.Generator().manual_seed(0)
    before = torch.randn(1000, generator=g, dtype=torch.float64)
    step = 0.1 * torch.randn(1000, generator=g, dtype=torch.float64)  # as a momentum's step is, against its size
    exact = before + step
    own = exact.to(torch.float32)  # the referee's float32 step: rounded
    assert step_check(before, own, own, exact)[0]
    assert step_check(before, (exact + 2e-6 * step).to(torch.float32), own, exact)[0]  # within 1e-5 of it
    scaled = (before + 0.9999 * step).to(torch.float32)  # a consistent forgery's step
    ok, gap = step_check(before, scaled, own, exact)
    assert not ok and gap == pytest.approx(1e-4, rel=0.05)
    # a step whose sums cancel: the referee's own float32 error is large, so is the allowance
    coarse = exact + 3e-4 * step.norm() / 1000**0.5 * torch.randn(1000, generator=g, dtype=torch.float64)
    assert step_check(before, (exact + 2e-4 * step).to(torch.float32), coarse, exact)[0]


def test_profiles_parse_say_their_environment_and_refuse_a_level_the_cpu_lacks(monkeypatch):
    p = Profile.parse("cpu:isa=avx2,threads=2")
    assert (p.isa, p.threads, p.spec) == ("avx2", 2, "cpu:isa=avx2,threads=2")
    assert p.env() == {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2"}
    assert Profile.parse("cpu").env() == {} and Profile.parse("cuda").spec == "cuda"
    from robust import profiles

    monkeypatch.setattr(profiles, "cpu_flags", lambda: frozenset({"sse4_1", "avx", "avx2", "fma"}))
    assert "lacks avx512f" in Profile.parse("cpu:isa=avx512").refusal()
    assert Profile.parse("cpu:isa=avx2").refusal() is None
    for bad, says in (("gpu", "write cpu"), ("cpu:isa=avx9", "isa"), ("cpu:threads=0", "threads")):
        with pytest.raises(ValueError, match=says):
            Profile.parse(bad)


def test_fewer_steps_stands_still_after_its_share_of_the_steps(crowd):
    data, w, part = crowd
    done, _ = author(task(1, w), w, part.x, part.y, part.classes, "node-a", CPU, "fewer-steps:fraction=0.5",
                     answering=True)  # its states kept, as when it answers a dispute
    states = done.committed
    assert not torch.equal(states[STEPS // 2], states[STEPS // 2 - 1])
    assert all(torch.equal(states[i], states[STEPS // 2]) for i in range(STEPS // 2, STEPS + 1))
    assert isinstance(attacks.build("fewer-steps", 1), attacks.NodeAttack)


def test_real_processes_at_other_cpu_levels_are_cleared_and_cheats_convicted():
    """The measurement, small: each profile a process of its own (``ATEN_CPU_CAPABILITY`` and
    ``DNNL_MAX_CPU_ISA`` set before PyTorch starts); their updates differ in their bits."""
    from evaluation.microbench.dispute_grid import measure

    levels = [s for s in ("cpu:isa=default", "cpu:isa=avx2") if Profile.parse(s).refusal() is None]
    if len(levels) < 2:
        pytest.skip("this CPU has no AVX2: one CPU level only")
    result = measure(2, 3, levels, cheats=("forge:scale=0.999,consistent=true", "replay-row"), steps=STEPS,
                     settle_share=1.0)
    assert [p["effective"] for p in result["profiles"]] == ["DEFAULT", "AVX2"]
    assert result["honest_checks"] == 6 and result["honest_pairs_differing"] > 0
    assert result["honest_disputes_cleared"] >= result["honest_pairs_differing"] and result["false_convictions"] == 0
    for cheat in result["cheats"].values():
        assert cheat["checked"] == cheat["convicted"] == 1


@pytest.mark.parametrize("cheat", ["fewer-steps:fraction=0.5", "other-data", "replay-row"])
def test_the_bench_sends_what_a_volunteer_playing_the_cheat_sends(cheat):
    """The bench's batched driver computes these attackers one at a time, as a volunteer does."""
    from evaluation.bench.cell import Cell
    from evaluation.bench.drivers.inprocess import CellRun
    from evaluation.bench.scenario import grid, load_scenario
    from nodes.volunteer.volunteer import forge

    cfg = grid(load_scenario(None, ["rounds=2", "nodes=6", "byzantine=2", "seeds=[0]", "dataset=digits",
                                    "model=mlp"]))[0]
    run = CellRun(Cell(cfg, "mean", cheat, 0))
    alone = attacks.build(cheat, 1).trains_alone  # fewer-steps bends training: computed per node
    for t in (1, 2):
        w, want = run.engine.w, {}
        for fp in run.setup.byzantine:
            i = run.index[fp]
            row, _ = compute(run.task(), w, *run.local(i), run.setup.data.classes, fp, CPU, cheat,
                             run.momenta[i].clone(), run.last.get(i))
            want[fp] = forge(cheat, row, run.last.get(i), t)
        asked = run.engine.select(run.ids)
        X = run.rows(asked)
        run.add(run.engine.step(asked, asked, X))
        for fp, row in want.items():  # a cheat that trains honestly: the batched kernels, equal to rounding
            sent = X[asked.index(fp)]
            assert torch.equal(sent, row) if alone else torch.allclose(sent, row, atol=1e-6)
    assert run.mode == ("local, attackers per node" if alone else "local")
