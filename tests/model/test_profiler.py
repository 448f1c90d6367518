import pytest

from pdtool.errors import ModelError, ProfileError
from pdtool.model.spec import load_model
from pdtool.artifacts.profile import ModelRef, Profile
from pdtool.profiler import profile_model

FAST = dict(repeats=2, warmup=1)


def run(spec, model_kwargs=None, batch_size=4, **options) -> Profile:
    return profile_model(ModelRef(spec, model_kwargs or {}), batch_size=batch_size, **FAST, **options)


def names(profile):
    return [layer.name for layer in profile.layers]


def edges_by_name(profile):
    return {(profile.layers[s].name, profile.layers[d].name) for s, d in profile.edges}


def assert_times_positive(profile):
    assert all(l.fwd_ms > 0 and l.bwd_ms > 0 for l in profile.layers)
    assert profile.step_ms > 0 and profile.layer_sum_over_step > 0


def test_mlp_layers_have_exact_parameter_and_activation_bytes():
    profile = run("pdtool.zoo:mlp", dict(in_features=12, hidden=8, depth=2, classes=3), batch_size=6)
    assert names(profile) == ["0", "2", "4"]  # each ReLU folded into the Linear before it
    assert [l.ops for l in profile.layers] == [("_0", "_1"), ("_2", "_3"), ("_4",)]
    assert [l.param_bytes for l in profile.layers] == [(12 * 8 + 8) * 4, (8 * 8 + 8) * 4, (8 * 3 + 3) * 4]
    assert [l.act_bytes for l in profile.layers] == [6 * 8 * 4, 6 * 8 * 4, 6 * 3 * 4]
    assert profile.edges == ((0, 1), (1, 2))
    assert profile.batch_size == 6 and profile.inputs[0].shape == (6, 12) and profile.method == "fx"
    assert profile.update_ms > 0 and profile.data_ms > 0  # an optimizer step and making a minibatch
    assert profile.reduce_ms > 0  # flattening, adding and dividing the gradients of an all-reduce
    assert 0 < profile.message_ms_per_mib < 50  # a MiB written into a socket and read out, each end
    assert_times_positive(profile)


def test_each_layer_records_what_its_forward_saves_for_the_backward_each_storage_once():
    """Issue 35 item 10: a stage's stash is what autograd saves, not the layers' outputs. Each
    layer is a Linear and its ReLU: the Linear saves its input (the model's input for layer 0, the
    ReLU output before it otherwise: counted there), the ReLU its output; the last Linear saves
    only its input, which the layer before saved already. 2 bytes per element less in bf16."""
    profile = run("pdtool.zoo:mlp", dict(in_features=12, hidden=8, depth=2, classes=3), batch_size=6)
    assert [l.saved_bytes for l in profile.layers] == [6 * 12 * 4 + 6 * 8 * 4, 6 * 8 * 4, 0]


def test_a_transformer_layer_saves_what_its_backward_needs_not_its_output():
    """The MLP's Linear + GELU saves the GELU's input and output (twice its output), a LayerNorm its
    statistics beside its input, the output head nothing of its own (its input is the final
    LayerNorm's output, charged there): the planner's stash from outputs alone was 2.4x short on
    GPT-2 (transformers' GPT2, whose dropout masks are saved too)."""
    profile = run("pdtool.zoo:gpt", dict(vocab=64, seq_len=16, d_model=32, heads=2, layers=2), batch_size=4)
    layer = {l.name: l for l in profile.layers}
    assert layer["blocks.0.fc"].saved_bytes == 2 * layer["blocks.0.fc"].act_bytes
    assert layer["head"].saved_bytes == 0
    statistics = 2 * 4 * 16 * 4  # mean and 1/std per token, fp32
    assert layer["ln_f"].saved_bytes == layer["ln_f"].act_bytes + statistics


def test_residual_block_edges_include_the_skip_connection():
    profile = run("pdtool.zoo:resnet50", dict(width=4, image_size=32, classes=3, blocks=[1]))
    edges = edges_by_name(profile)
    # the block input (after maxpool) feeds both the main path and the downsample path
    assert {("maxpool", "layer1.0.conv1"), ("maxpool", "layer1.0.downsample.0")} <= edges
    # the addition folds into bn3's layer, which therefore reads the downsampled skip path
    assert ("layer1.0.downsample.1", "layer1.0.bn3") in edges
    bn3 = profile.layers[names(profile).index("layer1.0.bn3")]
    assert {"add", "layer1_0_relu_2"} <= set(bn3.ops)
    # the skip edge crosses several layers
    downsample = names(profile).index("layer1.0.downsample.1")
    assert names(profile).index("layer1.0.bn3") > downsample + 1
    assert_times_positive(profile)


