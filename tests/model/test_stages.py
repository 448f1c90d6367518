"""Pipeline stages built from the model: same outputs and gradients as the whole model, relayed
skip connections, parameter ownership, weight stashing through functional_call, and mismatches."""
import dataclasses

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pdtool.artifacts.cluster import parse_cluster
from pdtool.errors import LaunchError
from pdtool.model.spec import load_model
from pdtool.planner import make_plan
from pdtool.artifacts.profile import ModelRef
from pdtool.profiler import profile_model
from pdtool.model.layergraph import build_layer_graph
from pdtool.model.stages import build_stages, plan_stages
from pdtool.zoo import gpt, mlp, resnet50

FX = dict(method="fx", granularity="module", depth=None)


class Skip(nn.Module):
    """Layers a, b, c, d; the output of a and the input `bias` skip over b's whole stage.

    `scale` (a parameter) and `shift` (a buffer) are read by attribute in forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.register_buffer("shift", torch.full((8,), 0.1))

    def forward(self, x, bias):
        h = torch.relu(self.a(x))
        y = self.b(h) * self.scale
        z = self.c(y) + self.shift
        return self.d(z + h) + bias


def skip_bundle():
    torch.manual_seed(0)
    return Skip(), (torch.randn(5, 6), torch.randn(5, 3)), torch.randn(5, 3)


def zoo_bundle(factory, **kwargs):
    torch.manual_seed(0)
    bundle = factory(**kwargs)
    _, inputs, target = bundle.batch(4)
    return bundle.module, inputs, target


MODELS = {
    "mlp": lambda: zoo_bundle(mlp, in_features=12, hidden=8, depth=3, classes=3),
    "resnet": lambda: zoo_bundle(resnet50, width=4, image_size=32, classes=3, blocks=[1, 1]),
    "gpt": lambda: zoo_bundle(gpt, vocab=40, seq_len=8, d_model=16, heads=2, layers=2),
    "skip": skip_bundle,
}
LOSS = {"mlp": nn.functional.cross_entropy, "resnet": nn.functional.cross_entropy,
        "gpt": lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten()),
        "skip": lambda out, t: ((out - t) ** 2).mean()}
# Where stages start, by layer name (the first stage starts at layer 0).
SPLITS = {
    "mlp": [["4"], ["2", "4", "6"]],  # single-layer stages
    "resnet": [["layer1.0.conv2"],  # inside a residual block: the skip path crosses the cut
               ["layer1.0.conv1", "layer2.0.downsample.0"],  # the downsampled skip is relayed through a stage
               ["layer1.0.downsample.1", "layer1.0.conv3", "fc"]],
    "gpt": [["blocks.0.attn.scaled_dot_product_attention"], ["blocks.0.ln1", "blocks.1.ln1"],
            ["blocks.0.attn.proj", "blocks.0.out", "blocks.1.attn.scaled_dot_product_attention"]],
    "skip": [["b", "c"], ["b"], ["b", "c", "d"]],
}
CASES = [(name, starts) for name, splits in SPLITS.items() for starts in splits]


def spans(ranges):
    """Layer-id sets of (first, last) ranges."""
    return [range(first, last + 1) for first, last in ranges]


def ranges_for(module, starts):
    names = [g.name for g in build_layer_graph(module).groups]
    cuts = [0] + [names.index(s) for s in starts] + [len(names)]
    return [(a, b - 1) for a, b in zip(cuts, cuts[1:])]


def first_inputs(stages, inputs):
    return dict(zip(stages[0].inputs, inputs))


def run_forward(stages, inputs):
    """Forward stage by stage; each stage receives fresh leaf tensors, as from another worker."""
    records, values = [], first_inputs(stages, inputs)
    for stage in stages:
        received = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in values.items()}
        values = stage.forward(received)
        records.append((received, values))
    return records


def run_backward(stages, records, loss):
    """Backward from the last stage to the first; returns parameter gradients by whole-model name."""
    grads, upstream = {}, None
    for stage, (received, produced) in zip(reversed(stages), reversed(records)):
        if upstream is None:
            outs, grad_outs = [loss], [torch.ones(())]
        else:
            names = [n for n in stage.outputs if upstream.get(n) is not None]
            outs, grad_outs = [produced[n] for n in names], [upstream[n] for n in names]
        params = list(stage.module.named_parameters())
        taken = [n for n in stage.inputs if n in received and received[n].requires_grad]
        found = torch.autograd.grad(outs, [p for _, p in params] + [received[n] for n in taken], grad_outs,
                                    allow_unused=True)
        grads.update({stage.param_names[n]: g for (n, _), g in zip(params, found)})
        upstream = dict(zip(taken, found[len(params):]))
    return grads


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("name,starts", CASES, ids=[f"{n}-{len(s) + 1}" for n, s in CASES])
def test_stages_give_the_models_output_and_gradients(name, starts, method):
    module, inputs, target = MODELS[name]()
    stages = build_stages(module, spans(ranges_for(module, starts)), method=method, granularity="module", depth=None,
                          inputs=inputs)
    assert len(stages) == len(starts) + 1
    records = run_forward(stages, inputs)
    out = records[-1][1]["output"]
    expected = module(*inputs)
    assert torch.equal(out, expected)

    grads = run_backward(stages, records, LOSS[name](out, target))
    module.zero_grad(set_to_none=True)
    LOSS[name](expected, target).backward()
    assert set(grads) == {n for n, _ in module.named_parameters()}
    for qualified, p in module.named_parameters():
        torch.testing.assert_close(grads[qualified], p.grad, msg=qualified)


@pytest.mark.parametrize("name,starts", CASES, ids=[f"{n}-{len(s) + 1}" for n, s in CASES])
def test_each_stage_owns_exactly_its_layers_parameters(name, starts):
    module, _, _ = MODELS[name]()
    ranges = ranges_for(module, starts)
    groups = build_layer_graph(module).groups
    stages = build_stages(module, spans(ranges), **FX)
    whole = dict(module.named_parameters())
    seen = []
    for stage, (first, last) in zip(stages, ranges):
        owned = {p for g in groups[first:last + 1] for p in g.params}
        assert set(stage.param_names.values()) == owned
        assert stage.layers == tuple(range(first, last + 1))
        for local, p in stage.module.named_parameters():
            assert p is whole[stage.param_names[local]]  # the model's own tensor, not a copy
        seen += stage.param_names.values()
    assert sorted(seen) == sorted(whole)  # every parameter exactly once
    buffers = [q for stage in stages for q in stage.buffer_names.values()]
    assert sorted(buffers) == sorted(n for n, _ in module.named_buffers())


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("depth", [None, 1, 2])
def test_torch_export_finds_the_layers_torch_fx_finds(name, depth):
    """The same granularity from either tracer: the ops of one module call fold into one layer
    (module-stack metadata) exactly as fx keeps that call whole, and `--depth` works alike."""
    module, inputs, _ = MODELS[name]()
    exported = build_layer_graph(module, depth=depth, method="export", inputs=inputs)
    traced = build_layer_graph(module, depth=depth)
    assert [g.name for g in exported.groups] == [g.name for g in traced.groups]
    assert [g.params for g in exported.groups] == [g.params for g in traced.groups]
    assert exported.edges == traced.edges


@pytest.mark.parametrize("name,options,starts", [
    ("gpt", dict(granularity="module", depth=2), ["blocks.1"]),  # a whole block is one layer
    ("resnet", dict(granularity="op", depth=None), ["layer1.0.relu", "layer1.0.add", "layer3#2"]),  # every op is a layer
])
def test_stages_follow_the_profiles_granularity_and_depth(name, options, starts):
    module, inputs, _ = MODELS[name]()
    names = [g.name for g in build_layer_graph(module, **options).groups]
    cuts = [0] + [names.index(s) for s in starts] + [len(names)]
    stages = build_stages(module, spans([(a, b - 1) for a, b in zip(cuts, cuts[1:])]), method="fx", **options)
    values = first_inputs(stages, inputs)
    for stage in stages:
        values = stage.forward(values)
    assert torch.equal(values["output"], module(*inputs))


def test_a_skip_over_a_whole_stage_is_relayed_as_the_same_tensor():
    module, inputs, _ = skip_bundle()
    stages = build_stages(module, spans(ranges_for(module, ["b", "c"])), **FX)
    assert [s.inputs for s in stages] == [("x", "bias"), ("bias", "relu"), ("bias", "relu", "mul")]
    assert [s.outputs for s in stages] == [("bias", "relu"), ("bias", "relu", "mul"), ("output",)]
    received, produced = run_forward(stages, inputs)[1]
    assert produced["relu"] is received["relu"] and produced["bias"] is received["bias"]
    # `scale` (read by attribute) is a real parameter of b's stage, `shift` a buffer of c's stage
    assert dict(stages[1].module.named_parameters())["scale"] is module.scale
    assert stages[1].param_names["scale"] == "scale" and "scale" not in stages[1].inputs
    assert stages[2].buffer_names == {"shift": "shift"} and not list(stages[0].module.buffers())


def test_functional_call_runs_a_stage_on_other_weights():
    module, inputs, _ = zoo_bundle(resnet50, width=4, image_size=32, classes=3, blocks=[1, 1])
    stages = build_stages(module, spans(ranges_for(module, ["layer1.0.conv2", "layer2.0.conv1"])), **FX)
    values = first_inputs(stages, inputs)
    expected = dict(values)
    for stage in stages:
        clone = {n: p.detach().clone() for n, p in stage.module.named_parameters()}
        values = functional_call(stage.module, clone, (values,))
        expected = stage.forward(expected)
    assert torch.equal(values["output"], expected["output"])

    # other weights: the stages on w + 0.01 equal the whole model on w + 0.01
    shifted = {n: p.detach() + 0.01 for n, p in module.named_parameters()}
    values = first_inputs(stages, inputs)
    for stage in stages:
        mine = {n: shifted[q].requires_grad_() for n, q in stage.param_names.items()}
        values = functional_call(stage.module, mine, (values,))
    torch.testing.assert_close(values["output"], functional_call(module, shifted, inputs))
    grads = torch.autograd.grad(values["output"].sum(), list(shifted.values()))
    assert all(g is not None for g in grads)  # every stashed version got its gradient


class Tied(nn.Module):
    """An embedding whose weight is also the output head's (as in GPT-2)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.mid(self.emb(idx)))


