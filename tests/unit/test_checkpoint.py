import json
import os

import pytest
import torch
from torch import nn

from pdtool.artifacts.checkpoint import (
    checkpoint_folder, latest_complete, load_checkpoint, save_shard, write_manifest,
)
from pdtool.errors import ArtifactError
from pdtool.jsonio import canonical_json

PLAN = "ab" * 32


class NotATensor:
    """An arbitrary class: weights_only loading must refuse to unpickle it."""


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


def _save(root, step, parts, extras=None, meta=None):
    """Save one shard per dict in `parts` and the manifest; returns the folder."""
    folder = checkpoint_folder(root, step)
    hashes = {s: save_shard(folder, s, part, (extras or {}).get(s)) for s, part in enumerate(parts)}
    write_manifest(folder, step, PLAN, hashes, meta or {"mode": "pipedream"})
    return folder


def _split(state, prefixes):
    """The state dict split into stages by the first component of each name."""
    return [{k: v for k, v in state.items() if k.split(".")[0] in group} for group in prefixes]


def test_round_trip_keeps_tensors_extras_and_manifest(tmp_path):
    weight = torch.randn(3, 2, requires_grad=True)
    momentum = torch.randn(3, 2)
    folder = _save(tmp_path, 120, [{"fc.weight": weight, "fc.count": torch.tensor(7)}],
                   {0: {"fc.weight": {"momentum_buffer": momentum}, "fc.count": {"step": 5}}}, {"lr": 0.1})
    assert folder == tmp_path / "step-00000120"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "stage-0.pt"]
    manifest, tensors, extras = load_checkpoint(folder)
    assert manifest.step == 120 and manifest.plan_sha256 == PLAN and manifest.meta == {"lr": 0.1}
    assert torch.equal(tensors["fc.weight"], weight.detach()) and not tensors["fc.weight"].requires_grad
    assert tensors["fc.count"].item() == 7
    assert torch.equal(extras["fc.weight"]["momentum_buffer"], momentum) and extras["fc.count"] == {"step": 5}
    text = (folder / "manifest.json").read_text()
    assert text == canonical_json(json.loads(text))
    assert latest_complete(tmp_path) == folder


def test_a_view_is_saved_alone(tmp_path):
    big = torch.randn(1000, 100)
    folder = checkpoint_folder(tmp_path, 1)
    save_shard(folder, 0, {"row": big[3]})
    assert (folder / "stage-0.pt").stat().st_size < 100 * 4 + 4096


def test_shards_of_two_stages_merge_into_the_full_state_and_resplit_under_another_plan(tmp_path):
    model = _model()
    state = model.state_dict()
    folder = _save(tmp_path, 10, _split(state, [{"0", "1", "2"}, {"3", "4"}]))
    _, tensors, _ = load_checkpoint(folder)
    assert tensors.keys() == state.keys()
    fresh = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    fresh.load_state_dict(tensors, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))
    # a 3-stage plan takes its own names from the merged dict and saves a new checkpoint
    again = _save(tmp_path, 20, _split(tensors, [{"0"}, {"2"}, {"3", "4"}]))
    manifest, merged, _ = load_checkpoint(again)
    assert sorted(manifest.shards) == [0, 1, 2]
    assert all(torch.equal(merged[k], v) for k, v in state.items()) and merged.keys() == state.keys()


def test_a_corrupt_shard_is_refused_and_skipped(tmp_path):
    old = _save(tmp_path, 10, [{"a": torch.ones(4)}, {"b": torch.ones(4)}])
    new = _save(tmp_path, 20, [{"a": torch.zeros(4)}, {"b": torch.zeros(4)}])
    shard = new / "stage-1.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="stage-1.pt: sha256 differs from the manifest's") as info:
        load_checkpoint(new)
    assert "\n" not in str(info.value)
    warnings = []
    assert latest_complete(tmp_path, warnings.append) == old
    assert len(warnings) == 1 and "step-00000020" in warnings[0] and "corrupt" in warnings[0]


def test_a_missing_manifest_or_shard_is_skipped(tmp_path):
    old = _save(tmp_path, 10, [{"a": torch.ones(4)}])
    save_shard(checkpoint_folder(tmp_path, 30), 0, {"a": torch.zeros(4)})  # crashed before the manifest
    missing = _save(tmp_path, 20, [{"a": torch.ones(4)}, {"b": torch.ones(4)}])
    (missing / "stage-1.pt").unlink()
    (tmp_path / "step-0000040").mkdir()  # not a checkpoint name: ignored
    (tmp_path / "notes.txt").write_text("hello")
    warnings = []
    assert latest_complete(tmp_path, warnings.append) == old
    assert "step-00000030" in warnings[0] and "incomplete" in warnings[0]
    assert "step-00000020" in warnings[1] and "stage 1 is missing" in warnings[1]
    with pytest.raises(ArtifactError, match="no manifest.json, so the checkpoint is incomplete"):
        load_checkpoint(checkpoint_folder(tmp_path, 30))


