"""The optional Flower Datasets extra: "hf-disk" data sets on disk and the flwr-* partitions.

Every data set here is written by the test into tmp_path: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

from robust.data import CIFAR_FILES, IDX_FILES, load
from robust.partition import FLWR_KINDS, partition

from .test_data import channel_stats, labels_, mean_label_entropy, write_cifar, write_idx


def save(root: Path, train: tuple, test: tuple, *, classes: int | None = 10,
         image: str = "image", label: str = "label") -> Path:
    """A DatasetDict with (images as uint8 (N, H, W[, C]), labels) splits, saved to ``root``."""
    features = datasets.Features({
        image: datasets.Image(),
        label: datasets.ClassLabel(num_classes=classes) if classes else datasets.Value("int64"),
    })
    splits = {
        name: datasets.Dataset.from_dict(
            {image: [Image.fromarray(a) for a in x], label: list(y)}, features=features)
        for name, (x, y) in (("train", train), ("test", test))
    }
    datasets.DatasetDict(splits).save_to_disk(str(root))
    return root


def tiny(seed: int = 0, n: int = 60, shape: tuple = (8, 8)) -> tuple[tuple, tuple]:
    """``n`` random uint8 images with labels i % 10, split 48/12."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    y = np.arange(n) % 10
    cut = n * 4 // 5
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


# ------------------------------------------------------------------ hf-disk


def test_hf_disk_gives_standardised_float_images_and_int64_labels(tmp_path):
    train, test = tiny()
    ds = load("hf-disk", root=str(save(tmp_path / "set", train, test)))
    assert ds.name == "hf-disk" and ds.classes == 10 and ds.shape == (1, 8, 8)
    assert ds.x_train.shape == (48, 1, 8, 8) and ds.x_test.shape == (12, 1, 8, 8)
    assert ds.x_train.dtype == ds.x_test.dtype == torch.float32
    assert ds.y_train.dtype == ds.y_test.dtype == torch.int64
    assert ds.y_train.tolist() == train[1].tolist() and ds.y_test.tolist() == test[1].tolist()
    raw = train[0].astype(np.float64)
    expected = (test[0][:, None] - raw.mean()) / raw.std()  # scaled by the train statistics
    assert np.allclose(ds.x_test.numpy(), expected, atol=1e-5)
    mean, std = channel_stats(ds.x_train)
    assert abs(mean.item()) < 1e-6 and abs(std.item() - 1) < 1e-5


def test_hf_disk_grey_images_give_the_bits_of_the_idx_loader(tmp_path):
    (tmp_path / "idx").mkdir()
    content = write_idx(tmp_path / "idx", gz=False)
    train = content[IDX_FILES[0]].astype(np.uint8), content[IDX_FILES[1]]
    test = content[IDX_FILES[2]].astype(np.uint8), content[IDX_FILES[3]]
    hf = load("hf-disk", root=str(save(tmp_path / "hf", train, test)))
    idx = load("mnist", root=str(tmp_path / "idx"))
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(hf, field), getattr(idx, field)), field


def test_hf_disk_colour_images_give_the_bits_of_the_cifar_loader(tmp_path):
    write_cifar(tmp_path / "cifar")
    cifar = load("cifar10", root=str(tmp_path / "cifar"))
    # the same pixels as PIL RGB images: channels last, as images are stored
    batches = [datasets_batch(tmp_path / "cifar" / f) for f in CIFAR_FILES]
    train = (np.concatenate([x for x, _ in batches[:-1]]), np.concatenate([y for _, y in batches[:-1]]))
    hf = load("hf-disk", root=str(save(tmp_path / "hf", train, batches[-1], image="img")))
    assert hf.shape == (3, 32, 32)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(hf, field), getattr(cifar, field)), field


