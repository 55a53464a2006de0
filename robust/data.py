"""Data sets as tensors, built or read offline (the machines that train have no network).

Three sets are generated on the spot ("digits", "mnist1d", "synthetic"); three are read from
files the user downloaded elsewhere, in the folder ``root`` ("mnist", "fashion-mnist" as IDX
files, "cifar10" as the python pickle batches). Every loader returns numpy arrays; ``_finish``
standardises them and converts them to torch once, so there is one code path per step.

"hf-disk" reads a Hugging Face / Flower Datasets image set already on disk (nothing is
downloaded) with the optional extra ``robust[flower-datasets]``: ``root`` is a folder written
by ``DatasetDict.save_to_disk`` (splits "train" and "test"), or a local copy of a Hub data set
repository (``hf download ylecun/mnist --repo-type dataset --local-dir DIR``). Its one
``Image`` column becomes ``(N, C, H, W)`` like the other image sets (grey images get one
channel), its "label" column (or single ``ClassLabel`` column) the labels; ``classes`` is the
ClassLabel's count. ``datasets`` is imported only then: importing this module stays light.

Two text sets (``robust.text``): ``pystdlib``, the running interpreter's standard library source,
and ``text``, a user's folder of text files (``root``), as next-byte prediction: inputs
``(N, context)`` uint8 bytes, targets ``(N, context)`` uint8 (the next byte at each position),
256 classes, each training window's package in ``groups`` (what the label-skew partitions
split), the content's SHA-256 in ``sha256``. Written ``pystdlib`` or ``pystdlib:context=256``
(bytes a sample holds; 64 by default). Nothing is standardised: they are tokens.

A user's own set is named ``package.module:load`` (``robust.user_code``): ``load()`` returns
``(x_train, y_train, x_test, y_test)`` as tensors or NumPy arrays, inputs ``(N, *shape)`` and
integer labels ``(N,)``; ``classes`` is the largest label + 1.

Inputs are standardised with the train set's mean and std per channel (dim 1: the colour
channel of an image, the single channel of a 1-d signal, a feature of a flat vector), so the
test set is scaled exactly like the data the model trains on.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import math
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import text
from .spec import parse
from .user_code import is_reference, resolve


@dataclass(frozen=True)
class Dataset:
    """A train/test split: float32 inputs ``(N, *shape)``, int64 labels in ``[0, classes)`` (a
    text set: uint8 bytes, uint8 next bytes ``(N, context)``, and its windows' ``groups``)."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: int
    groups: torch.Tensor | None = None  # a text set's training windows' packages
    sha256: str = ""  # a text set's identity: the SHA-256 of its content

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one sample."""
        return tuple(self.x_train.shape[1:])

    @property
    def strata(self) -> torch.Tensor:
        """What the label-skew partitions split by: the labels, or a text set's packages."""
        return self.y_train if self.groups is None else self.groups


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # x_train, y_train, x_test, y_test
CLASSES = 10  # every built-in set has ten classes; hf-disk says how many its set has
HF_DISK = "hf-disk"


def _digits(root: Path | None, seed: int) -> Arrays:
    """scikit-learn's bundled 8x8 digits (values 0..16), split 80/20 stratified by label."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images[:, None], digits.target, test_size=0.2, stratify=digits.target,
        random_state=seed,
    )
    return x_train, y_train, x_test, y_test


def _mnist1d(root: Path | None, seed: int) -> Arrays:
    """Greydanus's MNIST-1D, generated with the package's default arguments and ``seed``."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    # make_dataset seeds and draws from the global RNGs: give the caller its state back.
    states = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    return data["x"][:, None], data["y"], data["x_test"][:, None], data["y_test"]


SYNTHETIC_RADIUS = 3.0  # distance of class means from 0 in noise stds; logistic regression ~87%


def _synthetic(root: Path | None, seed: int) -> Arrays:
    """10 unit-variance Gaussian classes in 32-d, means drawn once at ``SYNTHETIC_RADIUS``.

    Means on a sphere (not free Gaussian draws) keep the overlap, hence the accuracy a linear
    model can reach, nearly the same for every seed.
    """
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((10, 32))
    means *= SYNTHETIC_RADIUS / np.linalg.norm(means, axis=1, keepdims=True)
    y_train = rng.permutation(np.arange(3000) % 10)
    y_test = rng.permutation(np.arange(1000) % 10)
    x_train = means[y_train] + rng.standard_normal((3000, 32))
    x_test = means[y_test] + rng.standard_normal((1000, 32))
    return x_train, y_train, x_test, y_test


DATA_ROOT_HINT = "point data-root at them (scenario key, or robust bench --set data-root=DIR)"
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes: magic ``0x0000080<ndim>``, big-endian uint32 dims, data."""
    raw = _read_bytes(path)
    expected = 0x0800 | ndim
    header = 4 + 4 * ndim
    magic = int.from_bytes(raw[:4], "big")
    if len(raw) < header or magic != expected:
        raise ValueError(f"{path} is not an IDX file of {ndim}-d unsigned bytes (magic number "
                         f"{magic:#010x}, expected {expected:#010x}): re-download it")
    dims = tuple(int.from_bytes(raw[i:i + 4], "big") for i in range(4, header, 4))
    data = np.frombuffer(raw, np.uint8, offset=header)
    if data.size != math.prod(dims):
        raise ValueError(f"{path} holds {data.size} bytes of data but its header says {dims}: "
                         "it is truncated or corrupt, re-download it")
    return data.reshape(dims)


def _read_bytes(path: Path) -> bytes:
    """The content of ``path``, gunzipped if its name ends in .gz."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"{path} cannot be read ({e}): re-download it") from e


def _idx(name: str) -> Callable[[Path | None, int], Arrays]:
    """The loader of an MNIST-format set (28x28 images, IDX files, optionally gzipped)."""
    listed = ", ".join(f"{f}[.gz]" for f in IDX_FILES)

    def read(root: Path | None, seed: int) -> Arrays:
        if root is None:
            raise ValueError(f"{name} is read from its IDX files ({listed}): download them on a "
                             f"machine with network and {DATA_ROOT_HINT}")
        found = {f: next((p for p in (root / f, root / f"{f}.gz") if p.is_file()), None)
                 for f in IDX_FILES}
        if None in found.values():
            missing = ", ".join(f for f, p in found.items() if p is None)
            raise ValueError(f"{name} needs its IDX files in {root} ({listed}; missing: "
                             f"{missing}): download them on a machine with network and "
                             f"{DATA_ROOT_HINT}")
        x_train, y_train, x_test, y_test = (_read_idx(found[f], 3 if "images" in f else 1)
                                            for f in IDX_FILES)
        return _check(root, (28, 28), x_train[:, None], y_train, x_test[:, None], y_test)

    return read


CIFAR_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch")
_PICKLE_GLOBALS = {  # what a pickled numpy array needs, written by old or new numpy
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts of numpy arrays and nothing else: a pickle can run any code it names."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch: ``{"data": uint8 (n, 3072), "labels": [n ints]}``, as images (n, 3, 32, 32)."""
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="latin1").load()  # latin1: python 2 pickles
        data, labels = np.asarray(batch["data"]), np.asarray(batch["labels"])
    except Exception as e:  # a corrupt pickle can raise almost anything
        raise ValueError(f"{path} is not a CIFAR-10 python batch ({e!r}): re-download "
                         "cifar-10-python.tar.gz and extract it") from e
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path} holds data of {data.dtype} {data.shape}, not uint8 (n, 3072): "
                         "re-download cifar-10-python.tar.gz and extract it")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar10(root: Path | None, seed: int) -> Arrays:
    """CIFAR-10 from the python batches in ``root`` or in ``root/cifar-10-batches-py``."""
    listed = ", ".join(CIFAR_FILES)
    if root is None:
        raise ValueError(f"cifar10 is read from its python batches ({listed}): download "
                         "cifar-10-python.tar.gz on a machine with network, extract it and "
                         f"{DATA_ROOT_HINT}")
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    missing = [f for f in CIFAR_FILES if not (root / f).is_file()]
    if missing:
        raise ValueError(f"cifar10 needs its python batches in {root} ({listed}; missing: "
                         f"{', '.join(missing)}): download cifar-10-python.tar.gz on a machine "
                         f"with network, extract it and {DATA_ROOT_HINT}")
    batches = [_read_cifar_batch(root / f) for f in CIFAR_FILES]
    x_train = np.concatenate([x for x, _ in batches[:-1]])
    y_train = np.concatenate([y for _, y in batches[:-1]])
    return _check(root, (3, 32, 32), x_train, y_train, *batches[-1])


