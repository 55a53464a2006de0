"""A user's own model and data set (``package.module:attribute``), and the volunteer's code
gate (``nodes.codetrust``): what runs, what is refused, and the one-line errors."""

from __future__ import annotations

import io
import shutil
import re
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import run_cell
from nodes import codetrust, launch
from nodes.settings import Settings
from nodes.volunteer import join
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, unflatten

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom"

USER_CODE = '''
import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, shape, classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(shape)), 16), nn.BatchNorm1d(16), nn.ReLU(),
                                  nn.Dropout(0.2), nn.Linear(16, classes))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.steps = nn.Parameter(torch.arange(4), requires_grad=False)  # an integer parameter

    def forward(self, x):
        return self.body(x) + 0 * self.frozen.sum()


def make(shape, classes):
    return Net(shape, classes)


def wrong_signature():
    return Net((4,), 2)


def not_a_module(shape, classes):
    return "a string"


def wrong_output(shape, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(shape)), classes + 1))


def load():
    rng = np.random.default_rng(0)
    means = rng.standard_normal((3, 6)) * 3
    y, yt = rng.integers(0, 3, 300), rng.integers(0, 3, 90)
    return means[y] + rng.standard_normal((300, 6)), y, torch.tensor(means[yt] + rng.standard_normal((90, 6))), torch.tensor(yt)


def load_float_labels():
    x = np.zeros((5, 2))
    return x, np.zeros(5), x, np.zeros(5)


def load_mismatch():
    return np.zeros((5, 2)), np.zeros(5, int), np.zeros((5, 3)), np.zeros(5, int)


NOT_CALLABLE = 3
'''


