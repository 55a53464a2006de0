"""robust.data (offline sets, IDX and CIFAR readers) and robust.partition."""

from __future__ import annotations

import gzip
import math
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from robust.data import CIFAR_FILES, IDX_FILES, load, names
from robust.partition import FLWR_KINDS, KINDS, partition

OFFLINE = {  # name: (shape, train size, test size)
    "digits": ((1, 8, 8), 1437, 360),
    "mnist1d": ((1, 40), 4000, 1000),
    "synthetic": ((32,), 3000, 1000),
}


@pytest.fixture(scope="module")
def offline():
    """Each generated set once (mnist1d takes seconds to make)."""
    return {name: load(name) for name in OFFLINE}


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std per channel (dim 1) in float64."""
    flat = x.double().transpose(0, 1).reshape(x.shape[1], -1)
    return flat.mean(dim=1), flat.std(dim=1, correction=0)


# ------------------------------------------------------------------ the generated sets


def test_names():
    assert names() == ["digits", "mnist1d", "synthetic", "mnist", "fashion-mnist", "cifar10", "hf-disk", "pystdlib", "text"]


@pytest.mark.parametrize("name", OFFLINE)
def test_offline_set_shapes_dtypes_and_standardisation(offline, name):
    ds = offline[name]
    shape, n_train, n_test = OFFLINE[name]
    assert ds.name == name and ds.classes == 10 and ds.shape == shape
    assert ds.x_train.shape == (n_train, *shape) and ds.x_test.shape == (n_test, *shape)
    assert ds.x_train.dtype == ds.x_test.dtype == torch.float32
    assert ds.y_train.dtype == ds.y_test.dtype == torch.int64
    assert ds.y_train.shape == (n_train,) and ds.y_test.shape == (n_test,)
    assert set(ds.y_train.tolist()) == set(ds.y_test.tolist()) == set(range(10))
    mean, std = channel_stats(ds.x_train)
    assert torch.allclose(mean, torch.zeros_like(mean), atol=1e-5)
    assert torch.allclose(std, torch.ones_like(std), atol=1e-4)
    assert torch.isfinite(ds.x_test).all()
    # the test set is scaled like the train set, so its statistics are near, not exactly, 0 and 1
    t_mean, t_std = channel_stats(ds.x_test)
    assert t_mean.abs().max() < 0.2 and (t_std - 1).abs().max() < 0.2


def test_digits_split_is_stratified(offline):
    ds = offline["digits"]
    train, test = torch.bincount(ds.y_train), torch.bincount(ds.y_test)
    assert ((test - 0.2 * (train + test)).abs() <= 1).all()


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_same_seed_same_bits_other_seed_other_data(offline, name):
    again, other = load(name), load(name, seed=1)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(again, field), getattr(offline[name], field))
    assert not torch.equal(other.x_train, again.x_train)


@pytest.fixture
def uncached():
    """No set made by another test, none left for the next: this test changes how sets are made."""
    from robust import data

    data._generated.cache_clear()
    yield
    data._generated.cache_clear()


def test_mnist1d_is_seeded_and_leaves_the_global_rngs_alone(monkeypatch, uncached):
    import mnist1d.data

    def small_args():  # 500 samples instead of 5000: the same code path, a tenth of the time
        args = get_dataset_args()
        args.num_samples = 500
        return args

    get_dataset_args = mnist1d.data.get_dataset_args
    monkeypatch.setattr(mnist1d.data, "get_dataset_args", small_args)
    random.seed(7)
    np.random.seed(7)
    before = random.random(), np.random.random()
    random.seed(7)
    np.random.seed(7)
    first, again, other = load("mnist1d"), load("mnist1d"), load("mnist1d", seed=1)
    assert (random.random(), np.random.random()) == before
    assert first.x_train.shape == (400, 1, 40)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(again, field), getattr(first, field))
    assert not torch.equal(other.x_train, first.x_train)


def test_synthetic_is_learnable_but_not_separable(offline):
    from sklearn.linear_model import LogisticRegression

    ds = offline["synthetic"]
    model = LogisticRegression(max_iter=1000).fit(ds.x_train.numpy(), ds.y_train.numpy())
    assert 0.8 <= model.score(ds.x_test.numpy(), ds.y_test.numpy()) <= 0.95


def test_a_generated_set_is_made_once_per_process_and_seed():
    a, b, c = load("digits", seed=0), load("digits", root="/nonexistent", seed=0), load("digits", seed=1)
    assert a is b and a is not c  # digits needs no files: root is ignored
    assert not torch.equal(a.y_train, c.y_train)


def test_unknown_name_lists_the_choices():
    msg = "unknown data set 'mnsit': choose one of digits, mnist1d, synthetic, mnist, fashion-mnist, cifar10, hf-disk"
    with pytest.raises(ValueError, match=re.escape(msg)):
        load("mnsit")


# ------------------------------------------------------------------ IDX files


def idx_bytes(a: np.ndarray, magic: int | None = None) -> bytes:
    """An IDX file of unsigned bytes holding ``a``."""
    magic = 0x0800 | a.ndim if magic is None else magic
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in a.shape)
    return header + a.astype(np.uint8).tobytes()


def write_idx(root: Path, gz: bool, arrays: dict[str, bytes] | None = None) -> dict[str, np.ndarray]:
    """Small MNIST-format files (5 train, 3 test images); ``arrays`` overrides file contents."""
    rng = np.random.default_rng(0)
    content = {
        IDX_FILES[0]: rng.integers(0, 256, (5, 28, 28)), IDX_FILES[1]: np.array([3, 1, 4, 1, 5]),
        IDX_FILES[2]: rng.integers(0, 256, (3, 28, 28)), IDX_FILES[3]: np.array([9, 2, 6]),
    }
    for f, a in content.items():
        raw = (arrays or {}).get(f, idx_bytes(a))
        if gz:
            (root / f"{f}.gz").write_bytes(gzip.compress(raw))
        else:
            (root / f).write_bytes(raw)
    return content


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_idx_files_are_read_and_standardised(tmp_path, name, gz):
    content = write_idx(tmp_path, gz)
    ds = load(name, root=str(tmp_path))
    assert ds.shape == (1, 28, 28) and ds.classes == 10
    assert ds.x_train.shape == (5, 1, 28, 28) and ds.x_test.shape == (3, 1, 28, 28)
    assert ds.y_train.tolist() == [3, 1, 4, 1, 5] and ds.y_test.tolist() == [9, 2, 6]
    raw_train = content[IDX_FILES[0]].astype(np.float64)
    mean, std = raw_train.mean(), raw_train.std()
    expected = (content[IDX_FILES[2]][:, None] - mean) / std
    assert np.allclose(ds.x_test.numpy(), expected, atol=1e-5)
    assert abs(ds.x_train.double().mean().item()) < 1e-6


def test_idx_wrong_magic_number_is_rejected(tmp_path):
    labels = np.array([3, 1, 4, 1, 5])
    write_idx(tmp_path, gz=False, arrays={IDX_FILES[1]: idx_bytes(labels, magic=0x0803)})
    msg = "train-labels-idx1-ubyte is not an IDX file of 1-d unsigned bytes (magic number 0x00000803, expected 0x00000801): re-download it"
    with pytest.raises(ValueError, match=re.escape(msg)):
        load("mnist", root=str(tmp_path))


def test_idx_too_short_for_its_header_is_rejected(tmp_path):
    write_idx(tmp_path, gz=False, arrays={IDX_FILES[0]: (0x0803).to_bytes(4, "big") + b"\0\0"})
    with pytest.raises(ValueError, match="is not an IDX file of 3-d unsigned bytes"):
        load("mnist", root=str(tmp_path))


def test_idx_truncated_data_is_rejected(tmp_path):
    images = np.zeros((5, 28, 28))
    write_idx(tmp_path, gz=False, arrays={IDX_FILES[0]: idx_bytes(images)[:-1]})
    msg = "holds 3919 bytes of data but its header says (5, 28, 28): it is truncated or corrupt, re-download it"
    with pytest.raises(ValueError, match=re.escape(msg)):
        load("mnist", root=str(tmp_path))


def test_idx_corrupt_gzip_is_rejected(tmp_path):
    write_idx(tmp_path, gz=True)
    (tmp_path / f"{IDX_FILES[3]}.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz cannot be read \(.*\): re-download it"):
        load("mnist", root=str(tmp_path))


@pytest.mark.parametrize("arrays, msg", [
    ({IDX_FILES[3]: idx_bytes(np.array([9, 2]))},
     "the test files in ROOT hold 3 images of (1, 28, 28) and 2 labels, expected images of (28, 28) and one label each: re-download them"),
    ({IDX_FILES[0]: idx_bytes(np.zeros((5, 28, 27)))},
     "the train files in ROOT hold 5 images of (1, 28, 27) and 5 labels, expected images of (28, 28) and one label each: re-download them"),
    ({IDX_FILES[1]: idx_bytes(np.array([3, 1, 4, 1, 10]))},
     "the train labels in ROOT are not all in 0..9: re-download them"),
])
def test_idx_inconsistent_files_are_rejected(tmp_path, arrays, msg):
    write_idx(tmp_path, gz=False, arrays=arrays)
    with pytest.raises(ValueError, match=re.escape(msg.replace("ROOT", str(tmp_path)))):
        load("mnist", root=str(tmp_path))


def test_idx_missing_files_say_which_and_what_to_do(tmp_path):
    write_idx(tmp_path, gz=True)
    (tmp_path / f"{IDX_FILES[2]}.gz").unlink()
    msg = (f"fashion-mnist needs its IDX files in {tmp_path} (train-images-idx3-ubyte[.gz], "
           "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]; "
           "missing: t10k-images-idx3-ubyte): download them on a machine with network and point data-root at them (scenario key, or robust bench --set data-root=DIR)")
    with pytest.raises(ValueError, match=re.escape(msg)):
        load("fashion-mnist", root=str(tmp_path))


def test_idx_without_root_says_what_to_do():
    msg = ("mnist is read from its IDX files (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
           "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]): download them on a machine "
           "with network and point data-root at them (scenario key, or robust bench --set data-root=DIR)")
    with pytest.raises(ValueError, match=re.escape(msg)):
        load("mnist")


# ------------------------------------------------------------------ CIFAR-10 batches


def write_cifar(folder: Path, protocol: int = 2, old_numpy: bool = False) -> list[np.ndarray]:
    """Six batches of 4 images each, as pickled dicts like cifar-10-batches-py's."""
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(1)
    labels = []
    for i, f in enumerate(CIFAR_FILES):
        # channel c of every image is offset by 50 * c, so per-channel scaling is visible
        data = (rng.integers(0, 100, (4, 3, 1024)) + 50 * np.arange(3)[:, None]).astype(np.uint8)
        batch = {"batch_label": f, "labels": [(i + j) % 10 for j in range(4)], "data": data.reshape(4, -1)}
        raw = pickle.dumps(batch, protocol=protocol)
        if old_numpy:  # files written by numpy < 2 (the real ones) name numpy.core
            raw = raw.replace(b"numpy._core.", b"numpy.core.")
        (folder / f).write_bytes(raw)
        labels.append(np.array(batch["labels"]))
    return labels


