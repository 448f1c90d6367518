"""Training data: minibatch `index` is a pure function of (seed, index).

The runtime reads minibatches from a `BatchSource` by their global index (0, 1, 2, ... over
the whole run, epochs included). Because a batch depends on nothing but the seed and its
index, the stage that feeds the inputs and the stage that needs the labels compute the same
minibatch independently and can never get out of step, and a run resumed at step k reads
exactly the batches it would have read had it never stopped.

Data enters through one string, as models do:

- `synthetic`: the model bundle's own batch maker (random data of the right shape);
- `digits`: the UCI handwritten digits shipped with pdtool (see `digits`);
- `pkg.module:factory`: a function returning a map-style torch `Dataset` whose items are
  pairs `(input, target)` (`input` a tensor or a tuple of tensors, `target` a tensor or a
  number), or dicts of keyword inputs for a model whose sample is one (e.g. `input_ids` and
  `labels`, from which a Hugging Face model computes its own loss; no target), or pairs
  `(dict, target)`.

Every failure (unimportable module, factory that raises, bad items) is one `DataError` line.
"""
from __future__ import annotations

import hashlib
import inspect
import importlib.resources
import math
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from ..errors import PdtoolError
from .spec import ModelBundle, ordered, resolve_factory

DIGITS_TRAIN_SIZE = 1437
"""The digits train set is the first 1437 of the 1797 samples; the test set the last 360."""

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class DataError(PdtoolError):
    """A data spec that cannot be loaded, a dataset factory that fails, or bad dataset items."""


class BatchSource(Protocol):
    """What the runtime reads minibatches from."""

    batches_per_epoch: int | None
    """Minibatches in one pass over the data; None for endless synthetic data."""

    def batch(self, index: int) -> Batch:
        """(inputs, target) of minibatch `index` (0, 1, 2, ... over the whole run)."""
        ...


def derive_seed(purpose: str, seed: int, index: int) -> int:
    """A 63-bit seed for `(purpose, seed, index)`, the same on every machine and process."""
    digest = hashlib.sha256(f"pdtool.data/{purpose}/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _check_index(index: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise DataError(f"minibatch index {index!r} is not a non-negative integer; count minibatches from 0")
    return index


class SyntheticSource:
    """The bundle's batch maker, run with torch's CPU generator seeded by (seed, index).

    The caller's own random state is saved and restored around each batch. Batch makers that
    draw from Python's `random` or NumPy's global generator are not covered by the seeding.
    """

    batches_per_epoch: int | None = None

    def __init__(self, bundle: ModelBundle, batch_size: int, seed: int, spec: str = "model"):
        self.bundle = bundle
        self.batch_size = batch_size
        self.seed = seed
        self.spec = spec

    def batch(self, index: int) -> Batch:
        _check_index(index)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed("synthetic", self.seed, index))
            _, inputs, target = self.bundle.batch(self.batch_size, self.spec)
        return inputs, target


def synthetic_source(bundle: ModelBundle, batch_size: int, seed: int) -> SyntheticSource:
    """Endless synthetic minibatches of `batch_size` samples from `bundle.make_batch`."""
    _check_batch_size(batch_size)
    return SyntheticSource(bundle, batch_size, seed)


class DatasetSource:
    """Minibatches of a map-style dataset, reshuffled every epoch.

    Epoch e visits the samples in the order of a permutation drawn from a torch generator
    seeded by (seed, e); minibatch `index` is number `index % batches_per_epoch` of epoch
    `index // batches_per_epoch`. With `drop_last` the samples left over at the end of an
    epoch are skipped; without it the last minibatch of every epoch is smaller.
    """

    def __init__(self, dataset: Any, batch_size: int, seed: int, drop_last: bool = True, name: str = "dataset",
                 keywords: tuple[str, ...] = ()):
        self.dataset = dataset
        self.keywords = keywords  # the model's keyword inputs (`ModelBundle.keywords`), for items that are dicts
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.name = name
        self.size = len(dataset)
        self.batches_per_epoch: int = (self.size // batch_size if drop_last else math.ceil(self.size / batch_size))
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) of the last epoch used

    def order(self, epoch: int) -> torch.Tensor:
        """The sample indices (int64) of epoch `epoch` in the order they are visited."""
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(derive_seed("epoch", self.seed, epoch))
            self._order = (epoch, torch.randperm(self.size, generator=generator))
        return self._order[1]

    def batch(self, index: int) -> Batch:
        epoch, position = divmod(_check_index(index), self.batches_per_epoch)
        ids = self.order(epoch)[position * self.batch_size:(position + 1) * self.batch_size].tolist()
        return collate([self._item(i) for i in ids], self.name, ids, self.keywords)

    def _item(self, i: int) -> Any:
        try:
            return self.dataset[i]
        except Exception as exc:
            raise DataError(f"{self.name}: reading item {i} failed with {type(exc).__name__}: {_first_line(exc)}; fix the dataset") from None


