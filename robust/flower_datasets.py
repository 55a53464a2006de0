"""Flower Datasets (and the Hugging Face ``datasets`` under it), an optional extra.

Two uses, both offline, both importing ``datasets`` only when called (it pulls in pyarrow and
pandas, seconds of import that the other data sets do not need):

- :func:`read_folder`, behind ``robust.data.load("hf-disk", root=DIR)``: a train/test pair
  from a folder on disk, either written by ``DatasetDict.save_to_disk`` or a local copy of a
  Hub data set repository (its parquet files, e.g. ``hf download ylecun/mnist --repo-type
  dataset --local-dir DIR``). Nothing is downloaded.
- :func:`partition`, behind the ``flwr-*`` kinds of ``robust.partition``: Flower Datasets'
  own partitioners applied to the label tensor, seeded from the run seed.
"""

from __future__ import annotations

import importlib
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np

from .seeds import derive

INSTALL = "pip install 'robust[flower-datasets]' (or pip install 'flwr-datasets>=0.6')"
FOLDER_HINT = ("on a machine with network, load it and save_to_disk it (datasets.load_dataset"
               "(NAME).save_to_disk(DIR)) or hf download NAME --repo-type dataset --local-dir "
               "DIR, then point data-root at DIR (scenario key, or robust bench --set "
               "data-root=DIR)")


def _require(what: str, module: str) -> ModuleType:
    """Import ``module`` of the optional extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what} needs Flower Datasets, an optional extra ({e}): "
                         f"{INSTALL}") from None


# ------------------------------------------------------------------ data sets on disk


def read_folder(root: Path | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Images ``(N, C, H, W)`` and labels of the train and test splits in ``root``, and the
    number of classes (the ClassLabel's, else the largest label + 1)."""
    if root is None:
        raise ValueError("hf-disk is read from a folder with train and test splits: "
                         f"{FOLDER_HINT}")
    datasets = _require("hf-disk", "datasets")
    if not root.is_dir():
        raise ValueError(f"hf-disk folder {root} does not exist: {FOLDER_HINT}")
    if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
        saved = datasets.load_from_disk(str(root))
    else:
        # A repository copy is converted to arrow in a cache: a throwaway one, kept in
        # memory, so loading leaves nothing behind and never touches the user's HF cache.
        with tempfile.TemporaryDirectory() as cache:
            try:
                saved = datasets.load_dataset(str(root), cache_dir=cache, keep_in_memory=True)
            except Exception as e:  # datasets raises many types for a folder it cannot read
                raise ValueError(f"{root} is neither a save_to_disk folder nor a data set "
                                 f"repository datasets can read ({e}): {FOLDER_HINT}") from e
    splits = list(saved) if isinstance(saved, datasets.DatasetDict) else []
    if not {"train", "test"} <= set(splits):
        raise ValueError(f"hf-disk needs train and test splits in {root} (found "
                         f"{', '.join(splits) or 'a single split'}): save a DatasetDict "
                         "with both (DatasetDict(train=..., test=...).save_to_disk(DIR))")
    image, label = _columns(saved["train"].features, root)
    x_train, y_train = _arrays(saved["train"], "train", image, label, root)
    x_test, y_test = _arrays(saved["test"], "test", image, label, root)
    feature = saved["train"].features[label]
    if isinstance(feature, datasets.ClassLabel):
        classes = feature.num_classes
    else:
        classes = int(max(y_train.max(initial=0), y_test.max(initial=0))) + 1
    return x_train, y_train, x_test, y_test, classes


def _columns(features: dict, root: Path) -> tuple[str, str]:
    """The image column (the one ``Image`` feature) and the label column (``label``, else the
    one ``ClassLabel`` feature)."""
    import datasets

    listed = ", ".join(f"{k} ({type(v).__name__})" for k, v in features.items())
    images = [k for k, v in features.items() if isinstance(v, datasets.Image)]
    if len(images) != 1:
        raise ValueError(f"hf-disk needs exactly one image column in {root} (columns: {listed}): "
                         "remove the others (dataset.remove_columns) before save_to_disk")
    labels = [k for k, v in features.items() if isinstance(v, datasets.ClassLabel)]
    if "label" in features:
        labels = ["label"]
    if len(labels) != 1:
        raise ValueError(f"hf-disk needs a label column in {root}: one named 'label' or a "
                         f"single ClassLabel column (columns: {listed}): rename the one to "
                         "train on (dataset.rename_column(NAME, 'label')) before save_to_disk")
    return images[0], labels[0]