def test_no_checkpoint_gives_none(tmp_path):
    assert latest_complete(tmp_path / "nowhere") is None
    assert latest_complete(tmp_path) is None


def test_shards_are_loaded_weights_only(tmp_path, monkeypatch):
    folder = _save(tmp_path, 5, [{"a": torch.ones(2)}], {0: {"evil": NotATensor()}})
    with pytest.raises(ArtifactError, match="stage-0.pt: cannot load the shard") as info:
        load_checkpoint(folder)
    assert "\n" not in str(info.value)
    seen = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k.get("weights_only")) or real_load(*a, **k))
    load_checkpoint(_save(tmp_path, 6, [{"a": torch.ones(2)}]))
    assert seen == [True]


@pytest.mark.parametrize("target", ["replace", "save"])
def test_a_failed_shard_write_leaves_no_file_under_the_final_name(tmp_path, monkeypatch, target):
    def boom(*args, **kwargs):
        raise OSError("disk full")

    if target == "replace":
        monkeypatch.setattr(os, "replace", boom)
    else:
        monkeypatch.setattr(torch, "save", boom)
    folder = checkpoint_folder(tmp_path, 1)
    with pytest.raises((OSError, ArtifactError), match="disk full"):  # a failed write is one ArtifactError line
        save_shard(folder, 0, {"a": torch.ones(2)})
    assert not folder.exists() or list(folder.iterdir()) == []


def test_a_failed_manifest_write_leaves_an_incomplete_checkpoint_and_the_old_one(tmp_path, monkeypatch):
    old = _save(tmp_path, 1, [{"a": torch.ones(2)}])
    folder = checkpoint_folder(tmp_path, 2)
    digest = save_shard(folder, 0, {"a": torch.zeros(2)})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(ArtifactError, match="disk full; free space"):
        write_manifest(folder, 2, PLAN, {0: digest}, {})
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == ["stage-0.pt"]
    assert latest_complete(tmp_path) == old
    assert torch.equal(load_checkpoint(old)[1]["a"], torch.ones(2))


def test_a_complete_checkpoint_is_never_overwritten(tmp_path):
    folder = _save(tmp_path, 3, [{"a": torch.ones(2)}])
    before = (folder / "stage-0.pt").read_bytes()
    with pytest.raises(ArtifactError, match="already holds a complete checkpoint"):
        save_shard(folder, 0, {"a": torch.zeros(2)})
    with pytest.raises(ArtifactError, match="already holds a complete checkpoint"):
        write_manifest(folder, 3, PLAN, {0: "00"}, {})
    assert (folder / "stage-0.pt").read_bytes() == before and latest_complete(tmp_path) == folder


def test_manifest_needs_every_shard_and_names_belong_to_one_stage(tmp_path):
    folder = checkpoint_folder(tmp_path, 4)
    digest = save_shard(folder, 0, {"a": torch.ones(2)})
    with pytest.raises(ArtifactError, match=r"no shard for stage\(s\) \[1\]"):
        write_manifest(folder, 4, PLAN, {0: digest, 1: "00"}, {})
    twice = _save(tmp_path, 5, [{"a": torch.ones(2)}, {"a": torch.ones(2)}])
    with pytest.raises(ArtifactError, match="'a' is in the shards of stages 0 and 1"):
        load_checkpoint(twice)


def test_damaged_manifests_are_one_line_errors(tmp_path):
    folder = _save(tmp_path, 7, [{"a": torch.ones(2)}])
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "schema": "pdtool.plan/1"}))
    with pytest.raises(ArtifactError, match="is not 'pdtool.checkpoint/1'"):
        load_checkpoint(folder)
    (folder / "manifest.json").write_text(json.dumps({**manifest, "step": 8}))
    warnings = []
    assert latest_complete(tmp_path, warnings.append) is None and "says step 8" in warnings[0]
    (folder / "manifest.json").write_text("{")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_checkpoint(folder)
    with pytest.raises(ArtifactError, match="step -1 is not a non-negative integer"):
        checkpoint_folder(tmp_path, -1)