def _check(root: Path, shape: tuple[int, ...], x_train: np.ndarray, y_train: np.ndarray,
           x_test: np.ndarray, y_test: np.ndarray, classes: int = CLASSES) -> Arrays:
    """Refuse files whose images and labels do not match each other or the expected format."""
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if not len(x) or x.shape[-len(shape):] != shape or len(x) != len(y):
            raise ValueError(f"the {split} files in {root} hold {len(x)} images of "
                             f"{x.shape[1:]} and {len(y)} labels, expected images of {shape} "
                             "and one label each: re-download them")
        if y.min() < 0 or y.max() >= classes:
            raise ValueError(f"the {split} labels in {root} are not all in 0..{classes - 1}: "
                             "re-download them")
    return x_train, y_train, x_test, y_test


LOADERS: dict[str, Callable[[Path | None, int], Arrays]] = {
    "digits": _digits,
    "mnist1d": _mnist1d,
    "synthetic": _synthetic,
    "mnist": _idx("mnist"),
    "fashion-mnist": _idx("fashion-mnist"),
    "cifar10": _cifar10,
}


def names() -> list[str]:
    """The data sets ``load`` knows; the first three need no files."""
    return [*LOADERS, HF_DISK, *text.TEXT_SETS]


def text_spec(name: str) -> tuple[str, int, int] | None:
    """``(set, context, eval_bytes)`` of a text set's name (``pystdlib``, ``text:context=128``,
    ``pystdlib:context=128,eval_bytes=8192``), ``None`` for any other name; ``ValueError`` for a
    text set written wrong."""
    if name.split(":", 1)[0] not in text.TEXT_SETS:
        return None
    from .constraints import Interval, Param, check_all, table

    [spec] = parse(name)
    values = check_all(f"dataset {spec.name}", table(
        Param("context", Interval(int, 1, None), text.CONTEXT, "bytes a sample holds"),
        Param("eval_bytes", Interval(int, 1, None), text.EVAL_BYTES,
              "held-out bytes evaluated each round (at least 16 windows): a forward pass costs in proportion")),
        spec.params)
    return spec.name, values["context"], values["eval_bytes"]


