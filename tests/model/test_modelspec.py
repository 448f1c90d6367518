import pytest
import torch

from pdtool.errors import ModelError
from pdtool.model.spec import ModelBundle, fingerprint, load_model, parse_model_args
from pdtool.artifacts.profile import ModelRef


@pytest.mark.parametrize("spec, kwargs, message", [
    ("no_colon", {}, "not of the form pkg.module:factory"),
    ("no_such_package_xyz:f", {}, "cannot import 'no_such_package_xyz'"),
    ("toymodels:missing", {}, "has no attribute 'missing'"),
    ("toymodels:NOT_CALLABLE", {}, "is not callable"),
    ("toymodels:raises", {}, "the factory raised ValueError: no such size"),
    ("toymodels:raises", {"bogus": 1}, "the factory raised TypeError"),
    ("toymodels:not_a_model", {}, "return a ModelBundle or a tuple"),
])
def test_bad_model_specs_give_one_clear_line(spec, kwargs, message):
    with pytest.raises(ModelError, match=message) as info:
        load_model(ModelRef(spec, kwargs), given=True)  # typed by the user: no consent needed
    assert "\n" not in str(info.value)


def test_tuple_factories_become_bundles_and_batches_have_the_asked_size():
    bundle = load_model(ModelRef("toymodels:dynamic"))
    size, inputs, target = bundle.batch(5)
    assert size == 5 and inputs[0].shape == (5, 8) and target.shape == (5,)


def test_a_fixed_sample_fixes_the_batch_size():
    bundle = load_model(ModelRef("toymodels:fixed_sample"))
    assert bundle.batch(None)[0] == 3
    with pytest.raises(ModelError, match="fixed sample of batch size 3"):
        bundle.batch(8, "toymodels:fixed_sample")


def test_model_args_parse_as_json_or_strings():
    assert parse_model_args(["width=16", "blocks=[1, 2]", "name=tiny", "ratio=0.5"]) == {
        "width": 16, "blocks": [1, 2], "name": "tiny", "ratio": 0.5}
    with pytest.raises(ModelError, match="not KEY=VALUE"):
        parse_model_args(["width"])


def test_fingerprint_depends_on_names_and_shapes_only():
    a, b = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(torch.nn.Linear(3, 5))


@pytest.mark.parametrize("spec, kwargs, logits_shape", [
    ("pdtool.zoo:mlp", {"in_features": 12, "hidden": 8, "depth": 2}, (4, 10)),
    ("pdtool.zoo:vgg16", {"width": 4, "image_size": 32, "hidden": 16, "classes": 5}, (4, 5)),
    ("pdtool.zoo:resnet50", {"width": 4, "image_size": 32, "classes": 6, "blocks": [1, 1]}, (4, 6)),
    ("pdtool.zoo:gpt", {"vocab": 50, "seq_len": 8, "d_model": 16, "heads": 2, "layers": 1}, (4, 8, 50)),
])
def test_zoo_models_train_on_their_own_batches(spec, kwargs, logits_shape):
    bundle = load_model(ModelRef(spec, kwargs))
    assert isinstance(bundle, ModelBundle)
    _, inputs, target = bundle.batch(4)
    out = bundle.module(*inputs)
    assert out.shape == logits_shape
    loss = bundle.loss_fn(out, target)
    loss.backward()
    assert loss.dim() == 0 and all(p.grad is not None for p in bundle.module.parameters())


def test_full_size_zoo_models_have_their_published_parameter_counts():
    count = lambda spec: sum(p.numel() for p in load_model(ModelRef(spec)).module.parameters())  # noqa: E731
    assert count("pdtool.zoo:resnet50") == 25_557_032  # torchvision's resnet50
    assert count("pdtool.zoo:vgg16") == 138_357_544  # torchvision's vgg16


@pytest.mark.parametrize("spec", ["os:system", "subprocess:run", "builtins:eval", "runpy:run_path", "torch.hub:load",
                                  "torch:load", "sympy:sympify", "jinja2:Template", "pdtool.jsonio:write_json",
                                  "pdtool.cli:main", "toymodels:run_command", "toymodels:Dynamic", "toymodels:CALLABLE"])
def test_a_model_spec_from_a_file_resolves_only_to_a_marked_factory(spec, tmp_path, monkeypatch):
    """Plan and profile files carry the model spec: without the user's consent it must not reach
    any installed function (the standard library, torch's own dependencies, pdtool's tools, a
    tool's function re-exported from a model module), a class or any other callable."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="is not a pdtool model factory") as info:
        load_model(ModelRef(spec, {"command": "touch PWNED", "path": "PWNED"}))
    assert "\n" not in str(info.value) and not (tmp_path / "PWNED").exists()


@pytest.mark.slow
def test_the_current_folder_never_shadows_an_installed_module(tmp_path):
    """A file of the current folder named like an importable module is not what gets imported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    (tmp_path / "toymodels.py").write_text("open('SHADOWED', 'w').close()\n")
    env = dict(os.environ, PYTHONPATH=str(tests))
    code = "from pdtool.model.spec import load_model; from pdtool.artifacts.profile import ModelRef; load_model(ModelRef('toymodels:dynamic'))"
    subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, env=env, check=True)  # -P: as the pd script
    assert not (tmp_path / "SHADOWED").exists()