@pytest.mark.parametrize("protocol, old_numpy, sub", [
    (2, True, False), (2, False, True), (5, False, False),
])
def test_cifar_batches_are_read_and_standardised_per_channel(tmp_path, protocol, old_numpy, sub):
    folder = tmp_path / "cifar-10-batches-py" if sub else tmp_path
    labels = write_cifar(folder, protocol, old_numpy)
    ds = load("cifar10", root=str(tmp_path))
    assert ds.shape == (3, 32, 32) and ds.classes == 10
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
    assert ds.y_train.tolist() == np.concatenate(labels[:5]).tolist()
    assert ds.y_test.tolist() == labels[5].tolist()
    mean, std = channel_stats(ds.x_train)
    assert torch.allclose(mean, torch.zeros(3, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(std, torch.ones(3, dtype=torch.float64), atol=1e-4)


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_cifar_pickle_naming_other_code_is_refused(tmp_path, capsys):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps({"data": Evil(), "labels": []}))
    with pytest.raises(ValueError, match=r"data_batch_3 is not a CIFAR-10 python batch \(.*refusing to load builtins\.print"):
        load("cifar10", root=str(tmp_path))
    assert "must never run" not in capsys.readouterr().out


def test_cifar_wrong_data_shape_is_rejected(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "test_batch").write_bytes(pickle.dumps({"data": np.zeros((4, 3000), np.uint8), "labels": [0] * 4}))
    msg = "test_batch holds data of uint8 (4, 3000), not uint8 (n, 3072): re-download cifar-10-python.tar.gz and extract it"
    with pytest.raises(ValueError, match=re.escape(msg)):
        load("cifar10", root=str(tmp_path))


def test_cifar_missing_batches_say_which_and_what_to_do(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_2").unlink()
    (tmp_path / "test_batch").unlink()
    msg = (f"cifar10 needs its python batches in {tmp_path} (data_batch_1, data_batch_2, data_batch_3, "
           "data_batch_4, data_batch_5, test_batch; missing: data_batch_2, test_batch): download "
           "cifar-10-python.tar.gz on a machine with network, extract it and point data-root at them (scenario key, or robust bench --set data-root=DIR)")
    with pytest.raises(ValueError, match=re.escape(msg)):
        load("cifar10", root=str(tmp_path))


def test_cifar_without_root_says_what_to_do():
    with pytest.raises(ValueError, match=re.escape("cifar10 is read from its python batches (data_batch_1, ")):
        load("cifar10")


# ------------------------------------------------------------------ partitions


def labels_(n: int, classes: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, classes, n))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 300), classes=st.integers(1, 12), data=st.data(),
       kind=st.sampled_from([k for k in KINDS if k not in FLWR_KINDS]), alpha=st.floats(0.05, 100), seed=st.integers(0, 2**32 - 1))