def test_parameters_are_counted_once_and_completely():
    for spec, kwargs in [("pdtool.zoo:resnet50", dict(width=4, image_size=32, blocks=[1, 1])),
                         ("pdtool.zoo:gpt", dict(vocab=40, seq_len=8, d_model=16, heads=2, layers=2))]:
        profile = run(spec, kwargs)
        module = load_model(ModelRef(spec, kwargs)).module
        assert profile.param_bytes == sum(p.numel() * 4 for p in module.parameters())


def test_gpt_layers_fold_views_and_keep_the_residual_stream():
    profile = run("pdtool.zoo:gpt", dict(vocab=40, seq_len=8, d_model=16, heads=2, layers=1), batch_size=2)
    assert names(profile) == ["tok_emb", "blocks.0.ln1", "blocks.0.attn.qkv",
                              "blocks.0.attn.scaled_dot_product_attention", "blocks.0.attn.proj",
                              "blocks.0.ln2", "blocks.0.fc", "blocks.0.out", "ln_f", "head"]
    assert ("tok_emb", "blocks.0.attn.proj") in edges_by_name(profile)  # x + attn(ln1(x))
    tok = profile.layers[0]
    assert tok.param_bytes == (40 * 16 + 8 * 16) * 4  # token and position embeddings
    assert profile.layers[2].act_bytes == 3 * 2 * 8 * 16 * 4  # q, k and v go on
    assert profile.inputs[0].dtype == "int64"


def test_op_granularity_keeps_every_op_and_depth_makes_blocks_layers():
    kwargs = dict(width=4, image_size=32, blocks=[1, 1])
    module_level = run("pdtool.zoo:resnet50", kwargs)
    op_level = run("pdtool.zoo:resnet50", kwargs, granularity="op")
    assert len(op_level.layers) > len(module_level.layers)
    assert "layer1.0.relu" in names(op_level)
    blocks = run("pdtool.zoo:resnet50", kwargs, depth=2)
    assert names(blocks) == ["conv1", "bn1", "maxpool", "layer1.0", "layer2.0", "avgpool", "fc"]
    assert blocks.layers[3].kind == "Bottleneck" and blocks.depth == 2


def test_untraceable_models_fall_back_to_leaf_modules_with_exact_edges():
    messages = []
    profile = profile_model(ModelRef("toymodels:dynamic"), batch_size=4, warn=messages.append, **FAST)
    assert profile.method == "modules" and profile.split == "none"
    # one warning names both tracers' reasons and what still works
    assert any("neither torch.fx (" in m and "nor torch.export (" in m and "one stage" in m for m in messages)
    assert names(profile) == ["a", "b", "c"]  # the ReLU module folded into a
    assert profile.layers[0].ops == ("a", "act")
    assert set(profile.edges) == {(0, 1), (1, 2), (0, 2)}  # y + h is a functional skip from a to c
    # the loose `scale` parameter (used between modules) counts toward the next layer, b
    assert [l.param_bytes for l in profile.layers] == [(8 * 16 + 16) * 4, (16 * 16 + 16 + 16) * 4, (16 * 4 + 4) * 4]
    assert [l.act_bytes for l in profile.layers] == [4 * 16 * 4, 4 * 16 * 4, 4 * 4 * 4]
    assert_times_positive(profile)


def test_forcing_fx_on_an_untraceable_model_is_a_clear_error():
    with pytest.raises(ProfileError, match="torch.fx cannot trace .*use --method auto"):
        run("toymodels:dynamic", method="fx")
    with pytest.raises(ProfileError, match="torch.export cannot export .*data-dependent.*use --method auto"):
        run("toymodels:dynamic", method="export")


def test_forcing_modules_works_on_traceable_models_too():
    profile = run("pdtool.zoo:mlp", dict(in_features=12, hidden=8, depth=2), method="modules")
    assert profile.method == "modules" and names(profile) == ["0", "2", "4"]
    assert profile.edges == ((0, 1), (1, 2))


def test_a_model_that_rejects_its_input_is_one_clear_error():
    with pytest.raises(ProfileError, match=r"toymodels:wrong_shape rejected its sample input \[\(4, 5\) float32\]"):
        run("toymodels:wrong_shape")


def test_a_loss_that_is_not_a_scalar_is_refused():
    with pytest.raises(ProfileError, match="must return a scalar"):
        run("toymodels:vector_loss")


def test_unavailable_devices_are_refused():
    with pytest.raises(ProfileError, match="use cpu or cuda"):
        profile_model(ModelRef("toymodels:dynamic"), device="tpu", **FAST)


def test_fixed_samples_set_the_profile_batch_size():
    assert profile_model(ModelRef("toymodels:fixed_sample"), **FAST).batch_size == 3
    with pytest.raises(ModelError):
        profile_model(ModelRef("toymodels:fixed_sample"), batch_size=4, **FAST)