def test_tied_weights_across_stages_are_recorded_and_their_gradients_add_up():
    module = Tied()
    assert not build_stages(module, spans([(0, 2)]), **FX)[0].tied  # in one stage, nothing to tie
    stages = build_stages(module, spans([(0, 0), (1, 2)]), **FX)
    assert [s.tied for s in stages] == [{"emb.weight": (0, 1)}, {"head.weight": (0, 1)}]
    assert stages[1].param_names["head.weight"] == "emb.weight"  # the whole model's first name
    idx = torch.tensor([[1, 2, 3]])
    out = stages[1].forward(stages[0].forward({stages[0].inputs[0]: idx}))["output"]
    out.sum().backward()  # both stages hold the one tensor here: its gradient is the sum of both uses
    whole = Tied()
    whole.load_state_dict(module.state_dict())
    whole(idx).sum().backward()
    torch.testing.assert_close(module.emb.weight.grad, whole.emb.weight.grad)


def test_a_parameter_read_by_two_stages_is_tied_too():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.b(self.a(x) * self.scale) * self.scale

    stages = build_stages(Shared(), spans([(0, 0), (1, 1)]), **FX)
    assert stages[0].tied == {"scale": (0, 1)} and stages[1].tied == {"scale": (0, 1)}


# ----- mismatches ---------------------------------------------------------------------------------