def dataset_source(dataset: Any, batch_size: int, seed: int, drop_last: bool = True,
                   name: str = "dataset", keywords: tuple[str, ...] = ()) -> DatasetSource:
    """Shuffled minibatches of `batch_size` items of `dataset` (map-style: `len` and `[i]`).

    The first item is read and checked at once, so a dataset with bad items fails here, with
    one line naming `name`, and not in the middle of a run.
    """
    _check_batch_size(batch_size)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DataError(f"{name} is a {type(dataset).__name__}, not a map-style dataset; "
                        "return an object with __len__ and __getitem__ (e.g. a torch TensorDataset)")
    try:
        size = len(dataset)
    except Exception as exc:
        raise DataError(f"{name}: len() failed with {type(exc).__name__}: {_first_line(exc)}; fix the dataset") from None
    if size == 0:
        raise DataError(f"{name} is empty; give a dataset with at least one item")
    if drop_last and size < batch_size:
        raise DataError(f"{name} holds {size} items, fewer than one minibatch of {batch_size}; "
                        "lower the batch size or keep the last partial minibatch (drop_last=False)")
    source = DatasetSource(dataset, batch_size, seed, drop_last, name, keywords)
    collate([source._item(0)], name, [0], keywords)
    return source


def collate(items: Sequence[Any], name: str = "dataset", ids: Sequence[int] | None = None,
            keywords: tuple[str, ...] = ()) -> Batch:
    """Stack items into one minibatch (inputs, target): items `(input or tuple of inputs, target)`,
    or dicts of keyword inputs (target None) or `(dict, target)`, whose names are put in the
    order of the model's `keywords`."""
    ids = list(ids) if ids is not None else list(range(len(items)))
    columns: list[list[torch.Tensor]] | None = None
    targets: list[torch.Tensor] = []
    for i, item in zip(ids, items):
        if isinstance(item, dict):
            item = (item, None)
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise DataError(f"{name}: item {i} is a {type(item).__name__}, not a pair (input, target) or a dict of "
                            "keyword inputs; make the dataset return one of those")
        if isinstance(item[0], dict):
            inputs = ordered(item[0], keywords, f"{name}: item {i}", DataError)
        else:
            inputs = item[0] if isinstance(item[0], (tuple, list)) else (item[0],)
        if columns is None:
            columns = [[] for _ in inputs]
        if len(inputs) != len(columns) or not inputs:
            raise DataError(f"{name}: item {i} has {len(inputs)} inputs, item {ids[0]} has {len(columns)}; "
                            "every item must have the same number of inputs")
        for column, value in zip(columns, inputs):
            column.append(_as_tensor(value, name, i, "input"))
        if targets and (item[1] is None) != (targets[0] is None):
            raise DataError(f"{name}: item {i} {'has no' if item[1] is None else 'has a'} target but item {ids[0]} "
                            f"{'has one' if item[1] is None else 'has none'}; give every item a target or none")
        targets.append(None if item[1] is None else _as_tensor(item[1], name, i, "target"))
    assert columns is not None, "collate needs at least one item"
    inputs = tuple(_stack(column, name, ids, "input") for column in columns)
    return inputs, (None if targets[0] is None else _stack(targets, name, ids, "target"))


def _as_tensor(value: Any, name: str, i: int, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, int, float, np.ndarray, np.generic)):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise DataError(f"{name}: the {what} of item {i} cannot become a tensor ({_first_line(exc)}); "
                            "give numeric arrays") from None
    raise DataError(f"{name}: the {what} of item {i} is a {type(value).__name__}; "
                    "items must hold tensors, NumPy arrays or numbers")


def _stack(tensors: list[torch.Tensor], name: str, ids: Sequence[int], what: str) -> torch.Tensor:
    first = tensors[0]
    for i, tensor in zip(ids, tensors):
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise DataError(f"{name}: the {what} of item {i} is {_describe(tensor)} but that of item {ids[0]} is "
                            f"{_describe(first)}; every item's {what} must have the same shape and dtype")
    return torch.stack(tensors)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch size {batch_size!r} is not a positive integer; give e.g. --batch-size 32")


def load_source(data: str, bundle: ModelBundle, batch_size: int, seed: int,
                kwargs: dict[str, Any] | None = None) -> BatchSource:
    """The source that `data` names: "synthetic", "digits" or "pkg.module:factory".

    `kwargs` go to the dataset factory (or to `digits`, e.g. {"image": True}); the digits
    source reads the train split.
    """
    if data == "synthetic":
        if kwargs:
            raise DataError(f"synthetic data takes no arguments, got {sorted(kwargs)}; drop them")
        _check_batch_size(batch_size)
        return SyntheticSource(bundle, batch_size, seed)
    return named_dataset_source(data, batch_size, seed, bundle.keywords, kwargs)


