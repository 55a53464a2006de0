"""Each attack's formula on hand-computed inputs, and the optimal attacks' extra damage."""

import math
from pathlib import Path

import pytest
import torch

import aggregators
import attacks
from attacks.alie import alie_z

F64 = torch.float64
H2 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64)  # mean (2, 3), population std (1, 1)


def ctx(n: int = 4, **kw) -> attacks.Context:
    return attacks.Context(n=n, generator=torch.Generator().manual_seed(0), **kw)


def test_names_and_spec_errors():
    assert {"none", "sign-flip", "gaussian", "inf", "ipm", "alie", "optimal-ipm", "optimal-alie",
            "mimic", "min-max", "min-sum", "fang-krum", "fang-trimmed-mean"} <= set(attacks.names())
    with pytest.raises(ValueError, match="unknown attack 'alie2'.*choose from"):
        attacks.build("alie2", 1)
    with pytest.raises(ValueError, match="ipm: unknown key z"):
        attacks.build("ipm:z=1", 1)
    with pytest.raises(ValueError, match="names one attack"):
        attacks.build("ipm+alie", 1)
    with pytest.raises(ValueError, match=r"gaussian: sigma must be a number >= 0"):
        attacks.build("gaussian:sigma=-1", 1)
    with pytest.raises(ValueError, match="min-max: dev must be one of unit, sign, std"):
        attacks.build("min-max:dev=up", 1)


