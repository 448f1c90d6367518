"""`pd profile` one layer's weights at a time (`profiler.layerwise`): the same layer graph as
whole-model profiling, never more than one layer's parameters real, identical layers timed once."""
import json

import pytest

from pdtool.artifacts.profile import ModelRef, Profile
from pdtool.profiler import profile_model

FAST = dict(repeats=2, warmup=1)
GPT = ModelRef("pdtool.zoo:gpt", dict(vocab=64, seq_len=16, d_model=32, heads=2, layers=3))
STRUCTURE = ("name", "kind", "act_bytes", "param_bytes", "ops", "saved_bytes")


def _structure(profile: Profile):
    return ([tuple(getattr(layer, f) for f in STRUCTURE) for layer in profile.layers], profile.edges,
            profile.fingerprint, profile.shared, profile.method, profile.inputs)


def test_layer_by_layer_finds_the_same_layers_as_whole_model_profiling():
    whole = profile_model(GPT, batch_size=4, **FAST)
    layers = profile_model(GPT, batch_size=4, layerwise=True, **FAST)
    assert _structure(layers) == _structure(whole)
    assert layers.measured == "layers" and whole.measured == "step"
    assert layers.layer_sum_over_step is None  # no whole step was timed
    assert layers.step_ms == pytest.approx(layers.layer_sum_ms, abs=1e-3)
    assert all(layer.fwd_ms > 0 and layer.bwd_ms > 0 for layer in layers.layers)
    assert layers.update_ms > 0 and layers.reduce_ms > 0
    again = Profile.from_json(json.loads(json.dumps(layers.to_json())), "test")
    assert again.measured == "layers"


def test_only_one_layers_weights_are_real_at_a_time(monkeypatch):
    from pdtool.model import build
    from pdtool.profiler import layerwise

    held = []
    real = build.materialize

    def watched(model, names, seed, values=None):
        real(model, names, seed, values)
        held.append({n for n, p in model.named_parameters() if p.device.type != "meta" and n != "pos_emb"})

    monkeypatch.setattr(layerwise, "materialize", watched)
    profile = profile_model(GPT, batch_size=4, layerwise=True, **FAST)
    owned = [set(layer_params) for layer_params in _params_by_layer(profile)]
    assert held and all(any(h <= o for o in owned) for h in held)  # one layer's parameters, never more
    assert len(held) == len(profile.layers)


def _params_by_layer(profile):
    from pdtool.model.layergraph import capture
    from pdtool.model.spec import load_model

    module = load_model(GPT, given=True).module
    graph = capture(module, None, "fx", "module", None)
    return [g.params for g in graph.groups]


def test_identical_layers_are_timed_once_when_asked():
    profile = profile_model(GPT, batch_size=4, reuse_identical=True, **FAST)
    by_name = {layer.name: layer for layer in profile.layers}
    for block in (1, 2):
        layer = by_name[f"blocks.{block}.attn.qkv"]
        assert layer.same_as == by_name["blocks.0.attn.qkv"].id
        assert layer.fwd_ms == by_name["blocks.0.attn.qkv"].fwd_ms
    assert by_name["tok_emb"].same_as is None and by_name["head"].same_as is None
    assert json.loads(json.dumps(profile.to_json()))["layers"][by_name["blocks.2.fc"].id]["same_as"] is not None


def test_a_budget_below_the_model_profiles_it_layer_by_layer_and_says_so(tmp_path):
    from click.testing import CliRunner

    from pdtool.cli import cli

    args = ["profile", "-m", GPT.spec, *[a for k, v in GPT.kwargs.items() for a in ("-a", f"{k}={v}")], "-b", "4",
            "--repeats", "2", "--warmup", "1", "--memory", "64KiB", "-o", str(tmp_path / "g.profile.json")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "more than the 64 KiB budget (--memory): profiling it one layer's weights at a time" in result.stderr
    assert "profiled one layer at a time" in result.stderr
    assert json.loads((tmp_path / "g.profile.json").read_text())["measured"] == "layers"


def test_hugging_face_models_profile_layer_by_layer_too():
    pytest.importorskip("transformers")
    ref = ModelRef("pdtool.zoo.hf:gpt2", dict(vocab=64, seq_len=8, n_embd=16, n_head=2, n_layer=2))
    whole = profile_model(ref, batch_size=2, **FAST)
    layers = profile_model(ref, batch_size=2, layerwise=True, **FAST)
    assert whole.method == layers.method == "export"
    # captured on meta, the graph lacks what transformers does only on a real device (a .contiguous()
    # before attention here): the same layers, bytes and edges; op names may differ
    short = lambda p: [(layer.name, layer.kind, layer.act_bytes, layer.param_bytes) for layer in p.layers]  # noqa: E731
    assert short(layers) == short(whole) and layers.edges == whole.edges and layers.fingerprint == whole.fingerprint