def one_line_error(call, match):
    with pytest.raises(LaunchError, match=match) as err:
        call()
    assert "\n" not in str(err.value) and "pd plan" in str(err.value)
    return str(err.value)


def test_a_wrong_layer_count_or_layer_name_is_a_launch_error():
    module, _, _ = skip_bundle()  # 4 layers: a, b, c, d
    one_line_error(lambda: build_stages(module, spans([(0, 1), (2, 4)]), **FX), "the plan has 5 layers but this model has 4")
    one_line_error(lambda: build_stages(module, spans([(0, 1), (2, 3)]), **FX, layer_names={0: "a", 3: "head"}),
                   "layer 3 is 'head' but this model's is 'd'")
    one_line_error(lambda: build_stages(module, spans([(0, 1), (1, 3)]), **FX), "layer 1 is in stages 0 and 1")
    one_line_error(lambda: build_stages(module, spans([(0, 1), (2, 3)]), method="modules", granularity="module",
                                        depth=None), "only an nn.Sequential can be split without them")


MLP = dict(in_features=12, hidden=8, depth=3, classes=3)


@pytest.fixture(scope="module")
def mlp_plan():
    profile = profile_model(ModelRef("pdtool.zoo:mlp", MLP), batch_size=4, repeats=1, warmup=0)
    return make_plan(profile, parse_cluster("2x1.25e9B/s"), simulate=False)