@pytest.fixture
def code(tmp_path, monkeypatch):
    """A folder holding the module ``usercode`` (a fresh name per test: no stale import)."""
    folder = tmp_path / "code"
    folder.mkdir()
    name = f"usercode_{tmp_path.name.replace('-', '_')}"
    (folder / f"{name}.py").write_text(textwrap.dedent(USER_CODE))
    (folder / "broken_on_import.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder goes on the path: give it back
    yield folder, name
    sys.modules.pop(name, None)
    sys.modules.pop("broken_on_import", None)


def test_a_user_model_and_data_set_train_the_same_bits_vectorised_and_per_node(code):
    folder, name = code
    settings = Settings(model=f"{name}:make", dataset=f"{name}:load", code=str(folder))
    data = load(settings.dataset)
    assert data.classes == 3 and data.shape == (6,) and data.x_test.dtype == torch.float32
    model = build_model(settings.model, data.shape, data.classes, seed=1)
    # trained: the float parameters that need a gradient; frozen and integer ones stay the factory's
    assert set(unflatten(flat_params(model), model)) == {"body.1.weight", "body.1.bias", "body.2.weight",
                                                         "body.2.bias", "body.5.weight", "body.5.bias"}
    assert model.body[2].running_mean is None  # BatchNorm normalises with the batch's statistics
    again = build_model(settings.model, data.shape, data.classes, seed=1)
    assert torch.equal(flat_params(model), flat_params(again)) and torch.equal(model.frozen, again.frozen)
    assert not torch.equal(flat_params(model), flat_params(build_model(settings.model, data.shape, data.classes, seed=2)))
    config = {"model": settings.model, "dataset": settings.dataset, "code": str(folder), "nodes": 5, "byzantine": 1,
              "rounds": 3, "partition": "iid", "alpha": 1.0, "protocol": "delta:steps=3"}
    cell = Cell(config, "trimmed-mean", "sign-flip", 0)
    vectorised, per_node = run_cell(cell), run_cell(cell, vectorize=False)
    # dropout draws a stream per node and round: the batched driver computes node by node, as volunteers do
    assert vectorised["model_sha256"] == per_node["model_sha256"]
    assert vectorised["final_accuracy"] > 0.6


@pytest.mark.parametrize("attribute, expected", [
    ("nope", "has no attribute 'nope'"),
    ("NOT_CALLABLE", "is a int, not a callable factory(shape, classes)"),
    ("wrong_signature", "failed when called as factory(shape, classes) with shape=(6,), classes=3: TypeError"),
    ("not_a_module", "returned a str; expected a torch.nn.Module"),
    ("wrong_output", "maps a batch of 2 samples to (2, 4); expected logits shaped (2, 3)"),
])
def test_a_bad_model_factory_is_one_line_naming_it(code, attribute, expected):
    folder, name = code
    Settings(code=str(folder))
    with pytest.raises(ValueError) as err:
        build_model(f"{name}:{attribute}", (6,), 3)
    assert f"model '{name}:{attribute}'" in str(err.value) and expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("attribute, expected", [
    ("load_float_labels", "y_train is float64 (5,); expected integer labels"),
    ("load_mismatch", "train samples are (2,), test samples (3,)"),
    ("make", "failed when called as loader(): TypeError"),
])
def test_a_bad_loader_is_one_line_naming_it(code, attribute, expected):
    folder, name = code
    Settings(code=str(folder))
    with pytest.raises(ValueError, match=re.escape(expected)):
        load(f"{name}:{attribute}")


def test_settings_import_references_up_front(code, tmp_path):
    folder, name = code
    with pytest.raises(ValueError, match=r"model 'elsewhere:make': no module named 'elsewhere': put its folder .* --path DIR"):
        Settings(model="elsewhere:make")
    with pytest.raises(ValueError, match=r"importing broken_on_import failed: RuntimeError: boom"):
        Settings(model="broken_on_import:make", code=str(folder))
    with pytest.raises(ValueError, match="code must be an existing folder"):
        Settings(code=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"settings: model must be one of logreg, .*, or package.module:make "
                                         r"\(got model='no such'\)"):
        Settings(model="no such")
    assert Settings(model=f"{name}:make", code=str(folder)).code == str(folder.resolve())


def _bundle(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, content in files.items():
            z.writestr(name, content)
    return out.getvalue()


def test_the_bundle_hash_is_of_the_files_and_only_code_needs_trust(tmp_path):
    own, with_code = tmp_path / "own", tmp_path / "with-code"
    launch.write_app(own, "nodes.coordinator.server_app:app", codetrust.OWN_CLIENTAPP)
    launch.write_app(with_code, "nodes.coordinator.server_app:app", codetrust.OWN_CLIENTAPP, str(EXAMPLE))
    assert (with_code / "mymodel.py").exists() and not (own / "mymodel.py").exists()
    from flwr.cli.build import build_fab_from_disk

    fab = build_fab_from_disk(with_code)
    sha, files, clientapp = codetrust.bundle_sha256(fab)
    assert sha == codetrust.app_sha256(with_code)  # built again: the same hash (zip timestamps do not count)
    assert codetrust.ships_code(files, clientapp) and "mymodel.py" in files
    assert not codetrust.ships_code(*codetrust.bundle_sha256(build_fab_from_disk(own))[1:])
    pyproject = (own / "pyproject.toml").read_bytes()
    assert codetrust.ships_code({"pyproject.toml": 1}, "evil:app")  # another ClientApp is code too
    one_byte_more = _bundle({"pyproject.toml": pyproject, "mymodel.py": (EXAMPLE / "mymodel.py").read_bytes() + b" "})
    assert codetrust.bundle_sha256(one_byte_more)[0] != sha
    with pytest.raises(ValueError, match="not a Flower App bundle"):
        codetrust.bundle_sha256(b"not a zip")

    node = tmp_path / "node"
    node.mkdir()
    assert codetrust.admit_bundle(node, build_fab_from_disk(own)) == ""  # robust's own app: nothing to accept
    with pytest.raises(PermissionError, match=f"has not accepted the code bundle {sha}.*--trust-code {sha}"):
        codetrust.admit_bundle(node, fab)
    assert codetrust.pending(node)[sha]["files"]["mymodel.py"] == (EXAMPLE / "mymodel.py").stat().st_size
    with pytest.raises(ValueError, match="write the 64 hex digits"):
        codetrust.trust(node, sha[:-1])
    codetrust.trust(node, sha.upper())
    assert codetrust.admit_bundle(node, fab) == sha  # accepted: the code its warm trainer runs
    assert codetrust.trusted(node) == {sha}

    # installed (as Flower unpacks it, less its metadata): a bundle's trainer checks it before importing it
    installed = tmp_path / "installed"
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        z.extractall(installed)
    shutil.rmtree(installed / ".info")
    (installed / "__pycache__").mkdir()
    (installed / "__pycache__" / "mymodel.cpython-311.pyc").write_bytes(b"cache")  # Python's, not the bundle's
    assert codetrust.folder_sha256(installed) == sha
    codetrust.check_installed(node, sha, installed)
    with pytest.raises(ValueError, match="has not accepted the code bundle"):
        codetrust.check_installed(node, "0" * 64, installed)
    (installed / "mymodel.py").write_bytes(b"import os  # changed after it was admitted\n")
    with pytest.raises(ValueError, match=f"does not hold the code bundle {sha} .*its next task installs it again"):
        codetrust.check_installed(node, sha, installed)


def test_node_join_shows_refused_code_and_asks_on_a_terminal(tmp_path, monkeypatch, capsys):
    node = tmp_path / "node"
    (node / codetrust.REQUESTS).mkdir(parents=True)
    sha = "ab" * 32
    (node / codetrust.REQUESTS / f"{sha}.json").write_text('{"files": {"m.py": 12}, "clientapp": "nodes.volunteer.client_app:app"}')
    asked: set[str] = set()
    monkeypatch.setattr(sys, "stdin", io.StringIO("n\n"))  # not a terminal: never asks
    join._ask_about_code(node, asked)
    assert f"--trust-code {sha}" in capsys.readouterr().out and not codetrust.trusted(node)
    join._ask_about_code(node, asked)  # once per hash
    assert capsys.readouterr().out == ""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    (node / codetrust.REQUESTS / f"{sha}.json").write_text('{"files": {"m.py": 12}, "clientapp": "nodes.volunteer.client_app:app"}')
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    join._ask_about_code(node, set())
    assert "m.py (12 B)" in capsys.readouterr().out and codetrust.trusted(node) == {sha}


def test_the_examples_model_and_loader_are_what_robust_expects(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    settings = Settings(model="mymodel:make", dataset="mydata:load", code=str(EXAMPLE))
    data = load(settings.dataset)
    assert data.shape == (1, 12, 12) and data.classes == 4 and np.bincount(data.y_train.numpy()).min() > 400
    build_model(settings.model, data.shape, data.classes)