def load(name: str, *, root: str | None = None, seed: int = 0) -> Dataset:
    """The data set ``name``, standardised; same name, files and seed give identical bits.

    ``root`` is the folder of a file-based set's files; ``seed`` draws the generated sets
    (and the digits split) and is ignored by the file-based ones, whose split is fixed.
    """
    folder = None if root is None else Path(root)
    if is_reference(name):
        x_train, y_train, x_test, y_test = _user_data(name)
        return _finish(name, x_train, y_train, x_test, y_test, classes=int(max(y_train.max(), y_test.max())) + 1)
    if text_spec(name) is not None:
        kind, context, eval_bytes = text_spec(name)
        data = _stdlib(context, eval_bytes) if kind == "pystdlib" else _text(kind, context, folder, eval_bytes)
        return data if data.name == name else dataclasses.replace(data, name=name)  # named as asked: tasks compare it
    if name == HF_DISK:
        from .flower_datasets import read_folder  # lazily: datasets and pyarrow are heavy

        *arrays, classes = read_folder(folder)
        return _finish(name, *_check(folder, arrays[0].shape[1:], *arrays, classes=classes),
                       classes=classes)
    if name not in LOADERS:
        raise ValueError(f"unknown data set {name!r}: choose one of {', '.join(names())}")
    if name in GENERATED:
        return _generated(name, seed)
    return _finish(name, *LOADERS[name](folder, seed))


GENERATED = ("digits", "mnist1d", "synthetic")  # the sets that need no files