@pytest.mark.parametrize("options", [dict(), dict(granularity="op"), dict(method="modules"),
                                     dict(method="modules", granularity="op")])
def test_in_place_ops_profile_at_every_granularity(options):
    profile = run("toymodels:inplace", **options)
    assert_times_positive(profile)
    first, last = profile.layers[0].name, profile.layers[-1].name
    assert first == "conv1" and last.startswith("head")


def test_export_captures_what_fx_cannot_and_names_modules_that_never_ran():
    messages = []
    profile = profile_model(ModelRef("toymodels:shape_branch"), batch_size=4, warn=messages.append, **FAST)
    assert profile.method == "export" and profile.split == "graph"
    assert names(profile) == ["a", "common"]
    assert [m for m in messages if "never ran with the sample" in m and ": rare;" in m]
    assert profile.param_bytes == (8 * 8 + 8 + 8 * 4 + 4) * 4  # rare's parameters are not planned


def test_tied_weights_are_recorded_by_every_tracer():
    for spec, method in (("toymodels:tied_lm", "fx"), ("toymodels:tied_dynamic", "modules")):
        profile = run(spec, batch_size=3)
        assert profile.method == method
        first, last = names(profile).index("emb"), names(profile).index("head")
        assert profile.shared == (("emb.weight", (first, last)),)
        assert profile.layers[last].param_bytes == 0  # counted once, with its first user


def test_an_exported_profile_of_a_traceable_model_equals_its_fx_profile():
    kwargs = dict(width=4, image_size=32, classes=3, blocks=[1])  # batch norm: buffers updated in the graph
    exported, traced = run("pdtool.zoo:resnet50", kwargs, method="export"), run("pdtool.zoo:resnet50", kwargs)
    assert exported.method == "export" and names(exported) == names(traced) and exported.edges == traced.edges
    assert [l.param_bytes for l in exported.layers] == [l.param_bytes for l in traced.layers]
    assert [l.act_bytes for l in exported.layers] == [l.act_bytes for l in traced.layers]
    assert_times_positive(exported)


def test_a_message_is_timed_in_cpu_time_per_mib_for_each_of_its_two_ends():
    from pdtool.profiler import timing

    ticks = iter(range(100))
    cpu = lambda: next(ticks) * 8e-3  # every timed interval takes 8 ms of CPU, both threads together
    assert timing.measure_message(repeats=3, warmup=1, cpu_clock=cpu, total=4 * 2 ** 20) == pytest.approx(1.0)
    real = timing.measure_message(repeats=3, warmup=1, total=4 * 2 ** 20)
    assert 0 < real < 50


def test_all_reduce_work_of_a_large_model_is_timed_on_a_sample_and_scaled_to_all_its_bytes(monkeypatch):
    from torch import nn

    from pdtool.profiler import timing

    ticks = iter(range(10_000))
    clock = lambda: next(ticks) * 1e-3  # every timed interval is 1 ms
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100))  # 2 x (40,000 + 400) bytes
    monkeypatch.setattr(timing, "REDUCE_SAMPLE_BYTES", 40_000)  # the first weight fills the sample
    assert timing.measure_reduce(model, repeats=3, warmup=1, clock=clock) == pytest.approx(2 * 40_400 / 40_000)
    monkeypatch.setattr(timing, "REDUCE_SAMPLE_BYTES", 10 ** 9)
    assert timing.measure_reduce(model, repeats=3, warmup=1, clock=clock) == pytest.approx(1.0)
    assert timing.measure_reduce(nn.ReLU(), repeats=3, warmup=1, clock=clock) == 0.0


def test_a_layer_whose_repeats_disagree_is_measured_again_until_they_agree():
    """A clock that makes the first 5 forwards jump between 1 and 9 ms, then settles at 1 ms: the
    layer is measured again, 5 rounds at a time, until the quartiles of all its repeats agree
    (10 repeats still spread 1-7 ms; 15 do not), and the median of all is the settled time."""
    import torch

    from pdtool.profiler.fx_measure import time_layer

    forwards = iter([1, 9, 1, 9, 9] + [1] * 100)
    ticks = {"now": 0.0, "calls": 0}

    def clock():  # start, middle (after the forward), end (after the backward) of each round
        phase = ticks["calls"] % 3
        ticks["calls"] += 1
        if phase == 1:
            ticks["now"] += next(forwards) / 1000
        elif phase == 2:
            ticks["now"] += 0.002
        return ticks["now"]

    x = torch.randn(4, 8)
    cost = time_layer(torch.nn.Linear(8, 8), (x,), {}, torch.zeros(4, 8), {id(x)}, repeats=5, warmup=0, clock=clock)
    assert ticks["calls"] == 3 * 15  # the first 5 rounds, then twice 5 more
    assert cost.fwd_ms == pytest.approx(1.0) and cost.fwd_ms_spread == pytest.approx(0.0)