def _arrays(split, name: str, image: str, label: str, root: Path) -> tuple[np.ndarray, np.ndarray]:
    """Decoded images, channels first like the other sets' (N, C, H, W), and their labels."""
    if not len(split):
        raise ValueError(f"the {name} split in {root} is empty: save one with samples")
    try:
        columns = split.select_columns([image, label]).with_format("numpy")[:]
    except (KeyError, ValueError) as e:
        raise ValueError(f"the {name} split in {root} lacks the train split's "
                         f"columns {image!r} and {label!r} ({e}): save splits with the same "
                         "columns") from e
    x, y = columns[image], columns[label]
    if x.dtype == object or x.ndim not in (3, 4):
        raise ValueError(f"the images in {root} differ in size or colour mode, or are not 2-d: "
                         "convert them to one size and mode before save_to_disk (e.g. "
                         f"dataset.cast_column({image!r}, datasets.Image(mode='RGB')))")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"the labels in {root} ({label!r}) are {y.dtype}, not integers: store "
                         "them as a ClassLabel column (dataset.class_encode_column)")
    # Grey images decode to (N, H, W), colour ones to (N, H, W, C).
    return (x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)), y


# ------------------------------------------------------------------ partitions


def partition(labels: np.ndarray, nodes: int, kind: str, *, alpha: float, shards: int,
              min_size: int, seed: int) -> list[np.ndarray]:
    """Indices of ``labels`` per node from Flower Datasets' partitioner for ``kind``.

    ``alpha`` is DirichletPartitioner's (with ``min_partition_size=min_size`` and no
    self-balancing), ``shards`` ShardPartitioner's ``num_shards_per_partition``.

    As ``FederatedDataset(shuffle=True)`` does, the rows are shuffled before partitioning,
    so which samples of a class a node gets is random too; the shuffle and the partitioner
    draw from seeds derived from ``seed``.
    """
    datasets = _require(f"partition {kind!r}", "datasets")
    partitioners = _require(f"partition {kind!r}", "flwr_datasets.partitioner")
    rows = datasets.Dataset.from_dict({"label": labels, "index": np.arange(len(labels))})
    rows = rows.shuffle(seed=derive(seed, "flwr-partition", "shuffle"), keep_in_memory=True)
    drawn = derive(seed, "flwr-partition", kind)
    if kind == "flwr-iid":  # contiguous near-equal cuts of the shuffled rows
        partitioner = partitioners.IidPartitioner(num_partitions=nodes)
    elif kind == "flwr-dirichlet":
        # self_balancing=False is Hsu et al.'s split, as the numpy kind does.
        partitioner = partitioners.DirichletPartitioner(
            num_partitions=nodes, partition_by="label", alpha=float(alpha),
            min_partition_size=min_size, self_balancing=False,
            seed=drawn)
    else:  # label-sorted shards of floor(N / (nodes * shards)); the remainder goes unused
        partitioner = partitioners.ShardPartitioner(
            num_partitions=nodes, partition_by="label", num_shards_per_partition=shards,
            seed=drawn)
    partitioner.dataset = rows
    with warnings.catch_warnings():
        # A warning per failed Dirichlet draw (the error below says it), and pyarrow's
        # deprecation of an option ShardPartitioner's sort passes: nothing a user can act on.
        warnings.filterwarnings("ignore", message="The specified min_partition_size")
        warnings.filterwarnings("ignore", message="Specifying null_placement",
                                category=FutureWarning)
        try:
            return [partitioner.load_partition(i).with_format("numpy")[:]["index"]
                    for i in range(nodes)]
        except ValueError as e:
            if "max number of attempts" not in str(e):
                raise
            raise ValueError(
                f"flwr-dirichlet alpha={alpha} left a node with fewer than "
                f"{min_size} samples in 11 draws ({len(labels)} "
                f"samples, {nodes} nodes): raise alpha, use fewer nodes, or use dirichlet "
                "(which redraws more often)") from None

