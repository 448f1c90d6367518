"""The backward split of zero-bubble schedules: input gradients first, weight gradients later,
equal to one whole backward (runtime.worker.split_backward)."""
import pytest
import torch

from pdtool.runtime.worker.split_backward import ParameterNodes, add_weight_gradients, input_gradients, weight_gradients


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(inplace=True), torch.nn.Linear(5, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 3))


@pytest.mark.parametrize("inputs_need_gradients", [True, False], ids=["a later stage", "stage 0 (data in)"])
def test_the_two_parts_equal_one_backward(inputs_need_gradients):
    model = _model()
    extra = torch.nn.Parameter(torch.randn(3))  # added to the output: its path meets the inputs' only there
    params = list(model.parameters()) + [extra]

    def loss_of(x):  # the model used twice: parameters with two paths each
        return (model(x) * 2 + extra + model(x.flip(0))).square().sum()

    x = torch.randn(7, 6, requires_grad=inputs_need_gradients)
    inputs = [x] if inputs_need_gradients else []
    expected = torch.autograd.grad(loss_of(x), inputs + params)
    found, pending = input_gradients([loss_of(x)], [None], inputs, params)
    assert len(found) == len(inputs)
    for got, want in zip(found, expected):
        torch.testing.assert_close(got, want)
    if inputs_need_gradients:
        assert pending.groups and not pending.direct  # every parameter's part starts where it leaves the inputs' paths
    else:
        assert not pending.groups and len(pending.direct) == len(params)  # all of the backward is W's
    for got, want in zip(weight_gradients(pending), expected[len(inputs):]):
        torch.testing.assert_close(got, want)



def test_parameter_nodes_found_once_serve_every_later_graph():
    model = _model()
    params = list(model.parameters())
    nodes = ParameterNodes()
    for step in range(3):  # each minibatch builds a new graph on the same parameters
        x = torch.randn(7, 6, requires_grad=True)
        expected = torch.autograd.grad(model(x).square().sum(), [x] + params)
        found, pending = input_gradients([model(x).square().sum()], [None], [x], params, nodes)
        torch.testing.assert_close(found[0], expected[0])
        for got, want in zip(weight_gradients(pending), expected[1:]):
            torch.testing.assert_close(got, want)
        assert len(nodes.held) == len(params)  # found on the first graph, reused after
    other = torch.nn.Parameter(torch.randn(3))
    assert nodes(other) is not nodes(params[0]) and nodes(other) is nodes(other)


@pytest.mark.parametrize("shape, bias", [((7, 6), True), ((2, 7, 6), True), ((7, 6), False)],
                         ids=["2-d input", "3-d input (a view, then addmm)", "no bias (mm)"])
def test_linear_layers_get_their_weight_gradients_without_an_autograd_call(monkeypatch, shape, bias):
    """W of a stack of Linear layers: each layer's weight and bias straight from the gradient saved
    before its node and the input the node saved, no autograd call; equal to one backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5, bias=bias), torch.nn.ReLU(), torch.nn.Linear(5, 4, bias=bias))
    params = list(model.parameters())
    x = torch.randn(*shape, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().sum(), [x] + params)
    found, pending = input_gradients([model(x).square().sum()], [None], [x], params)
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = weight_gradients(pending)
    assert calls == []
    torch.testing.assert_close(found[0], expected[0])
    for g, want in zip(got, expected[1:]):
        torch.testing.assert_close(g, want)


def test_an_addmm_that_scales_its_terms_takes_the_autograd_call():
    """Only a plain x @ W.t() + b is computed directly: torch.addmm with beta/alpha != 1 (or any
    other node) gets its weight gradients from autograd, still equal to one backward."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(4))
    x = torch.randn(7, 6, requires_grad=True)

    def loss_of(x):
        return torch.addmm(bias, x.tanh(), weight.t(), beta=0.5, alpha=2.0).square().sum()

    expected = torch.autograd.grad(loss_of(x), [x, weight, bias])
    found, pending = input_gradients([loss_of(x)], [None], [x], [weight, bias])
    torch.testing.assert_close(found[0], expected[0])
    for got, want in zip(weight_gradients(pending), expected[1:]):
        torch.testing.assert_close(got, want)


def test_the_weight_gradients_of_several_microbatches_add_up_in_place_in_the_weights_gradients(monkeypatch):
    """`add_weight_gradients` over two microbatches: the weights' `.grad` equals two whole
    backwards; a Linear weight's second gradient is added into the first (`addmm_`: no product
    made apart, no temporary the size of the weight)."""
    products = []
    real_mm = torch.Tensor.mm
    monkeypatch.setattr(torch.Tensor, "mm", lambda *a, **k: products.append(1) or real_mm(*a, **k))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    params = list(model.parameters())
    xs = [torch.randn(7, 6, requires_grad=True) for _ in range(2)]
    expected = [sum(g) for g in zip(*(torch.autograd.grad(model(x).square().sum(), params) for x in xs))]
    made = []
    for x in xs:
        _, pending = input_gradients([model(x).square().sum()], [None], [x], params)
        products.clear()
        add_weight_gradients(pending, params)
        made.append(len(products))
    assert made == [2, 0]  # the two weights' products: made on the first microbatch, added into after
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.grad, want)