def test_what_timing_a_layer_alone_adds_is_not_the_layers():
    """A profile times each layer by itself, paying the clock's reads and a backward's own start
    once per layer where a whole step pays them once: `Clock.fixed` (measured on an empty layer)
    comes off every forward and backward."""
    import torch

    from pdtool.profiler.fx_measure import time_layer
    from pdtool.profiler.timing import Clock

    fixed_fwd, fixed_bwd = Clock(torch.device("cpu")).fixed()
    assert 0 < fixed_fwd < 1e-3 and 0 < fixed_bwd < 5e-3  # microseconds, not milliseconds
    ticks = {"now": 0.0, "calls": 0}

    def clock():  # every forward 1 ms, every backward 2 ms
        ticks["now"] += (0.0, 0.001, 0.002)[ticks["calls"] % 3]
        ticks["calls"] += 1
        return ticks["now"]

    clock.fixed = lambda: (0.0002, 0.0005)
    x = torch.randn(4, 8)
    cost = time_layer(torch.nn.Linear(8, 8), (x,), {}, torch.zeros(4, 8), {id(x)}, repeats=5, warmup=0, clock=clock)
    assert cost.fwd_ms == pytest.approx(0.8) and cost.bwd_ms == pytest.approx(1.5)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_value_computed_from_a_parameter_alone_belongs_to_its_layer_and_ties_nothing(method):
    """Mamba's A = -exp(A_log.float()): torch.export checks the tensor `.float()` reads with a node no
    other node consumes; it must go with the layer that reads the parameter, not to layer 0."""
    profile = profile_model(ModelRef("toymodels:parameter_only"), batch_size=4, method=method, **FAST)
    assert profile.shared == ()  # each A_log is read by its own block's layer only


def test_the_module_hook_profiler_takes_more_steps_while_a_layers_repeats_disagree(monkeypatch):
    """Untraceable models are timed during whole steps: while some layer's repeats disagree, as many
    steps again are timed (here the first check finds one noisy, the second none)."""
    from pdtool.profiler import modules

    checks = []
    monkeypatch.setattr(modules, "noisy", lambda median, spread: not checks.append(1) and len(checks) == 1)
    lines = []
    profile_model(ModelRef("toymodels:dynamic"), batch_size=4, method="modules", progress=lines.append,
                  repeats=2, warmup=1)
    extra = [line for line in lines if line.startswith("noisy layers")]
    assert len(extra) == 5  # max(repeats, 5) more steps, once


def test_recording_what_a_layer_saves_keeps_none_of_it():
    """A saved output kept by the recording hook would hold its own graph in a reference cycle
    autograd cannot free: every layer's weights stayed, and `pd profile --memory` of a 1.75 GiB
    model peaked at 1.29x the model instead of 0.28x."""
    import weakref

    import torch
    from torch import nn

    from pdtool.profiler.fx_measure import record_saved

    layer = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8, requires_grad=True)
    saved = record_saved(layer, (x,), {})
    assert saved.own == 4 * 8 * 4 and saved.outputs == (0,) and saved.inputs == (0,)  # ReLU's output, Linear's input
    output = weakref.ref(layer(x))  # the same forward without the hook frees its output at once
    assert output() is None
    weight = weakref.ref(layer[0].weight)
    del layer
    assert weight() is None


def test_a_weight_versions_copy_is_timed_per_mib_on_a_sample_of_the_parameters(monkeypatch):
    """`measure_copy`: ms per MiB of cloning the parameters (weight stashing's copy), timed on
    the sample `measure_reduce` takes; 0 without parameters, and a real copy costs something."""
    import time

    from torch import nn

    from pdtool.profiler import timing

    ticks = iter(range(10_000))
    clock = lambda: next(ticks) * 1e-3  # every timed interval is 1 ms
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # 2 x (1 MiB + 2 KiB)
    monkeypatch.setattr(timing, "REDUCE_SAMPLE_BYTES", 2 ** 20)  # the first weight fills the sample
    assert timing.measure_copy(model, repeats=3, warmup=1, clock=clock) == pytest.approx(1.0)
    monkeypatch.setattr(timing, "REDUCE_SAMPLE_BYTES", 10 ** 9)  # all of it: 1 ms for 2 MiB + 4 KiB
    assert timing.measure_copy(model, repeats=3, warmup=1, clock=clock) == pytest.approx(2 ** 20 / (2 * 2 ** 20 + 4096))
    assert timing.measure_copy(nn.ReLU(), repeats=3, warmup=1, clock=clock) == 0.0
    assert 0 < timing.measure_copy(model, repeats=3, warmup=1, clock=time.perf_counter) < 50