@functools.lru_cache(maxsize=8)
def _generated(name: str, seed: int) -> Dataset:
    """A set that needs no files, made once per process per seed (digits: 0.5 s each time; a
    bench process runs many cells on it). Callers share its tensors and never write to them
    (a node's part is a copy); the dataclass is frozen."""
    return _finish(name, *LOADERS[name](None, seed))


@functools.lru_cache(maxsize=4)
def _stdlib(context: int, eval_bytes: int = text.EVAL_BYTES) -> Dataset:
    """``pystdlib``, read once per process (its tensors are shared, never written): the
    interpreter's own files do not change while it runs."""
    return _text("pystdlib", context, None, eval_bytes)


def _text(name: str, context: int, root: Path | None, eval_bytes: int = text.EVAL_BYTES) -> Dataset:
    """A text set (``robust.text``), named with the options it does not take by default."""
    c = text.corpus(name, root, context, eval_bytes)
    given = [f"context={context}"] * (context != text.CONTEXT) + [f"eval_bytes={eval_bytes}"] * (eval_bytes != text.EVAL_BYTES)
    named = f"{name}:{','.join(given)}" if given else name
    return Dataset(named, torch.from_numpy(c.x_train), torch.from_numpy(c.y_train), torch.from_numpy(c.x_test),
                   torch.from_numpy(c.y_test), text.VOCAB, torch.from_numpy(c.groups), c.sha256)


LOADER = "loader() -> (x_train, y_train, x_test, y_test)"


def _user_data(name: str) -> Arrays:
    """The user's loader's four arrays, checked: inputs ``(N, *shape)`` with one sample shape,
    integer labels ``(N,)`` in ``0..``, at least one sample per split."""
    loader = resolve(name, "dataset", LOADER)
    try:
        out = loader()
    except Exception as err:  # the user's code: any failure is theirs to fix, said in one line
        raise ValueError(f"dataset {name!r} failed when called as loader(): {type(err).__name__}: {err}") from None
    if not isinstance(out, (tuple, list)) or len(out) != 4:
        raise ValueError(f"dataset {name!r} returned a {type(out).__name__}; expected a {LOADER.split('-> ')[1]} tuple")
    arrays = []
    for label, value in zip(("x_train", "y_train", "x_test", "y_test"), out):
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if not isinstance(value, np.ndarray):
            raise ValueError(f"dataset {name!r}: {label} is a {type(value).__name__}; expected a tensor or NumPy array")
        arrays.append(value)
    x_train, y_train, x_test, y_test = arrays
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if x.ndim < 2 or not len(x) or not np.issubdtype(x.dtype, np.number):
            raise ValueError(f"dataset {name!r}: x_{split} is {x.dtype} {x.shape}; expected numbers shaped (N, *sample shape), N >= 1")
        if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
            raise ValueError(f"dataset {name!r}: y_{split} is {y.dtype} {y.shape}; expected integer labels >= 0 "
                             f"shaped ({len(x)},), one per sample of x_{split}")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"dataset {name!r}: train samples are {x_train.shape[1:]}, test samples {x_test.shape[1:]}; "
                         "expected the same shape")
    return x_train, y_train, x_test, y_test


def _finish(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
            y_test: np.ndarray, classes: int = CLASSES) -> Dataset:
    """Standardise per channel with float64 train statistics and convert to torch."""
    x_train = x_train.astype(np.float32)
    x_test = x_test.astype(np.float32)
    axes = (0, *range(2, x_train.ndim))
    mean = x_train.mean(axis=axes, dtype=np.float64, keepdims=True)
    x_train -= mean
    x_test -= mean
    # einsum accumulates the squares in float64 without a float64 copy of the data.
    flat = x_train.reshape(*x_train.shape[:2], -1)
    sq = np.einsum("nck,nck->c", flat, flat, dtype=np.float64)
    std = np.sqrt(sq / (x_train.size / x_train.shape[1])).reshape(mean.shape)
    std[std == 0] = 1.0  # a constant channel carries nothing: leave it at 0
    x_train /= std
    x_test /= std
    return Dataset(
        name=name,
        x_train=torch.from_numpy(x_train),
        y_train=torch.from_numpy(y_train.astype(np.int64)),
        x_test=torch.from_numpy(x_test),
        y_test=torch.from_numpy(y_test.astype(np.int64)),
        classes=classes,
    )
