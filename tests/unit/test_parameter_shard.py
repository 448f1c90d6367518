"""`--shard parameters`' choice of FSDP units (`runtime.worker.parameter_shard.units`): the modules a stage's fx
graph calls whose weights nothing else reads; everything else is gathered with the stage itself."""
import pytest
import torch
from torch import fx, nn

from pdtool.errors import LaunchError
from pdtool.runtime.worker.parameter_shard import ParameterSharding, units


class _ReadsTheHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.body(x)
        return self.head(h) + h @ self.head.weight.t() * self.scale


def test_a_called_module_whose_weight_the_graph_also_reads_is_gathered_with_the_stage():
    graph = fx.symbolic_trace(_ReadsTheHead())
    assert units(graph) == [graph.body]


def test_a_called_composite_module_is_one_unit_and_a_module_that_is_no_graph_has_none():
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    graph = fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), layer), )
    assert [type(u).__name__ for u in units(graph)] == ["Linear", "TransformerEncoderLayer"]
    # not a graph: a module may read a child's weight without calling it (MultiheadAttention's out_proj)
    assert units(nn.Sequential(nn.Linear(8, 8), layer)) == []


def test_shared_weights_stay_with_the_stage():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert units(fx.symbolic_trace(model)) == []


def test_a_scalar_parameter_is_one_line():
    model = nn.Linear(2, 2)
    model.temperature = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(LaunchError, match="temperature .* has none; use --shard gradients"):
        ParameterSharding(model, None, torch.device("cpu"), split=False)