def test_partition_is_disjoint_sorted_covering_and_deterministic(n, classes, data, kind, alpha, seed):
    y = labels_(n, classes, seed % 1000)
    nodes = data.draw(st.integers(1, n))
    shards = data.draw(st.integers(1, n // nodes))
    try:
        parts = partition(y, nodes, kind, alpha=alpha, shards=shards, seed=seed)
    except ValueError as e:  # only a dirichlet draw may fail, and it must say so
        assert kind == "dirichlet" and "raise alpha or use fewer nodes" in str(e)
        return
    assert len(parts) == nodes
    assert all(p.dtype == torch.int64 and p.ndim == 1 and len(p) >= 1 for p in parts)
    assert all(torch.equal(p, p.sort().values) for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(n))  # disjoint and covering
    again = partition(y, nodes, kind, alpha=alpha, shards=shards, seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))


def test_iid_is_balanced_and_seeded():
    y = labels_(1003)
    parts = partition(y, 10, seed=3)
    assert {len(p) for p in parts} == {100, 101}
    assert not all(torch.equal(a, b) for a, b in zip(parts, partition(y, 10, seed=4)))


def mean_label_entropy(y: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """Mean over nodes of the entropy (nats) of the node's label distribution."""
    total = 0.0
    for p in parts:
        q = torch.bincount(y[p], minlength=10).double() / len(p)
        total -= (q[q > 0] * q[q > 0].log()).sum().item()
    return total / len(parts)


def test_dirichlet_small_alpha_is_skewed_large_alpha_nearly_iid():
    y = labels_(3000)
    skewed = partition(y, 20, "dirichlet", alpha=0.1, seed=1)
    even = partition(y, 20, "dirichlet", alpha=100.0, seed=1)
    assert mean_label_entropy(y, skewed) < 1.2 < 2.2 < mean_label_entropy(y, even) <= math.log(10)
    assert min(len(p) for p in skewed) >= 2


def test_label_shards_give_each_node_its_shards_labels():
    y = torch.arange(10).repeat_interleave(100)  # shard size 100 = one class per shard
    parts = partition(y, 5, "label-shards", shards=2, seed=2)
    assert all(len(p) == 200 and len(set(y[p].tolist())) == 2 for p in parts)
    # with uneven classes a shard may straddle two labels, so a node sees at most 2 * shards
    y = labels_(1000)
    assert all(len(set(y[p].tolist())) <= 6 for p in partition(y, 20, "label-shards", shards=3))


@pytest.mark.parametrize("y, nodes, kind, kw, msg", [
    (labels_(10), 2, "shards", {}, "unknown partition 'shards': choose one of iid, dirichlet, label-shards, flwr-iid, flwr-dirichlet, flwr-shards"),
    (labels_(10), 0, "iid", {}, "nodes must be a whole number >= 1 (got nodes=0)"),
    (labels_(10), 2.0, "iid", {}, "nodes must be a whole number >= 1 (got nodes=2.0)"),
    (labels_(10), True, "iid", {}, "nodes must be a whole number >= 1 (got nodes=True)"),
    (labels_(10), 11, "iid", {}, "11 nodes cannot each get a sample of 10: use at most 10 nodes"),
    (labels_(10).double(), 2, "iid", {}, "labels must be a 1-d integer tensor (got torch.float64 of shape (10,))"),
    (labels_(10).reshape(2, 5), 2, "iid", {}, "labels must be a 1-d integer tensor (got torch.int64 of shape (2, 5))"),
    (labels_(10), 2, "dirichlet", {"alpha": 0.0},
     "dirichlet alpha must be a finite number > 0 (got alpha=0.0): small (0.1) for skewed nodes, large (100) for nearly iid"),
    (labels_(10), 2, "dirichlet", {"alpha": float("nan")}, "dirichlet alpha must be a finite number > 0 (got alpha=nan)"),
    (labels_(10), 2, "dirichlet", {"alpha": -1}, "dirichlet alpha must be a finite number > 0 (got alpha=-1)"),
    (labels_(10), 2, "label-shards", {"shards": 0}, "label-shards shards must be a whole number >= 1 (got shards=0)"),
    (labels_(10), 4, "label-shards", {"shards": 3}, "label-shards needs nodes * shards <= 10 samples (got 4 * 3): lower shards or nodes"),
    (labels_(30), 15, "dirichlet", {"alpha": 0.1},
     "dirichlet alpha=0.1 left a node with fewer than 2 samples in 1000 draws (30 samples, 15 nodes): raise alpha or use fewer nodes"),
])
def test_partition_errors_say_what_to_change(y, nodes, kind, kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        partition(y, nodes, kind, **kw)