def datasets_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A CIFAR batch written by write_cifar, as (n, 32, 32, 3) uint8 images and labels."""
    import pickle

    batch = pickle.loads(path.read_bytes())
    return batch["data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), np.array(batch["labels"])


def test_hf_disk_reads_a_hub_repository_copy_like_the_saved_folder(tmp_path):
    train, test = tiny(seed=1)
    saved = save(tmp_path / "saved", train, test)
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    for split in ("train", "test"):  # the layout of a Hub data set repository
        datasets.load_from_disk(str(saved))[split].to_parquet(str(repo / f"{split}-00000-of-00001.parquet"))
    a, b = load("hf-disk", root=str(saved)), load("hf-disk", root=str(tmp_path / "repo"))
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_hf_disk_classes_come_from_the_class_label_else_the_largest_label(tmp_path):
    train, test = tiny()
    assert load("hf-disk", root=str(save(tmp_path / "a", train, test, classes=13))).classes == 13
    train, test = (train[0], train[1] % 7), (test[0], test[1] % 7)
    assert load("hf-disk", root=str(save(tmp_path / "b", train, test, classes=None))).classes == 7


def write_other(root: Path, case: str) -> Path:
    """A saved folder that is wrong in the way ``case`` says."""
    train, test = tiny()
    if case == "single split":
        datasets.Dataset.from_dict({"label": [1, 2]}).save_to_disk(str(root))
    elif case == "no image column":
        datasets.DatasetDict(train=datasets.Dataset.from_dict({"label": [1]}),
                             test=datasets.Dataset.from_dict({"label": [1]})).save_to_disk(str(root))
    elif case == "two label columns":
        features = datasets.Features({"image": datasets.Image(), "fine": datasets.ClassLabel(num_classes=10),
                                      "coarse": datasets.ClassLabel(num_classes=10)})
        split = datasets.Dataset.from_dict(
            {"image": [Image.fromarray(a) for a in train[0]], "fine": train[1], "coarse": train[1]},
            features=features)
        datasets.DatasetDict(train=split, test=split).save_to_disk(str(root))
    elif case == "splits of other sizes":
        save(root, train, tiny(shape=(9, 9))[1])
    elif case == "sizes within a split":
        images = [*train[0], *tiny(shape=(9, 9))[1][0]]
        save(root, (images, np.arange(len(images)) % 10), test)
    elif case == "label out of range":
        save(root, train, (test[0], test[1] - 1), classes=None)
    elif case == "float labels":
        split = datasets.Dataset.from_dict({"image": [Image.fromarray(a) for a in train[0]],
                                            "label": train[1] + 0.5},
                                           features=datasets.Features({"image": datasets.Image(),
                                                                       "label": datasets.Value("float32")}))
        datasets.DatasetDict(train=split, test=split).save_to_disk(str(root))
    return root


@pytest.mark.parametrize("case, msg", [
    ("single split", "hf-disk needs train and test splits in ROOT (found a single split): save a DatasetDict with both"),
    ("no image column", "hf-disk needs exactly one image column in ROOT (columns: label (Value)): remove the others"),
    ("two label columns", "hf-disk needs a label column in ROOT: one named 'label' or a single ClassLabel column "
                          "(columns: image (Image), fine (ClassLabel), coarse (ClassLabel)): rename the one to train on"),
    ("sizes within a split", "the images in ROOT differ in size or colour mode, or are not 2-d: convert them"),
    ("splits of other sizes", "the test files in ROOT hold 12 images of (1, 9, 9) and 12 labels, expected images of (1, 8, 8)"),
    ("label out of range", "the test labels in ROOT are not all in 0..9"),
    ("float labels", "the labels in ROOT ('label') are float32, not integers: store them as a ClassLabel column"),
])
def test_hf_disk_bad_folders_say_what_to_change(tmp_path, case, msg):
    root = write_other(tmp_path / "set", case)
    with pytest.raises(ValueError, match=re.escape(msg.replace("ROOT", str(root)))):
        load("hf-disk", root=str(root))


def test_hf_disk_without_a_folder_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match=re.escape("hf-disk is read from a folder with train and test splits: "
                                                   "on a machine with network, load it and save_to_disk it")):
        load("hf-disk")
    with pytest.raises(ValueError, match=re.escape(f"hf-disk folder {tmp_path / 'none'} does not exist: ")):
        load("hf-disk", root=str(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is neither a save_to_disk folder nor a data set repository"):
        load("hf-disk", root=str(tmp_path / "empty"))


@pytest.mark.parametrize("module", ["datasets", "flwr_datasets.partitioner"])
def test_without_the_extra_the_error_says_what_to_install(tmp_path, monkeypatch, module):
    root = save(tmp_path / "set", *tiny())
    monkeypatch.setitem(sys.modules, module, None)  # what an import finds when it is not installed
    install = "pip install 'robust[flower-datasets]' (or pip install 'flwr-datasets>=0.6')"
    if module == "datasets":
        with pytest.raises(ValueError, match=re.escape("hf-disk needs Flower Datasets, an optional extra (")):
            load("hf-disk", root=str(root))
    with pytest.raises(ValueError, match=r"partition 'flwr-iid' needs Flower Datasets, an optional extra \(.*\): "
                                         + re.escape(install)):
        partition(labels_(20), 2, "flwr-iid")


def test_importing_data_and_partition_does_not_import_datasets():
    code = ("import sys, robust.data, robust.partition; "
            "print(sorted(m for m in ('datasets', 'pyarrow', 'pandas', 'flwr_datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ flwr-* partitions


def check_parts(parts: list[torch.Tensor], n: int, nodes: int) -> None:
    """One non-empty sorted int64 tensor per node, disjoint, inside range(n)."""
    assert len(parts) == nodes
    assert all(p.dtype == torch.int64 and p.ndim == 1 and len(p) >= 1 for p in parts)
    assert all(torch.equal(p, p.sort().values) for p in parts)
    joined = torch.cat(parts)
    assert len(joined.unique()) == len(joined) and 0 <= joined.min() and joined.max() < n


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 200), classes=st.integers(1, 12), data=st.data(),
       kind=st.sampled_from(FLWR_KINDS), alpha=st.floats(0.3, 100), seed=st.integers(0, 2**32 - 1))
def test_flwr_partitions_are_disjoint_sorted_and_deterministic(n, classes, data, kind, alpha, seed):
    y = labels_(n, classes, seed % 1000)
    nodes = data.draw(st.integers(1, max(1, n // 4)))
    shards = data.draw(st.integers(1, n // nodes))
    try:
        parts = partition(y, nodes, kind, alpha=alpha, shards=shards, seed=seed)
    except ValueError as e:  # only a dirichlet draw may fail, and it must say so
        assert kind == "flwr-dirichlet" and "raise alpha, use fewer nodes" in str(e)
        return
    check_parts(parts, n, nodes)
    if kind == "flwr-shards":  # shards of n // (nodes * shards) samples; the rest go unused
        assert all(len(p) == shards * (n // (nodes * shards)) for p in parts)
    else:
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(n))
    again = partition(y, nodes, kind, alpha=alpha, shards=shards, seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))


@pytest.mark.parametrize("kind", FLWR_KINDS)
def test_flwr_partitions_follow_the_run_seed(kind):
    y = labels_(1000)
    first = partition(y, 10, kind, alpha=0.5, seed=3)
    again = partition(y, 10, kind, alpha=0.5, seed=3)
    other = partition(y, 10, kind, alpha=0.5, seed=4)
    check_parts(first, 1000, 10)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_flwr_iid_is_balanced_and_covers():
    parts = partition(labels_(1003), 10, "flwr-iid", seed=3)
    assert {len(p) for p in parts} == {100, 101}
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(1003))


def test_flwr_dirichlet_small_alpha_is_skewed_large_alpha_and_iid_are_not():
    y = labels_(3000)
    skewed = partition(y, 20, "flwr-dirichlet", alpha=0.1, seed=1)
    even = partition(y, 20, "flwr-dirichlet", alpha=100.0, seed=1)
    iid = partition(y, 20, "flwr-iid", seed=1)
    assert mean_label_entropy(y, skewed) < 1.2 < 2.2 < mean_label_entropy(y, even) <= np.log(10)
    assert mean_label_entropy(y, iid) > 2.2
    assert min(len(p) for p in skewed) >= 2  # min_partition_size, as dirichlet's
    assert torch.equal(torch.cat(skewed).sort().values, torch.arange(3000))


def test_flwr_shards_give_each_node_its_shards_labels():
    y = torch.arange(10).repeat_interleave(100)  # shard size 100 = one class per shard
    parts = partition(y, 5, "flwr-shards", shards=2, seed=2)
    assert all(len(p) == 200 and len(set(y[p].tolist())) == 2 for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(1000))


@pytest.mark.parametrize("y, nodes, kind, kw, msg", [
    (labels_(10), 2, "flwr-dirichlet", {"alpha": 0.0},
     "flwr-dirichlet alpha must be a finite number > 0 (got alpha=0.0): small (0.1) for skewed nodes"),
    (labels_(10), 4, "flwr-shards", {"shards": 3},
     "flwr-shards needs nodes * shards <= 10 samples (got 4 * 3): lower shards or nodes"),
    (labels_(10), 2, "flwr-shards", {"shards": 0}, "flwr-shards shards must be a whole number >= 1 (got shards=0)"),
    (labels_(30), 15, "flwr-dirichlet", {"alpha": 0.01},
     "flwr-dirichlet alpha=0.01 left a node with fewer than 2 samples in 11 draws (30 samples, 15 nodes): "
     "raise alpha, use fewer nodes, or use dirichlet (which redraws more often)"),
])
def test_flwr_partition_errors_say_what_to_change(y, nodes, kind, kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        partition(y, nodes, kind, **kw)


@pytest.mark.parametrize("kind, digest", [
    ("iid", "5f090d7da4ce1679"), ("dirichlet", "80f5698b6968978f"), ("label-shards", "075229ee28ce45c5"),
])
def test_the_numpy_kinds_give_the_results_they_gave_before_the_flwr_kinds(kind, digest):
    # digests of the parts computed by robust/partition.py before the flwr-* kinds were added
    parts = partition(labels_(200), 7, kind, alpha=0.3, shards=3, seed=11)
    text = "|".join(",".join(map(str, p.tolist())) for p in parts)
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == digest
