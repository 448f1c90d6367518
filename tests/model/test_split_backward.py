"""The backward split of zero-bubble schedules: input gradients first, weight gradients later,
equal to one whole backward (runtime.split_backward)."""
import pytest
import torch

from pdtool.runtime.split_backward import ParameterNodes, input_gradients, weight_gradients


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