def test_one_rule_for_every_bad_checkpoint_skip_it_with_the_reason(tmp_path):
    """Newest first: a symlinked folder, a symlinked shard, a shard weights_only refuses and a
    manifest missing a stage are each skipped with one line saying why; the newest good one wins."""
    import hashlib
    import io

    good = _save(tmp_path, 1, [{"a.w": torch.ones(2)}, {"b.w": torch.ones(2)}])
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    _save(outside, 9, [{"a.w": torch.ones(2)}, {"b.w": torch.ones(2)}])
    os.symlink(checkpoint_folder(outside, 9), checkpoint_folder(tmp_path, 6))      # a linked step folder
    linked = _save(tmp_path, 5, [{"a.w": torch.ones(2)}, {"b.w": torch.ones(2)}])
    (linked / "stage-1.pt").unlink()
    os.symlink(checkpoint_folder(outside, 9) / "stage-1.pt", linked / "stage-1.pt")  # a linked shard
    pickled = _save(tmp_path, 4, [{"a.w": torch.ones(2)}, {"b.w": torch.ones(2)}])
    buffer = io.BytesIO()
    torch.save({"tensors": {"b.w": torch.ones(2)}, "extra": {"x": NotATensor()}}, buffer)
    (pickled / "stage-1.pt").write_bytes(buffer.getvalue())
    manifest = json.loads((pickled / "manifest.json").read_text())
    manifest["shards"]["1"]["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (pickled / "manifest.json").write_text(json.dumps(manifest))
    _save(tmp_path, 3, [{"a.w": torch.ones(2)}])                                     # stage 1's shard not listed
    warnings = []
    assert latest_complete(tmp_path, warnings.append, needs={"a.w", "b.w"}) == good
    assert len(warnings) == 4
    assert "step-00000006" in warnings[0] and "symbolic link" in warnings[0]
    assert "step-00000005" in warnings[1] and "symbolic link" in warnings[1]
    assert "step-00000004" in warnings[2] and "cannot load the shard" in warnings[2]
    assert "step-00000003" in warnings[3] and "has no b.w" in warnings[3]


# ----- one run per checkpoint: run ids in shards and manifests ---------------------------------------------

def test_a_manifest_completes_only_the_shards_of_its_own_run(tmp_path):
    from pdtool.artifacts.checkpoint import complete_checkpoint, complete_run, has_shards, shard_name

    folder = checkpoint_folder(tmp_path, 4)
    save_shard(folder, 0, {"a": torch.zeros(2)}, run="aaaa")
    save_shard(folder, 1, {"b": torch.zeros(2)}, run="bbbb")  # another run's shard of stage 1
    assert sorted(p.name for p in folder.iterdir()) == [shard_name(0, "aaaa"), shard_name(1, "bbbb")]
    assert not has_shards(folder, 2, "aaaa") and not has_shards(folder, 2, "bbbb")
    with pytest.raises(ArtifactError, match="no shard stage-1.aaaa.pt"):
        complete_checkpoint(folder, 2, PLAN, {}, "aaaa")
    assert complete_run(tmp_path, "aaaa", 2, PLAN, {}) == [] and not (folder / "manifest.json").exists()
    save_shard(folder, 1, {"b": torch.ones(2)}, run="aaaa")
    assert complete_run(tmp_path, "aaaa", 2, PLAN, {"mode": "flush"}) == [folder]
    manifest, tensors, _ = load_checkpoint(folder)
    assert manifest.run == "aaaa" and manifest.meta == {"mode": "flush"} and torch.equal(tensors["b"], torch.ones(2))


def test_a_shard_of_another_run_under_a_manifest_is_refused_on_load(tmp_path):
    folder = checkpoint_folder(tmp_path, 2)
    digest = save_shard(folder, 0, {"a": torch.zeros(2)}, run="aaaa")
    write_manifest(folder, 2, PLAN, {0: digest}, {}, run="aaaa")
    other = checkpoint_folder(tmp_path / "other", 2)
    save_shard(other, 0, {"a": torch.ones(2)}, run="bbbb")
    data = (other / "stage-0.bbbb.pt").read_bytes()
    (folder / "stage-0.aaaa.pt").write_bytes(data)  # swapped in, hash fixed up in the manifest
    manifest = json.loads((folder / "manifest.json").read_text())
    import hashlib

    manifest["shards"]["0"]["sha256"] = hashlib.sha256(data).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="written by run bbbb, but the manifest completes run aaaa"):
        load_checkpoint(folder)


