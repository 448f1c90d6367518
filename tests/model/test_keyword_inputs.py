"""Inputs as users pass them (issue 25 item 6): a factory's sample may be a dict of keyword
inputs (`model(**batch)`), without a target when the model computes its own loss, and a data
set may yield dicts. pdtool passes them positionally in the sample's key order
(`model.spec.keyword_call`), so capture, profile and stages are unchanged."""
import pytest
import torch
from torch import nn

from pdtool.artifacts.profile import ModelRef
from pdtool.errors import ModelError
from pdtool.model.data import DataError, collate, dataset_source
from pdtool.model.spec import load_model, model_loss


class Scorer(nn.Module):
    """forward(x, scale=None, labels=None): a loss of its own when given labels."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x, scale=None, labels=None):
        out = self.linear(x) * (1.0 if scale is None else scale)
        if labels is None:
            return {"logits": out}
        return {"logits": out, "loss": nn.functional.cross_entropy(out, labels)}


def keyword_model():
    def make_batch(batch_size):
        return {"labels": torch.randint(0, 2, (batch_size,)), "x": torch.randn(batch_size, 3),
                "scale": torch.full((batch_size, 1), 2.0)}
    return Scorer(), make_batch, None


def test_a_dict_sample_is_passed_by_keyword_in_its_key_order():
    bundle = load_model(ModelRef(f"{__name__}:keyword_model", {}), given=True)
    assert bundle.keywords == ("labels", "x", "scale")
    net = bundle.module
    assert type(net).__name__ == "Scorer" and isinstance(net, Scorer)
    assert [n for n, _ in net.named_parameters()] == ["linear.weight", "linear.bias"]  # names stay the model's
    size, inputs, target = bundle.batch(4)
    assert size == 4 and target is None and [t.shape for t in inputs] == [(4,), (4, 3), (4, 1)]
    labels, x, scale = inputs
    by_keyword = Scorer.forward(net, x=x, scale=scale, labels=labels)
    torch.testing.assert_close(bundle.loss_fn(net(*inputs), target), by_keyword["loss"])
    assert bundle.loss_fn is model_loss


def test_torch_fx_sees_one_input_per_keyword():
    bundle = load_model(ModelRef(f"{__name__}:keyword_model", {}), given=True)
    graph = torch.fx.symbolic_trace(bundle.module).graph
    assert [n.target for n in graph.nodes if n.op == "placeholder"] == ["labels", "x", "scale"]


def test_the_models_own_loss_must_be_there():
    with pytest.raises(ModelError, match="without a scalar loss.*labels"):
        model_loss({"logits": torch.zeros(2, 2)})
    assert model_loss(torch.tensor(1.5)) == 1.5


def test_dict_items_are_ordered_by_the_models_keywords():
    items = [{"b": torch.tensor([i]), "a": torch.tensor(float(i))} for i in range(3)]
    inputs, target = collate(items, "data", keywords=("a", "b"))
    assert target is None
    assert inputs[0].tolist() == [0.0, 1.0, 2.0] and inputs[1].tolist() == [[0], [1], [2]]
    inputs, target = collate([(item, i) for i, item in enumerate(items)], "data", keywords=("a", "b"))
    assert target.tolist() == [0, 1, 2]


@pytest.mark.parametrize("items, keywords, message", [
    ([{"a": torch.zeros(1)}], ("a", "b"), r"item 0 has keyword inputs \['a'\], the model's sample \['a', 'b'\] "
                                          r"\(missing \['b'\]\)"),
    ([{"a": torch.zeros(1), "c": torch.zeros(1)}], ("a",), r"not taken: \['c'\]"),
    ([{"a": torch.zeros(1)}], (), "dict of keyword inputs but the model's sample passes positional ones"),
    ([({"a": torch.zeros(1)}, 1), {"a": torch.zeros(1)}], ("a",), "item 1 has no target but item 0 has one"),
])
def test_dict_items_that_do_not_fit_the_model_are_one_line(items, keywords, message):
    with pytest.raises(DataError, match=message) as raised:
        collate(items, "data 'mine'", keywords=keywords)
    assert "\n" not in str(raised.value)


def test_a_dataset_of_dicts_is_checked_when_it_is_loaded():
    with pytest.raises(DataError, match="not taken"):
        dataset_source([{"x": torch.zeros(3), "y": torch.zeros(1)}] * 4, 2, 0, keywords=("x",))


def test_a_maker_that_cannot_make_a_sample_of_one_is_asked_at_the_real_size():
    bundle = load_model(ModelRef(f"{__name__}:even_model", {}), given=True)
    assert bundle.keywords == ()
    _, inputs, target = bundle.batch(4)
    assert bundle.keywords == ("labels", "x") and target is None
    torch.testing.assert_close(bundle.loss_fn(bundle.module(*inputs), target),
                               Scorer.forward(bundle.module, x=inputs[1], labels=inputs[0])["loss"])


def even_model():
    def even(batch_size):
        if batch_size % 2:
            raise ValueError("pairs only")
        return {"labels": torch.zeros(batch_size, dtype=torch.long), "x": torch.randn(batch_size, 3)}
    return Scorer(), even, None

