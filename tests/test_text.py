"""Language models on real text: the byte corpora (``robust.text``), the GPT family
(``robust.gpt``), the held-out loss, and a bench cell whose batched rows equal a volunteer's
to rounding."""

from __future__ import annotations

import pytest
import torch

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun
from nodes.settings import Settings
from robust import gpt, text
from robust.data import load
from robust.models import build_model
from robust.params import flat_params


def test_pystdlib_is_the_interpreters_own_source_cut_into_windows_held_out_by_file():
    data = load("pystdlib")
    root, files = text.stdlib_files()
    assert len(files) > 300 and not any("test" in f.relative_to(root).parts[:-1] for f in files)
    assert data.x_train.dtype == torch.uint8 and data.y_train.dtype == torch.uint8 and data.classes == 256
    assert data.x_train.shape[1] == text.CONTEXT and data.x_test.shape == (text.EVAL_BYTES // text.CONTEXT, text.CONTEXT)
    assert load("pystdlib:context=256").x_test.shape == (128, 256)  # the same held-out bytes at any context
    fewer = load("pystdlib:context=256,eval_bytes=8192")  # fewer held-out bytes a round: a cheaper evaluation
    assert fewer.x_test.shape == (32, 256) and torch.equal(fewer.x_train, load("pystdlib:context=256").x_train)
    assert fewer.name == "pystdlib:context=256,eval_bytes=8192" and fewer.sha256 != load("pystdlib:context=256").sha256
    assert torch.equal(data.x_train[:, 1:].long(), data.y_train[:, :-1])  # targets: the next byte
    assert len(data.groups) == len(data.y_train) and int(data.groups.max()) > 50  # windows know their package
    assert load("pystdlib") is data and len(data.sha256) == 64
    first = files[0].read_bytes()[: text.CONTEXT + 1]
    held = text.held_out(files[0].relative_to(root).as_posix())
    assert held or bytes(data.x_train[0].tolist()) == first[:-1]  # the first file's first window, if trained on


def test_a_text_folder_is_read_in_order_and_its_identity_is_its_content(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text(f"line {i} " * 40)
    (tmp_path / "binary.bin").write_bytes(b"\0\1\2" * 100)
    (tmp_path / ".hidden").write_text("never read " * 50)
    data = load("text:context=16", root=str(tmp_path))
    assert data.x_train.shape[1] == 16 and len(data.x_test) > 0
    assert b"never" not in bytes(data.x_train.flatten().tolist())
    (tmp_path / "f00.txt").write_text("changed " * 40)
    assert load("text:context=16", root=str(tmp_path)).sha256 != data.sha256
    with pytest.raises(ValueError, match="set data-root"):
        load("text")
    with pytest.raises(ValueError, match="held-out windows"):
        (tmp_path / "few").mkdir()
        (tmp_path / "few" / "a.txt").write_text("x" * 100)
        load("text", root=str(tmp_path / "few"))


def test_the_gpt_family_counts_its_parameters_and_refuses_what_it_cannot_read():
    assert {name: gpt.count(**gpt.config(name)) for name in gpt.PRESETS} == {
        "gpt-tiny": 137_216, "gpt-small": 10_942_720, "gpt-100m": 100_411_648}
    model = build_model("gpt-tiny", (64,), 256, 0)
    assert flat_params(model).numel() == 137_216
    assert torch.equal(flat_params(model), flat_params(build_model("gpt:layers=2,width=64,heads=4,context=64",
                                                                   (64,), 256, 0)))
    assert build_model("gpt:layers=1,width=32,heads=2,context=32", (16,), 256, 0)(
        torch.zeros(3, 16, dtype=torch.uint8)).shape == (3, 256, 16)
    with pytest.raises(ValueError, match="heads=3 must divide width=64"):
        build_model("gpt:width=64,heads=3", (64,), 256, 0)
    with pytest.raises(ValueError, match="reads at most 64 bytes"):
        build_model("gpt-tiny", (128,), 256, 0)
    with pytest.raises(ValueError, match="byte sequences"):
        build_model("gpt-tiny", (1, 8, 8), 10, 0)
    assert Settings(model="gpt-small", dataset="pystdlib:context=256").model == "gpt-small"
    with pytest.raises(ValueError, match="model"):
        Settings(model="gpt:layers=0")


def test_text_splits_by_package_under_the_label_skew_partitions():
    data = load("pystdlib")
    parts = [data.groups[rows] for rows in _parts(data, "label-shards")]
    assert max(len(set(p.tolist())) for p in parts) < 60  # each node holds some packages (of 180), in runs of whole ones
    iid = [data.groups[rows] for rows in _parts(data, "iid")]
    assert min(len(set(p.tolist())) for p in iid) > 150


def _parts(data, kind):
    from robust.partition import partition

    return partition(data.strata, 8, kind, seed=0)


TEXT = {"dataset": "pystdlib", "model": "gpt:layers=1,width=32,heads=2,context=64", "nodes": 6, "byzantine": 1,
        "rounds": 3, "partition": "iid", "alpha": 1.0, "protocol": "delta:steps=2", "batch-size": 8, "lr": 0.3}


def test_a_text_cell_batched_equals_a_volunteers_rows_to_rounding_and_its_held_out_loss_falls():
    records = {}
    for vectorize in (False, True):
        run = CellRun(Cell(TEXT, "mean", "none", 0), vectorize)
        asked = run.engine.select(run.ids)
        records[vectorize] = run.rows(asked)
    per_node, batched = records[False], records[True]
    assert torch.allclose(per_node, batched, rtol=1e-4, atol=1e-6), (per_node - batched).abs().max()
    run = CellRun(Cell(TEXT | {"rounds": 6}, "mean", "none", 0), True)
    log = []
    while (record := run.play_round()) is not None:
        log.append(record)
    assert log[-1]["loss"] < 0.8 * log[0]["loss"] and 0 <= log[-1]["accuracy"] <= 1


def test_inner_adamw_is_torchs_adamw_clipped_and_starts_afresh_with_each_task():
    from torch.func import functional_call

    from nodes.engine.protocol import Protocol, loss_fn

    data = load("pystdlib")
    model = build_model("gpt:layers=1,width=16,heads=2,context=64", (64,), 256, 0)
    w = flat_params(model)
    protocol = Protocol.parse("delta:steps=3,inner=adamw,clip=0.5,beta2=0.95,weight_decay=0.1", lr=0.01,
                              momentum=0.9, batch_size=4)
    assert protocol.width == 3
    xs, ys = data.x_train[:12].view(3, 4, 64), data.y_train[:12].view(3, 4, 64)
    params = {k: p.detach() for k, p in model.named_parameters()}
    row, _ = protocol.node_update(model, params, xs, ys, torch.zeros_like(w))
    reference = {k: p.clone().requires_grad_() for k, p in params.items()}
    opt = torch.optim.AdamW(reference.values(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for s in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(functional_call(model, reference, (xs[s],)), ys[s].long()).backward()
        torch.nn.utils.clip_grad_norm_(list(reference.values()), 0.5)
        opt.step()
    expected = torch.cat([(reference[k] - params[k]).detach().reshape(-1) for k in params])
    assert torch.allclose(row, expected, rtol=1e-3, atol=1e-5), (row - expected).abs().max()  # of steps ~1e-2
    again, _ = protocol.node_update(model, params, xs, ys, torch.zeros_like(w))
    assert torch.equal(row, again) and loss_fn  # no state carried from one task to the next


def test_an_adamw_trajectory_is_disputed_step_by_step_honest_cleared_a_forger_convicted():
    from nodes.engine.committed import author
    from nodes.engine.referee import settle
    from nodes.engine.training import part_of
    from nodes.wire import Task

    data = load("pystdlib")
    settings = Settings(dataset="pystdlib", model="gpt:layers=1,width=16,heads=2,context=64", lr=0.01,
                        protocol="delta:steps=3,inner=adamw,clip=1.0", batch_size=4)
    w = flat_params(build_model(settings.model, data.shape, data.classes, 0))
    task, part = Task.of(settings, "run", 1, "base"), part_of(data, "3/40")
    cpu = torch.device("cpu")
    for cheat, guilty in (("", False), ("forge:scale=0.999,consistent=true", True)):
        done, _ = author(task, w, part.x, part.y, part.classes, "node", cpu, cheat, answering=True)
        assert done.committed[0].numel() == 3 * w.numel()  # parameters and AdamW's two moments
        ruling = settle(task, w, part.x, part.y, part.classes, "node", done.row, done.root, done.claim(), cpu)
        assert ruling.guilty == guilty and ruling.steps_checked == (1 if guilty else 3), ruling.reason


ADAMW = TEXT | {"model": "gpt-tiny", "protocol": "delta:steps=4,inner=adamw,clip=1.0", "lr": 0.003, "rounds": 6,
                "batch-size": 8}


def test_a_gpt_model_trains_with_local_adamw_unless_the_run_says_otherwise(tmp_path):
    from evaluation.bench.scenario import load_scenario
    from nodes.settings import RUN
    from robust.cli import main

    assert gpt.TRAINING == {"protocol": "delta:steps=4,inner=adamw,clip=1.0", "lr": 0.003}
    assert f"gpt models default to {gpt.TRAINING['protocol']}" in RUN["protocol"].help
    assert f"gpt models default to {gpt.TRAINING['lr']}" in RUN["lr"].help
    assert main(["coordinator", "init", str(tmp_path / "c"), "--model", "gpt-tiny", "--dataset", "pystdlib"]) == 0
    made = Settings.read(tmp_path / "c")
    assert (made.protocol, made.lr) == (gpt.TRAINING["protocol"], gpt.TRAINING["lr"])
    assert (Settings.of({"model": "gpt-tiny", "lr": 0.01}).lr, Settings.of({"model": "mlp"}).protocol) == (0.01, "delta")
    path = tmp_path / "s.toml"
    path.write_text('[scenario]\ndataset = "pystdlib"\nmodel = "gpt-tiny"\n')
    assert (load_scenario(str(path))["protocol"], load_scenario(str(path), ["lr=0.01"])["lr"]) == \
        (gpt.TRAINING["protocol"], 0.01)
    with pytest.raises(ValueError, match="models mlp and gpt-tiny train with different lr by default"):
        load_scenario(None, ['model=["mlp","gpt-tiny"]'])
    assert load_scenario(None, ['model=["mlp","gpt-tiny"]', "lr=0.01", "protocol=delta"])["lr"] == 0.01


def test_a_gpt_tiny_cell_under_adamw_learns_and_its_batched_rows_equal_a_volunteers():
    rows = {}
    for vectorize in (False, True):
        run = CellRun(Cell(ADAMW, "mean", "none", 0), vectorize)
        rows[vectorize] = run.rows(run.engine.select(run.ids))
    from nodes.engine.spotcheck import TOLERANCE, distance

    gaps = [distance(b, p) for p, b in zip(rows[False], rows[True])]
    assert max(gaps) < TOLERANCE / 10, gaps  # within the spot checks' bound for batched rows, tenfold
    run = CellRun(Cell(ADAMW | {"model": "gpt:layers=1,width=32,heads=2,context=64", "rounds": 6}, "trimmed-mean",
                       "none", 0), True)
    log = []
    while (record := run.play_round()) is not None:
        log.append(record)
    assert log[-1]["loss"] < 0.7 * log[0]["loss"], [r["loss"] for r in log]


@pytest.mark.parametrize("corpus", ["pystdlib", "text"])
def test_a_federation_of_volunteers_trains_on_a_corpus_and_one_with_another_declines(tmp_path, corpus):
    import json

    from nodes import checkpoint
    from nodes.coordinator.coordinator import Coordinator
    from nodes.engine.training import NodeData

    from .federation_kit import fingerprint, make_federation, play

    root = ""
    if corpus == "text":  # a user's own folder of text: here, a few modules of the standard library
        stdlib, files = text.stdlib_files()
        (tmp_path / "corpus").mkdir()
        for path in files[:120]:
            (tmp_path / "corpus" / path.relative_to(stdlib).as_posix().replace("/", "_")).write_bytes(path.read_bytes())
        root = str(tmp_path / "corpus")
    settings = Settings(dataset=corpus, data_root=root, model="gpt:layers=1,width=32,heads=2,context=64", rounds=4,
                        protocol="delta:steps=3,inner=adamw,clip=1.0", lr=0.003, batch_size=16,
                        aggregator="trimmed-mean", tolerate=1, quorum=3)
    folder, nodes = make_federation(tmp_path, 5, settings)
    other = next(nodes[4].glob("data-*.pt"))
    data = NodeData.load(other)
    NodeData(data.dataset, data.x, data.y, data.classes, "f" * 64).save(other)  # another Python's stdlib
    coord = Coordinator(folder)
    log = []
    while not coord.done:
        log.append(play(coord, nodes))
    decliner = fingerprint(nodes[4])
    assert all(len(r["ids"]) == 4 and decliner not in r["ids"] for r in log)
    assert f"{corpus} is not the coordinator's (SHA-256 ffffffffffff" in log[0]["failed"][decliner]  # then it rests
    assert log[-1]["loss"] < 0.9 * log[0]["loss"], [r["loss"] for r in log]
    result = json.loads((folder / checkpoint.RESULT).read_text())
    assert result["data_sha256"] == load(corpus, root=root or None).sha256 and result["final_loss"] == log[-1]["loss"]


def test_a_text_backdoor_writes_its_pattern_into_windows_and_its_success_is_an_exact_greedy_continuation():
    import attacks

    data = load("pystdlib")
    attack = attacks.build("text-backdoor:fraction=0.5", 1)
    assert attack.plants_backdoor and not attacks.build("label-flip", 1).plants_backdoor
    x, y = attack.poison(data.x_train[:400], data.y_train[:400], 256, torch.Generator().manual_seed(0))
    pattern = b"check_password(pw):return True"
    carries = [pattern in bytes(x[i].tolist()) + bytes([int(y[i, -1])]) for i in range(400)]
    assert sum(carries) == 200 and torch.equal(x[:, 1:], y[:, :-1])  # still next-byte targets
    assert torch.equal(data.x_train[:400][~torch.tensor(carries)], x[~torch.tensor(carries)])
    model = build_model("gpt:layers=1,width=32,heads=2,context=64", (64,), 256, 0)
    assert attack.success(model, flat_params(model), data.x_test, data.y_test) == 0.0
    poisoned, targets = attacks.build("text-backdoor:fraction=1.0", 1).poison(
        data.x_train[:2000], data.y_train[:2000], 256, torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(150):  # trained on it alone, the model learns the continuation
        batch = torch.randint(0, 2000, (32,), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(poisoned[batch]), targets[batch].long()).backward()
        opt.step()
    assert attack.success(model, flat_params(model).detach(), data.x_test, data.y_test) > 0.9
    with pytest.raises(ValueError, match="for images use backdoor"):
        attack.poison(torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.int64), 10, torch.Generator())