def test_each_attack_lives_in_a_file_named_after_it_and_robust_attacks_says_which(capsys):
    from robust.cli import main

    assert main(["attacks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["attack", "kind", "file"]
    listed = {name: rest for name, *rest in map(str.split, lines[1:])}
    assert listed == {name: list(where) for name, where in attacks.sources().items()}
    assert set(listed) == set(attacks.names())
    assert listed["sign-flip"] == ["omniscient", "attacks/sign_flip.py"] and listed["lazy"] == ["node", "attacks/lazy.py"]
    root = Path(attacks.__file__).parent.parent
    for name, (_, file) in listed.items():
        assert (root / file).is_file()
        assert name.replace("-", "_").startswith(Path(file).stem), name  # a family (fang-*) shares one file


def test_none_sends_the_nodes_own_updates():
    own = torch.tensor([[7.0, 8.0], [9.0, 10.0]], dtype=F64)
    assert torch.equal(attacks.build("none", 2)(H2, ctx(own=own)), own)
    with pytest.raises(ValueError, match="Context.own"):
        attacks.build("none", 2)(H2, ctx())


def test_sign_flip_ipm_alie_formulas():
    assert torch.equal(attacks.build("sign-flip", 3)(H2, ctx()), torch.tensor([[-2.0, -3.0]] * 3, dtype=F64))
    assert torch.equal(attacks.build("ipm:eps=0.5", 2)(H2, ctx()), torch.tensor([[-1.0, -1.5]] * 2, dtype=F64))
    assert torch.equal(attacks.build("alie:z=1", 2)(H2, ctx()), torch.tensor([[1.0, 2.0]] * 2, dtype=F64))
    assert torch.equal(attacks.build("alie:z=-2", 1)(H2, ctx()), torch.tensor([[4.0, 5.0]], dtype=F64))


def test_alie_default_z_is_the_papers():
    # s = floor(50/2 + 1) - 12 = 14; z = Phi^-1((50 - 12 - 14) / 38) = Phi^-1(0.6316) = 0.336
    assert alie_z(50, 12) == pytest.approx(0.3360, abs=1e-4)
    rows = attacks.build("alie", 12)(H2, ctx(n=50))
    assert torch.allclose(rows[0], torch.tensor([2.0, 3.0], dtype=F64) - alie_z(50, 12))


def test_gaussian_is_seeded_and_has_its_moments():
    a = attacks.build("gaussian:mu=1,sigma=2", 2)(torch.zeros(3, 50_000, dtype=F64), ctx())
    b = attacks.build("gaussian:mu=1,sigma=2", 2)(torch.zeros(3, 50_000, dtype=F64), ctx())
    assert torch.equal(a, b) and a.shape == (2, 50_000)
    assert float(a.mean()) == pytest.approx(1.0, abs=0.03)
    assert float(a.std()) == pytest.approx(2.0, abs=0.03)
    assert not torch.equal(a[0], a[1])  # rows need not be identical


def test_inf_rows_are_refused_by_the_aggregators():
    rows = attacks.build("inf", 2)(H2, ctx())
    assert torch.isinf(rows).all()
    with pytest.raises(ValueError, match=r"rows \[2, 3\] contain NaN or Inf"):
        aggregators.build("median", 1)(torch.cat([H2, rows]))


def test_mimic_copies_a_node():
    H = torch.tensor([[10.0, 0.0], [-10.0, 0.1], [0.0, 1.0], [0.5, -1.0]], dtype=F64)
    assert torch.equal(attacks.build("mimic:node=2", 2)(H, ctx(n=6)), H[[2, 2]])
    with pytest.raises(ValueError, match="mimic node=7 but there are 4 honest rows"):
        attacks.build("mimic:node=7", 1)(H, ctx(n=5))
    attack = attacks.build("mimic:warmup=2", 1)
    first = attack(H, ctx(n=5))
    # the top principal direction is the first axis: an extreme row along it is copied
    assert any(torch.equal(first[0], H[i]) for i in (0, 1))
    attack(H, ctx(n=5))
    chosen = attack.target
    attack(H.flip(0), ctx(n=5))  # after the warm-up the choice of row index is fixed
    assert attack.target == chosen


def test_adaptive_attacks_default_to_their_strongest_measured_setting():
    # evaluation/scenarios/adaptive.toml; the docstrings give the figures
    assert attacks.build("min-max", 1).dev == attacks.build("min-sum", 1).dev == "sign"
    assert attacks.build("poisoned-fl", 1).c == 0.5 and attacks.build("drift", 1).eps == 1.0
    cc = attacks.build("cc-orthogonal", 1)
    assert (cc.angle, cc.lam, cc.radius) == (90.0, 0.9, 0.99)
    H = torch.tensor([[1.0, -3.0], [2.0, -1.0], [4.0, -2.0]], dtype=F64)  # sign differs from unit in 2-D
    assert torch.equal(attacks.build("min-max", 1)(H, ctx()), attacks.build("min-max:dev=sign", 1)(H, ctx()))
    assert not torch.equal(attacks.build("min-max", 1)(H, ctx()), attacks.build("min-max:dev=unit", 1)(H, ctx()))


def test_min_max_and_min_sum_hand_computed():
    # H = 0, 1, 4: mean 5/3, unit perturbation p = +1, m = 5/3 - gamma.
    H = torch.tensor([[0.0], [1.0], [4.0]], dtype=F64)
    # min-max: (4 - m)^2 <= max pairwise 16  ->  gamma = 4 - 7/3 = 5/3  ->  m = 0
    assert float(attacks.build("min-max:dev=unit", 1)(H, ctx())[0, 0]) == pytest.approx(0.0, abs=1e-4)
    # min-sum: 78/9 + 3 gamma^2 <= 25  ->  gamma = 7/3  ->  m = -2/3
    assert float(attacks.build("min-sum:dev=unit", 1)(H, ctx())[0, 0]) == pytest.approx(-2 / 3, abs=1e-4)
    # sign perturbation (the default): the same p here; std perturbation: p = std = sqrt(26/9)
    assert float(attacks.build("min-max", 1)(H, ctx())[0, 0]) == pytest.approx(0.0, abs=1e-4)
    sd = math.sqrt(26 / 9)
    got = float(attacks.build("min-max:dev=std", 1)(H, ctx())[0, 0])
    assert got == pytest.approx(5 / 3 - (5 / 3) / sd * sd, abs=1e-4)


def test_fang_trimmed_mean_pushes_against_the_honest_direction():
    H = torch.tensor([[1.0, -1.0], [3.0, -3.0]], dtype=F64)  # s = (+1, -1)
    rows = attacks.build("fang-trimmed-mean", 50)(H, ctx(n=52))
    assert ((rows[:, 0] >= 0.5) & (rows[:, 0] <= 1.0)).all()  # below w_min = 1, above w_min / 2
    assert ((rows[:, 1] >= -1.0) & (rows[:, 1] <= -0.5)).all()  # above w_max = -1, below w_max / 2
    assert len(set(rows[:, 0].tolist())) == 50


def test_fang_krum_gets_its_row_selected():
    g = torch.Generator().manual_seed(1)
    H = 0.2 + torch.randn(8, 20, generator=g, dtype=F64)  # noisy updates, as gradients are
    krum = aggregators.build("krum", 2)
    rows = attacks.build("fang-krum", 2)(H, ctx(n=10, aggregator=krum))
    assert torch.equal(krum(torch.cat([H, rows])), rows[0])
    assert float(rows[0] @ H.mean(dim=0)) < 0  # it points against the honest direction


def damage(spec: str, agg_spec: str, H: torch.Tensor, f: int) -> float:
    agg = aggregators.build(agg_spec, f)
    rows = attacks.build(spec, f)(H, ctx(n=H.shape[0] + f, aggregator=agg))
    return float((agg(torch.cat([H, rows])) - H.mean(dim=0)).norm())


@pytest.mark.parametrize("agg_spec", ["trimmed-mean", "median", "krum", "nnm+trimmed-mean"])
def test_optimal_attacks_do_more_damage_than_fixed_ones(agg_spec):
    g = torch.Generator().manual_seed(3)
    H = 0.5 + torch.randn(16, 30, generator=g, dtype=F64)
    f = 4
    assert damage("optimal-alie", agg_spec, H, f) >= damage("alie", agg_spec, H, f)
    assert damage("optimal-alie", agg_spec, H, f) > damage("alie:z=0.1", agg_spec, H, f)
    assert damage("optimal-ipm", agg_spec, H, f) >= damage("ipm:eps=0.1", agg_spec, H, f)


def test_optimal_search_leaves_a_stateful_aggregator_untouched():
    agg = aggregators.build("centered-clipping:tau=1", 2)
    H = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=F64)
    attacks.build("optimal-ipm", 2)(H, ctx(n=8, aggregator=agg))
    assert agg.rule.center is None


def test_label_flip_and_backdoor_poison_the_nodes_data():
    x, y = torch.zeros(10, 1, 2, 3), torch.arange(10) % 4
    gen = torch.Generator().manual_seed(0)
    fx, fy = attacks.build("label-flip", 1).poison(x, y, 4, gen)
    assert torch.equal(fx, x) and torch.equal(fy, 3 - y)
    backdoor = attacks.build("backdoor:target=2,fraction=0.3,size=2,value=5,gamma=4", 1)
    bx, by = backdoor.poison(x, y, 4, gen)
    stamped = (bx.reshape(10, -1)[:, -2:] == 5).all(dim=1)
    assert int(stamped.sum()) == 3 and (by[stamped] == 2).all() and torch.equal(by[~stamped], y[~stamped])
    assert torch.equal(x, torch.zeros(10, 1, 2, 3))  # the node's copy, not the data set
    assert backdoor.boost() == 4.0 and attacks.build("label-flip", 1).boost() == 1.0
    with pytest.raises(ValueError, match="backdoor target=7 but the data has 4 classes"):
        attacks.build("backdoor:target=7", 1).poison(x, y, 4, gen)


def test_spread_makes_colluding_rows_differ():
    H = torch.randn(10, 500, generator=torch.Generator().manual_seed(0), dtype=F64)
    same = attacks.build("alie:z=1", 3)(H, ctx(n=13))
    assert torch.equal(same[0], same[1])
    spread = attacks.build("alie:z=1,spread=0.1", 3)(H, ctx(n=13))
    assert not torch.equal(spread[0], spread[1])
    jitter = ((spread - same) / H.std(dim=0, correction=0)).std()  # in units of the honest std
    assert float(jitter) == pytest.approx(0.1, rel=0.05)
    assert torch.equal(spread, attacks.build("alie:z=1,spread=0.1", 3)(H, ctx(n=13)))  # seeded
    with pytest.raises(ValueError, match="label-flip: unknown key spread"):  # omniscient attacks only
        attacks.build("label-flip:spread=0.1", 1)
    with pytest.raises(ValueError, match="alie: spread must be a number >= 0"):
        attacks.build("alie:spread=-1", 1)