@pytest.mark.parametrize("run", ["a/b", "../x", "a" * 65, "\u00e4", "a b"])
def test_a_bad_run_id_is_refused(tmp_path, run):
    with pytest.raises(ArtifactError, match="run id"):
        save_shard(tmp_path / "step-00000001", 0, {"a": torch.zeros(1)}, run=run)
    with pytest.raises(ArtifactError, match="run id"):
        write_manifest(tmp_path, 1, PLAN, {0: "x"}, {}, run=run)


def test_latest_complete_skips_another_models_checkpoint_by_shape(tmp_path):
    _save(tmp_path, 3, [{"fc.weight": torch.zeros(3, 2)}])
    lines = []
    assert latest_complete(tmp_path, lines.append, {"fc.weight": (3, 2)}) == tmp_path / "step-00000003"
    assert latest_complete(tmp_path, lines.append, {"fc.weight": (4, 2)}) is None
    assert "fc.weight has shape (3, 2), the model (4, 2) (another model's checkpoint)" in lines[0]


# ----- the manifest, declared once (artifacts/manifest.py) ---------------------------------------------------

META = {"mode": "pipedream", "samples": 384, "lr": 0.1, "nested": {"b": [1, 2.5, None, True], "a": "x"}}
HASHES = {0: "0" * 64, 1: "1" * 64, 10: "ab" * 32}
# written by write_manifest before the manifest was a declared record (commit d6881ee), byte for byte
OLD_BYTES = {
    None: '{\n  "meta": {\n    "lr": 0.1,\n    "mode": "pipedream",\n    "nested": {\n      "a": "x",\n      "b": [\n'
          '        1,\n        2.5,\n        null,\n        true\n      ]\n    },\n    "samples": 384\n  },\n'
          '  "plan_sha256": "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",\n'
          '  "schema": "pdtool.checkpoint/1",\n  "shards": {\n    "0": {\n      "file": "stage-0.pt",\n'
          '      "sha256": "0000000000000000000000000000000000000000000000000000000000000000"\n    },\n    "1": {\n'
          '      "file": "stage-1.pt",\n'
          '      "sha256": "1111111111111111111111111111111111111111111111111111111111111111"\n    },\n    "10": {\n'
          '      "file": "stage-10.pt",\n'
          '      "sha256": "abababababababababababababababababababababababababababababababab"\n    }\n  },\n'
          '  "step": 12\n}\n',
    "a1b2c3d4e5f6": '{\n  "meta": {\n    "lr": 0.1,\n    "mode": "pipedream",\n    "nested": {\n      "a": "x",\n'
                    '      "b": [\n        1,\n        2.5,\n        null,\n        true\n      ]\n    },\n'
                    '    "samples": 384\n  },\n'
                    '  "plan_sha256": "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",\n'
                    '  "run": "a1b2c3d4e5f6",\n  "schema": "pdtool.checkpoint/1",\n  "shards": {\n    "0": {\n'
                    '      "file": "stage-0.a1b2c3d4e5f6.pt",\n'
                    '      "sha256": "0000000000000000000000000000000000000000000000000000000000000000"\n    },\n'
                    '    "1": {\n      "file": "stage-1.a1b2c3d4e5f6.pt",\n'
                    '      "sha256": "1111111111111111111111111111111111111111111111111111111111111111"\n    },\n'
                    '    "10": {\n      "file": "stage-10.a1b2c3d4e5f6.pt",\n'
                    '      "sha256": "abababababababababababababababababababababababababababababababab"\n    }\n  },\n'
                    '  "step": 12\n}\n',
}


@pytest.mark.parametrize("run", [None, "a1b2c3d4e5f6"])
def test_a_manifest_is_written_byte_for_byte_as_before_and_reads_back(tmp_path, run):
    from pdtool.artifacts.checkpoint import read_manifest, shard_name
    from pdtool.artifacts.manifest import Manifest, ShardFile
    from pdtool.artifacts.schemas import check_document

    folder = checkpoint_folder(tmp_path, 12)
    for stage in HASHES:
        save_shard(folder, stage, {"w": torch.zeros(2)}, run=run)
    write_manifest(folder, 12, "cd" * 32, HASHES, META, run=run)
    assert (folder / "manifest.json").read_text() == OLD_BYTES[run]
    manifest = read_manifest(folder)  # a manifest without run (older pdtool) reads too
    assert manifest == Manifest(step=12, plan_sha256="cd" * 32,
                                shards={s: ShardFile(shard_name(s, run), h) for s, h in HASHES.items()}, meta=META,
                                run=run)
    assert canonical_json(manifest.to_json()) == OLD_BYTES[run]
    check_document(json.loads(OLD_BYTES[run]), "manifest", "written")  # the published schema takes it