def named_dataset_source(data: str, batch_size: int, seed: int, keywords: tuple[str, ...] = (),
                         kwargs: dict[str, Any] | None = None) -> BatchSource:
    """The source of a data set `data` names ("digits" or "pkg.module:factory"; not
    "synthetic", which the model makes), for a model taking `keywords` (`load_source`)."""
    kwargs = dict(kwargs or {})
    if data == "digits":
        try:
            dataset = digits(train=True, **kwargs)
        except TypeError as exc:
            raise DataError(f"data 'digits': {_first_line(exc)}; it takes image=true|false") from None
        return dataset_source(dataset, batch_size, seed, name="data 'digits'", keywords=keywords)
    factory = resolve_data_factory(data)
    try:
        dataset = factory(**kwargs)
    except Exception as exc:
        raise DataError(f"data {data!r}: the factory raised {type(exc).__name__}: {_first_line(exc)}; check the factory and its arguments") from None
    return dataset_source(dataset, batch_size, seed, name=f"data {data!r}", keywords=keywords)


def held_out(data: str) -> Any | None:
    """The held-out split of the data set `data` names, or None when it has none: the digits
    test split, or a factory's dataset when the factory takes a `train` argument (train=False)."""
    if data == "digits":
        return digits(train=False)
    if data == "synthetic":
        return None
    factory = resolve_data_factory(data)
    try:
        accepts = "train" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        return None
    try:
        return factory(train=False)
    except Exception as exc:
        raise DataError(f"data {data!r}: the factory raised {type(exc).__name__} for train=False: {_first_line(exc)}") from None


def resolve_data_factory(spec: str) -> Callable[..., Any]:
    """Import the dataset factory `pkg.module:factory` (the current folder is importable)."""
    if ":" not in spec:
        raise DataError(f"data {spec!r} is not synthetic, digits or pkg.module:factory; write e.g. --data digits")
    return resolve_factory(spec, DataError, "data", "--data digits", given=True, flag="--data")  # typed by the user


def digits(train: bool = True, image: bool = False) -> torch.utils.data.TensorDataset:
    """The UCI handwritten digits (8x8 pixels, 10 classes), shipped with pdtool.

    The train split is the first 1437 samples, the test split the last 360 (different
    writers, every class 33 to 37 times). Items are `(pixels, label)`: pixels float32 in
    [0, 1] shaped (64,), or (1, 8, 8) with `image=True`; labels int64 in 0..9.
    Source and licence (CC BY 4.0): `pdtool/datasets/README.md`.
    """
    with importlib.resources.files("pdtool").joinpath("datasets/digits.npz").open("rb") as handle:
        with np.load(handle, allow_pickle=False) as archive:
            images, labels = archive["images"], archive["labels"]
    part = slice(0, DIGITS_TRAIN_SIZE) if train else slice(DIGITS_TRAIN_SIZE, None)
    pixels = torch.from_numpy(images[part].astype(np.float32) / 16.0)
    if image:
        pixels = pixels.reshape(-1, 1, 8, 8)
    return torch.utils.data.TensorDataset(pixels, torch.from_numpy(labels[part].astype(np.int64)))


def evaluate(module: torch.nn.Module, data: Any, batch_size: int = 256) -> float:
    """Top-1 accuracy (fraction in [0, 1]) of a classifier on a dataset or a finite source (`score`)."""
    return score(module, data, None, batch_size)[0]


def score(module: torch.nn.Module, data: Any, loss_fn=None, batch_size: int = 256) -> tuple[float, float | None]:
    """Top-1 accuracy (fraction in [0, 1]) of a classifier on a dataset or a finite source, and
    with `loss_fn` its mean loss (each minibatch's weighted by its samples; else None).

    A dataset is read once in order; a `BatchSource` for one epoch (its first
    `batches_per_epoch` minibatches). The module runs in eval mode without gradients and is
    put back in the mode it was in.
    """
    if hasattr(data, "batch") and hasattr(data, "batches_per_epoch"):
        if data.batches_per_epoch is None:
            raise DataError("cannot evaluate on endless synthetic data; give a dataset or a finite source")
        batches = (data.batch(i) for i in range(data.batches_per_epoch))
    else:
        _check_batch_size(batch_size)
        size = len(data)
        batches = (collate([data[i] for i in range(start, min(start + batch_size, size))], "evaluation data",
                           range(start, min(start + batch_size, size)))
                   for start in range(0, size, batch_size))
    was_training = module.training
    module.eval()
    correct = total = samples = 0
    loss_sum = 0.0
    try:
        with torch.no_grad():
            for inputs, target in batches:
                output = module(*inputs)
                if loss_fn is not None:
                    count = target.shape[0] if isinstance(target, torch.Tensor) and target.dim() else 1
                    loss_sum += float(loss_fn(output, target)) * count
                    samples += count
                logits = getattr(output, "logits", output)  # a Hugging Face ModelOutput carries its logits
                predicted = logits.argmax(dim=-1)
                correct += int((predicted == target).sum())
                total += target.numel()
    finally:
        module.train(was_training)
    if total == 0:
        raise DataError("cannot evaluate on no data; give a dataset with at least one item")
    return correct / total, (loss_sum / samples if loss_fn is not None else None)
