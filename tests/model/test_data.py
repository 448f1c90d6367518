import subprocess
import sys

import pytest
import torch

from pdtool.model.data import DataError, dataset_source, digits, evaluate, load_source, synthetic_source
from pdtool.model.spec import ModelBundle
from pdtool.zoo import mlp

from toydata import Squares


def _same(a, b):
    (inputs_a, target_a), (inputs_b, target_b) = a, b
    return len(inputs_a) == len(inputs_b) and all(torch.equal(x, y) for x, y in zip(inputs_a, inputs_b)) \
        and torch.equal(target_a, target_b)


def _ids(batch):
    """The item numbers of a Squares minibatch."""
    return batch[0][0][:, 0].long().tolist()


def test_synthetic_batches_depend_only_on_seed_and_index():
    one = synthetic_source(mlp(in_features=6, hidden=4, depth=1), 5, seed=7)
    two = synthetic_source(mlp(in_features=6, hidden=4, depth=1), 5, seed=7)
    assert one.batches_per_epoch is None
    later = two.batch(9)
    assert _same(one.batch(3), two.batch(3)) and _same(one.batch(9), later)
    assert not _same(one.batch(3), one.batch(4))
    assert not _same(one.batch(3), synthetic_source(one.bundle, 5, seed=8).batch(3))
    inputs, target = one.batch(0)
    assert inputs[0].shape == (5, 6) and target.shape == (5,)