def test_plan_stages_builds_the_plans_stages_of_its_model(mlp_plan):
    module = load_model(ModelRef("pdtool.zoo:mlp", MLP)).module
    stages = plan_stages(mlp_plan, module)
    assert [s.layers for s in stages] == [s.layers for s in mlp_plan.stages]
    x = torch.randn(4, 12)
    values = first_inputs(stages, (x,))
    assert stages[0].inputs == ("input_1",)  # fx node names: nn.Sequential's `input` is `input_1`
    for stage in stages:
        values = stage.forward(values)
    assert torch.equal(values["output"], module(x))


def test_plan_stages_refuses_another_model_or_granularity(mlp_plan):
    other = load_model(ModelRef("pdtool.zoo:mlp", dict(MLP, hidden=9))).module
    message = one_line_error(lambda: plan_stages(mlp_plan, other), "differ from those of pdtool.zoo:mlp .*the model the plan was made for")
    assert "fingerprint" in message
    same = load_model(ModelRef("pdtool.zoo:mlp", MLP)).module
    by_op = dataclasses.replace(mlp_plan, profile=dataclasses.replace(mlp_plan.profile, granularity="op"))
    one_line_error(lambda: plan_stages(by_op, same), "the plan has 4 layers but this model has 7 at granularity op")


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_stage_may_be_a_down_set_difference_rather_than_a_range(method):
    """Stage 0 runs a residual block's main branch start but not its downsample branch, which
    stage 1 runs (a cut the planner's down-set states allow on branchy graphs)."""
    module, inputs, target = MODELS["resnet"]()
    names = [g.name for g in build_layer_graph(module).groups]
    main = {names.index(n) for n in ("conv1", "bn1", "maxpool", "layer1.0.conv1", "layer1.0.bn1")}
    rest = [i for i in range(len(names)) if i not in main]
    assert names.index("layer1.0.downsample.0") in rest and min(rest) < max(main)  # not a range
    stages = build_stages(module, [sorted(main), rest], method=method, granularity="module", depth=None, inputs=inputs)
    assert stages[0].layers == tuple(sorted(main))
    records = run_forward(stages, inputs)
    out = records[-1][1]["output"]
    expected = module(*inputs)
    assert torch.equal(out, expected)
    grads = run_backward(stages, records, LOSS["resnet"](out, target))
    module.zero_grad(set_to_none=True)
    LOSS["resnet"](expected, target).backward()
    for qualified, p in module.named_parameters():
        torch.testing.assert_close(grads[qualified], p.grad)


def test_stages_out_of_dependency_order_are_refused():
    module, _, _ = MODELS["resnet"]()
    count = len(build_layer_graph(module).groups)
    one_line_error(lambda: build_stages(module, [range(1, count), [0]], **FX), "not in data-flow order")


def test_a_buffer_read_by_two_stages_is_saved_once():
    from types import SimpleNamespace

    from pdtool.runtime.worker.shards import stage_state

    class SharedShift(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.register_buffer("shift", torch.full((4,), 0.5))

        def forward(self, x):
            return self.b(self.a(x) + self.shift) + self.shift

    stages = build_stages(SharedShift(), spans([(0, 0), (1, 1)]), **FX)
    assert [s.shared_buffers for s in stages] == [{"shift": (0, 1)}, {"shift": (0, 1)}]
    saved = [stage_state(SimpleNamespace(stage=s, index=s.index, stepper=SimpleNamespace(optimizer=None)))[0] for s in stages]
    assert "shift" in saved[0] and "shift" not in saved[1]  # so the shards merge without a clash
