"""`pd export` and `--init-from` files (issue 35 items 4, 12 and 13): an earlier export is never overwritten
without --force, a failed export leaves nothing, a damaged or foreign weights folder is one line."""
import json
import os

import pytest
import torch
from click.testing import CliRunner

from pdtool.artifacts.checkpoint import checkpoint_folder, save_shard, write_manifest
from pdtool.cli import cli
from pdtool.errors import ArtifactError
from pdtool.model import weights
from pdtool.model.weights import INDEX, WeightFiles


def _checkpoint(root, stages=2, scale=1.0):
    folder = checkpoint_folder(root, 4)
    hashes = {s: save_shard(folder, s, {f"layer{s}.weight": torch.full((2, 3), scale * (s + 1))}) for s in range(stages)}
    write_manifest(folder, 4, "0" * 64, hashes)
    return folder


def _export(*args):
    return CliRunner().invoke(cli, ["export", *map(str, args)])


def test_an_earlier_export_is_refused_and_replaced_only_with_force(tmp_path):
    out = tmp_path / "out"
    assert _export(_checkpoint(tmp_path / "three", 3), "-o", out).exit_code == 0
    (out / "README.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = _export(_checkpoint(tmp_path / "two", 2, scale=5.0), "-o", out)
    assert result.exit_code == 1 and "already holds an export" in result.stderr and "--force" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    result = _export(tmp_path / "two", "-o", out, "--force")
    assert result.exit_code == 0, result.output
    index = json.loads((out / INDEX).read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", INDEX, "model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors"])
    assert set(index["weight_map"]) == {"layer0.weight", "layer1.weight"}  # the other model's third shard is gone
    assert WeightFiles.open(out).read(["layer1.weight"])["layer1.weight"].eq(10.0).all()


@pytest.mark.parametrize("failure", ["full disk", "read-only"])
def test_a_failed_export_leaves_no_shard_without_its_index(tmp_path, monkeypatch, failure):
    import safetensors.torch

    out = tmp_path / "out"
    out.mkdir()
    calls = []
    real = safetensors.torch.save_file

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the second stage's shard: the first one is already written
            if failure == "full disk":
                raise safetensors.SafetensorError("Error while serializing: IoError(No space left on device)")
            raise PermissionError(13, "Permission denied")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    result = _export(_checkpoint(tmp_path / "ckpt"), "-o", out)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "nothing of this export was left there" in result.stderr
    assert list(out.iterdir()) == []


def test_an_export_folder_with_a_planted_link_writes_through_no_link(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, out / "config.json")  # not an export file: left alone, never written through
    assert _export(_checkpoint(tmp_path / "ckpt"), "-o", out).exit_code == 0
    assert victim.read_text() == "keep" and os.path.islink(out / "config.json")


def _index_folder(tmp_path, weight_map, files=("model-00001-of-00001.safetensors",)):
    from safetensors.torch import save_file

    folder = tmp_path / "weights"
    folder.mkdir(exist_ok=True)
    for name in files:
        save_file({"w": torch.ones(2)}, str(folder / name))
    (folder / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("weight_map, words", [
    ({"w": 3}, "maps w to 3"),
    (["model-00001-of-00001.safetensors"], "weight_map is not an object"),
    ({"w": "../outside/x.safetensors"}, "outside the folder"),
    ({"w": "/etc/passwd"}, "outside the folder"),
])
def test_a_malformed_or_escaping_index_is_one_line(tmp_path, weight_map, words):
    folder = _index_folder(tmp_path, weight_map)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes((folder / "model-00001-of-00001.safetensors").read_bytes())
    with pytest.raises(ArtifactError, match=words) as info:
        WeightFiles.open(folder)
    assert "\n" not in str(info.value)


def test_a_shard_that_is_a_link_out_of_the_folder_is_refused(tmp_path):
    folder = _index_folder(tmp_path, {"w": "model-00001-of-00001.safetensors"}, files=())
    elsewhere = tmp_path / "elsewhere.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(elsewhere))
    os.symlink(elsewhere, folder / "model-00001-of-00001.safetensors")
    with pytest.raises(ArtifactError, match="symbolic link"):
        WeightFiles.open(folder)


def test_weights_of_an_integer_dtype_are_refused_for_a_floating_parameter(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"layer.weight": torch.zeros(2, 3, dtype=torch.int32), "layer.bias": torch.zeros(3)}, str(path))
    with pytest.raises(ArtifactError, match=r"layer\.weight is int32, but the model.s parameter is floating") as info:
        WeightFiles.open(path).check({"layer.weight": (2, 3), "layer.bias": (3,)})
    assert "\n" not in str(info.value)
    with pytest.raises(ArtifactError, match=r"layer\.weight is int32, but the model.s parameter is float32"):
        WeightFiles.open(path).check({"layer.weight": (2, 3), "layer.bias": (3,)},
                                     dtypes={"layer.weight": "float32", "layer.bias": "float32"})
    save_file({"layer.weight": torch.zeros(2, 3, dtype=torch.bfloat16), "layer.bias": torch.zeros(3)}, str(path))
    WeightFiles.open(path).check({"layer.weight": (2, 3), "layer.bias": (3,)})  # another floating dtype: converted


def test_a_held_out_split_of_other_shapes_than_the_training_split_is_one_line_before_training():
    """Issue 35 item 14: it failed after training, with torch's raw shape error."""
    from types import SimpleNamespace

    from pdtool.errors import LaunchError
    from pdtool.runtime.launcher.job import held_out_batches
    from pdtool.runtime.run import RunConfig

    plan = SimpleNamespace(profile=SimpleNamespace(batch_size=4))
    config = RunConfig(plan_path="p.json", steps=2, data="toydata:other_shapes_held_out", evaluate=True)
    with pytest.raises(LaunchError, match=r"--evaluate: the held-out split of toydata:other_shapes_held_out has input 0 "
                                          r"of \(9,\) float32 per item where the training split has \(8,\) float32"):
        held_out_batches(plan, config)
    assert held_out_batches(plan, RunConfig(plan_path="p.json", steps=2, data="toydata:halves", evaluate=True)) > 0


def _save(path, **tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


def test_a_folder_whose_model_safetensors_links_outside_it_is_refused(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    os.symlink(_save(tmp_path / "elsewhere.safetensors", w=torch.ones(2)), folder / weights.SINGLE)
    with pytest.raises(ArtifactError, match="symbolic link") as info:
        WeightFiles.open(folder)
    assert "\n" not in str(info.value) and "--local-dir" in str(info.value)
    assert WeightFiles.open(tmp_path / "elsewhere.safetensors").read(["w"])["w"].eq(1).all()  # a file named: its own


def test_weights_are_read_on_the_file_checked_never_through_a_link_planted_later(tmp_path):
    folder = _index_folder(tmp_path, {"w": "model-00001-of-00001.safetensors"})
    files = WeightFiles.open(folder)  # checked: a regular file of the folder
    shard = folder / "model-00001-of-00001.safetensors"
    shard.unlink()
    os.symlink(_save(tmp_path / "other.safetensors", w=torch.full((2,), 7.0)), shard)
    for read in (files.headers, lambda: files.read(["w"])):
        with pytest.raises(ArtifactError, match="symbolic link"):
            read()


def test_an_index_that_is_a_link_says_so(tmp_path):
    folder = _index_folder(tmp_path, {"w": "model-00001-of-00001.safetensors"})
    (tmp_path / "real.json").write_text((folder / INDEX).read_text())
    (folder / INDEX).unlink()
    os.symlink(tmp_path / "real.json", folder / INDEX)
    with pytest.raises(ArtifactError, match=f"{INDEX}: .*symbolic link"):
        WeightFiles.open(folder)


def test_an_index_naming_a_tensor_its_file_does_not_hold_is_one_line(tmp_path):
    folder = _index_folder(tmp_path, {"w": "model-00001-of-00001.safetensors", "v": "model-00001-of-00001.safetensors"})
    with pytest.raises(ArtifactError, match="maps v to model-00001-of-00001.safetensors, which does not hold it"):
        WeightFiles.open(folder).check({"w": (2,), "v": (2,)})


@pytest.mark.parametrize("found, model, words", [
    (torch.int32, "int64", r"steps is int32, but the model.s buffer is int64"),
    (torch.float32, "int64", r"steps is float32, but the model.s buffer is int64"),
    (torch.int64, "float32", r"steps is int64, but the model.s buffer is float32"),
])
def test_a_buffer_of_another_kind_of_dtype_is_refused(tmp_path, found, model, words):
    path = _save(tmp_path / "w.safetensors", w=torch.ones(2), steps=torch.zeros(3, dtype=found))
    with pytest.raises(ArtifactError, match=words):
        WeightFiles.open(path).check({"w": (2,)}, {"steps"}, dtypes={"w": "float32", "steps": model})
    _save(path, w=torch.ones(2, dtype=torch.float16), steps=torch.zeros(3, dtype=getattr(torch, model)))
    WeightFiles.open(path).check({"w": (2,)}, {"steps"}, dtypes={"w": "float32", "steps": model})  # its own: fine


BUFFERED = '''
import torch
from torch import nn
import pdtool


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    def forward(self, x):
        return self.lin(x) + self.steps


@pdtool.factory
def make():
    model = nn.Sequential(Counted(), nn.ReLU(), nn.Linear(3, 3))
    sample = lambda batch: ((torch.randn(batch, 4),), torch.randint(0, 3, (batch,)))
    return model, sample, lambda out, target: nn.functional.cross_entropy(out, target)
'''


def test_the_launcher_refuses_an_integer_buffer_of_another_dtype_captured_and_from_its_cache(tmp_path, monkeypatch):
    import sys

    from pdtool.artifacts.profile import ModelRef
    from pdtool.model.capture import Capture
    from pdtool.runtime.launcher import capture_cache
    from pdtool.runtime.launcher.preflight import preflight

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist"))
    from helpers import plan_with

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(capture_cache.ENV, str(tmp_path / "cache"))
    name = f"buffered_{abs(hash(str(tmp_path))) % 10 ** 8}"
    (tmp_path / f"{name}.py").write_text(BUFFERED)
    monkeypatch.syspath_prepend(str(tmp_path))
    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1)], mode="flush", ref=ModelRef(f"{name}:make", {}),
                           batch_size=2)
    good = {n: t for n, t in plan_model_state(name).items()}
    _save(tmp_path / "good.safetensors", **good)
    _save(tmp_path / "bad.safetensors", **dict(good, **{"0.steps": torch.zeros(3, dtype=torch.int32)}))
    for _ in range(2):  # captured, then from the cache
        checked = preflight(plan, plan_path=str(path), mode="flush", data="synthetic", seed=0,
                            init_from=str(tmp_path / "good.safetensors"))
        assert checked.capture.dtypes["0.steps"] == "int64" and checked.capture.dtypes["0.lin.weight"] == "float32"
        with pytest.raises(ArtifactError, match=r"0\.steps is int32, but the model.s buffer is int64"):
            preflight(plan, plan_path=str(path), mode="flush", data="synthetic", seed=0,
                      init_from=str(tmp_path / "bad.safetensors"))
    assert Capture.from_json(checked.capture.to_json()) == checked.capture
    text = checked.capture.to_json().replace('"int64"', '"save"')  # a cache entry names torch.save, not a dtype
    with pytest.raises(ValueError, match="not a torch dtype"):
        Capture.from_json(text)
    sys.modules.pop(name, None)


def plan_model_state(name):
    import importlib

    return {n: t.contiguous() for n, t in importlib.import_module(name).make()[0].state_dict().items()}


def test_ctrl_c_during_an_export_leaves_nothing_behind(tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "out"
    out.mkdir()
    real, calls = safetensors.torch.save_file, []

    def interrupted(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        weights.export(_checkpoint(tmp_path / "ckpt"), out)
    assert list(out.iterdir()) == []


def test_config_from_overwrites_no_config_already_there_without_force(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "new"}')
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "mine"}')
    ckpt = _checkpoint(tmp_path / "ckpt")
    result = _export(ckpt, "-o", out, "--config-from", hf)
    assert result.exit_code == 1 and "config.json" in result.stderr and "--force" in result.stderr, result.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json"] and "mine" in (out / "config.json").read_text()
    assert _export(ckpt, "-o", out, "--config-from", hf, "--force").exit_code == 0
    assert "new" in (out / "config.json").read_text()