def test_synthetic_batches_leave_the_callers_random_state_alone():
    source = synthetic_source(mlp(in_features=6, hidden=4, depth=1), 5, seed=7)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    source.batch(4)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_synthetic_batches_are_the_same_in_another_process():
    source = synthetic_source(mlp(in_features=6, hidden=4, depth=1), 5, seed=7)
    code = ("from pdtool.model.data import synthetic_source; from pdtool.zoo import mlp; "
            "(x,), y = synthetic_source(mlp(in_features=6, hidden=4, depth=1), 5, seed=7).batch(11); "
            "print(repr(x.sum().item()), y.tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    (x,), y = source.batch(11)
    assert float(out[0]) == x.sum().item() and out[1].strip() == str(y.tolist())


def test_dataset_batches_depend_only_on_seed_and_index():
    one = dataset_source(Squares(10), 3, seed=1)
    two = dataset_source(Squares(10), 3, seed=1)
    late = [two.batch(i) for i in (20, 4, 0)]  # any order of calls
    assert all(_same(one.batch(i), b) for i, b in zip((20, 4, 0), late))
    assert _ids(one.batch(0)) != _ids(dataset_source(Squares(10), 3, seed=2).batch(0))
    inputs, target = one.batch(0)
    assert inputs[0].shape == (3, 2) and target.dtype == torch.int64
    assert target.tolist() == [i * i for i in _ids(one.batch(0))]


def test_every_epoch_is_a_new_permutation():
    source = dataset_source(Squares(12), 4, seed=3)
    assert source.batches_per_epoch == 3
    epochs = [sum((_ids(source.batch(e * 3 + k)) for k in range(3)), []) for e in range(3)]
    assert all(sorted(epoch) == list(range(12)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3


@pytest.mark.parametrize("drop_last, per_epoch, last_size", [(True, 3, 3), (False, 4, 1)])
def test_batches_per_epoch_and_the_last_partial_batch(drop_last, per_epoch, last_size):
    source = dataset_source(Squares(10), 3, seed=0, drop_last=drop_last)
    assert source.batches_per_epoch == per_epoch
    epoch = [_ids(source.batch(k)) for k in range(per_epoch)]
    assert len(epoch[-1]) == last_size and len(set(sum(epoch, []))) == 3 * (per_epoch - 1) + last_size
    assert len(_ids(source.batch(per_epoch))) == 3  # the next epoch starts afresh


def test_load_source_names_synthetic_digits_and_factories():
    bundle = mlp(in_features=64, hidden=8, depth=1)
    assert load_source("synthetic", bundle, 4, 0).batches_per_epoch is None
    source = load_source("digits", bundle, 32, 0)
    assert source.batches_per_epoch == 1437 // 32
    assert source.batch(0)[0][0].shape == (32, 64)
    assert load_source("digits", bundle, 32, 0, {"image": True}).batch(0)[0][0].shape == (32, 1, 8, 8)
    assert load_source("toydata:squares", bundle, 2, 0, {"size": 7}).batches_per_epoch == 3
    (first, second), target = load_source("toydata:two_inputs", bundle, 4, 0).batch(0)
    assert first.shape == (4, 3) and second.shape == (4, 1) and target.shape == (4,)


@pytest.mark.parametrize("spec, kwargs, batch_size, message", [
    ("no_colon", {}, 2, "not synthetic, digits or pkg.module:factory"),
    ("no_such_package_xyz:f", {}, 2, "cannot import 'no_such_package_xyz'"),
    ("toydata:missing", {}, 2, "has no attribute 'missing'"),
    ("toydata:NOT_CALLABLE", {}, 2, "is not callable"),
    ("toydata:raises", {}, 2, "the factory raised ValueError: no such split"),
    ("toydata:squares", {"bogus": 1}, 2, "the factory raised TypeError"),
    ("toydata:not_a_dataset", {}, 2, "not a map-style dataset"),
    ("toydata:bare_tensors", {}, 2, "item 0 is a Tensor, not a pair"),
    ("toydata:strings", {}, 2, "the input of item 0 is a str"),
    ("toydata:empty", {}, 2, "is empty"),
    ("toydata:objects", {}, 2, "the input of item 0 cannot become a tensor"),
    ("toydata:squares", {"size": 3}, 4, "fewer than one minibatch of 4"),
    ("toydata:squares", {}, 0, "batch size 0 is not a positive integer"),
    ("synthetic", {"size": 3}, 2, "synthetic data takes no arguments"),
    ("digits", {"bogus": 1}, 2, "data 'digits'"),
])
def test_bad_data_gives_one_clear_line(spec, kwargs, batch_size, message):
    with pytest.raises(DataError, match=message) as info:
        load_source(spec, mlp(in_features=2, hidden=2, depth=1), batch_size, 0, kwargs)
    assert "\n" not in str(info.value)


def test_bad_items_found_later_name_the_item():
    source = load_source("toydata:ragged", mlp(in_features=2, hidden=2, depth=1), 8, 0)
    with pytest.raises(DataError, match=r"input of item \d is \(5,\) float32 but that of item \d is \(2,\) float32"):
        source.batch(0)
    with pytest.raises(DataError, match="index -1 is not a non-negative integer"):
        source.batch(-1)


def test_digits_splits_shapes_and_labels():
    train, test = digits(), digits(train=False)
    assert len(train) == 1437 and len(test) == 360
    x, y = train.tensors
    assert x.shape == (1437, 64) and x.dtype == torch.float32 and 0 <= x.min() and x.max() == 1
    assert y.dtype == torch.int64 and sorted(set(y.tolist())) == list(range(10))
    assert sorted(set(test.tensors[1].tolist())) == list(range(10))
    assert digits(image=True).tensors[0].shape == (1437, 1, 8, 8)
    assert torch.equal(digits(image=True).tensors[0].flatten(1), x)
    assert y[:5].tolist() == [0, 1, 2, 3, 4]  # the file keeps the original order


def test_an_mlp_learns_digits_with_plain_sgd():
    torch.manual_seed(0)
    bundle = mlp(in_features=64, hidden=64, depth=2, classes=10)
    source = dataset_source(digits(), 32, seed=0)
    optimizer = torch.optim.SGD(bundle.module.parameters(), lr=0.1, momentum=0.9)
    for index in range(15 * source.batches_per_epoch):
        if index == 10 * source.batches_per_epoch:
            optimizer.param_groups[0]["lr"] = 0.01
        inputs, target = source.batch(index)
        loss = bundle.loss_fn(bundle.module(*inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert evaluate(bundle.module, digits(train=False)) >= 0.90
    assert bundle.module.training
    assert evaluate(bundle.module, source) >= 0.95  # one epoch of the train set


def test_evaluate_refuses_endless_data():
    bundle = mlp(in_features=4, hidden=4, depth=1)
    with pytest.raises(DataError, match="endless synthetic data"):
        evaluate(bundle.module, synthetic_source(bundle, 2, 0))


def test_a_fixed_sample_bundle_gives_its_sample_for_every_index():
    sample = (torch.ones(3, 2), torch.zeros(3, dtype=torch.long))
    bundle = ModelBundle(module=torch.nn.Linear(2, 2), make_batch=lambda _size: sample,
                         loss_fn=torch.nn.functional.cross_entropy, fixed_batch_size=3)
    assert _same(synthetic_source(bundle, 3, 0).batch(5), ((sample[0],), sample[1]))


def test_held_out_splits():
    from pdtool.model.data import held_out

    assert len(held_out("digits")) == 360
    assert held_out("synthetic") is None


def test_a_factory_taking_train_has_a_held_out_split():
    from pdtool.model.data import held_out

    assert len(held_out("toydata:halves")) == 4
    assert held_out("toydata:squares") is None  # takes no train argument: no held-out split