@pytest.mark.parametrize("change, message", [
    ({"schema": "pdtool.plan/1"}, "schema 'pdtool.plan/1' is not 'pdtool.checkpoint/1'; this is not a pdtool checkpoint"),
    ({"schema": None}, "schema None is not 'pdtool.checkpoint/1'"),
    ({"step": None}, "step: missing field; regenerate the file"),
    ({"step": "7"}, "step: expected an integer, found a string ('7')"),
    ({"step": True}, "step: expected an integer, found a boolean"),
    ({"plan_sha256": 5}, "plan_sha256: expected a string, found an integer (5)"),
    ({"shards": []}, "shards: expected an object, found a list ([])"),
    ({"meta": None}, "meta: missing field"),
    ({"meta": [1]}, "meta: expected an object, found a list ([1])"),
    ({"run": 7}, "run: expected a string, found an integer (7)"),
    ({"run": "a b"}, "run: expected a run id (1-64 ASCII letters and digits), found a string ('a b')"),
    ({"run": None}, "run: expected a string, found null"),
    ({"shards": {"x": {"file": "stage-0.pt", "sha256": "00"}}}, "shards: key 'x' is not a stage number"),
    ({"shards": {"\u0662": {"file": "stage-0.pt", "sha256": "00"}}}, "shards: key '\u0662' is not a stage number"),
    ({"shards": {"0": "stage-0.pt"}}, "shards.0: expected an object, found a string ('stage-0.pt')"),
    ({"shards": {"0": {"file": "stage-0.pt"}}}, "shards.0.sha256: missing field"),
    ({"shards": {"0": {"file": "../stage-0.pt", "sha256": "00"}}},
     "shards.0.file: expected a file name in the checkpoint's folder (no '/', not '.' or '..'), found a string"),
    ({"shards": {"0": {"file": "..", "sha256": "00"}}}, "shards.0.file: expected a file name"),
    ({"extra": 1}, "unknown field 'extra'; remove it"),
])
def test_every_damaged_manifest_field_is_one_line_naming_it(tmp_path, change, message):
    from pdtool.artifacts.checkpoint import read_manifest

    folder = _save(tmp_path, 7, [{"a": torch.ones(2)}])
    data = json.loads((folder / "manifest.json").read_text())
    data.update(change)
    (folder / "manifest.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None or k == "run"}))
    for read in (read_manifest, load_checkpoint):
        with pytest.raises(ArtifactError) as info:
            read(folder)
        assert "\n" not in str(info.value) and str(info.value).startswith(f"{folder / 'manifest.json'}: {message}")


def test_a_manifest_of_a_file_that_is_not_an_object_or_a_link_is_refused(tmp_path):
    from pdtool.artifacts.checkpoint import read_manifest

    folder = _save(tmp_path, 7, [{"a": torch.ones(2)}])
    (folder / "manifest.json").write_text("[1]")
    with pytest.raises(ArtifactError, match=r"manifest.json: schema 'list' is not 'pdtool.checkpoint/1'"):
        read_manifest(folder)
    (folder / "manifest.json").unlink()
    os.symlink(_save(tmp_path, 8, [{"a": torch.ones(2)}]) / "manifest.json", folder / "manifest.json")
    with pytest.raises(ArtifactError, match=r"manifest.json: a symbolic link, not a checkpoint pdtool wrote"):
        read_manifest(folder)


def test_init_from_with_resume_starts_from_the_weights_until_a_checkpoint_exists(tmp_path):
    """Issue 35 item 16: a requeued fine-tune (the same command every time) gives --init-from and --resume: the
    newest complete checkpoint wins, else the run starts from the pretrained weights; it says which."""
    from pdtool.runtime.launcher.resume import starting_point
    from pdtool.runtime.run import RunConfig

    config = RunConfig(plan_path="p.json", steps=10, checkpoint_dir=str(tmp_path / "ckpt"), init_from="/w/hf")
    said = []
    first = starting_point(config, None, True, None, said.append, None, said.append)
    assert first.init_from == "/w/hf" and first.resume is None and first.first_step == 0
    assert "starts from step 0, from the weights of --init-from /w/hf" in said[-1]
    folder = checkpoint_folder(tmp_path / "ckpt", 4)
    write_manifest(folder, 4, "0" * 64, {0: save_shard(folder, 0, {"w": torch.ones(2)})})
    again = starting_point(config, None, True, None, said.append, None, said.append)
    assert again.init_from is None and again.resume == str(folder) and again.first_step == 4 and again.steps == 6
    assert "--init-from /w/hf is not read" in said[-1]
