"""A corpus of bad input, tried as a careful user and an attacker would: broken profiles, plans,
cluster descriptions and checkpoints, model specs that are not factories, and option values out
of range. Every case must end with exit 1 and exactly one `pd: error:` line (or click's usage
error, exit 2), no traceback, no output file written and an existing output left unchanged.
Everything runs in-process through click's runner; no worker is ever started."""
import copy
import json
import os
import tempfile

import pytest
from click.testing import CliRunner

from pdtool.cli import cli

TINY = ["-m", "pdtool.zoo:mlp", "-a", "in_features=12", "-a", "hidden=8", "-a", "depth=2", "-b", "4",
        "--repeats", "1", "--warmup", "0", "-q"]
OLD = "an earlier, good output\n"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid profile and plan (JSON trees) of a tiny MLP."""
    folder = tmp_path_factory.mktemp("good")
    runner = CliRunner()
    assert runner.invoke(cli, ["profile", *TINY, "-o", str(folder / "m.profile.json")]).exit_code == 0
    assert runner.invoke(cli, ["plan", str(folder / "m.profile.json"), "--cluster", "2x1GB/s", "--straight",
                               "-o", str(folder / "m.plan.json")]).exit_code == 0
    return json.loads((folder / "m.profile.json").read_text()), json.loads((folder / "m.plan.json").read_text())


def edited(tree, edit, path):
    """A copy of the JSON `tree` changed by `edit`, written to `path`."""
    data = copy.deepcopy(tree)
    edit(data)
    path.write_text(json.dumps(data))
    return path


def check(args, tmp_path, output=None, codes=(1, 2)):
    """Run `pd args`; assert the one-line contract and that `output` (if any) kept its old text."""
    if output is not None:
        output.write_text(OLD)
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code in codes, (result.exit_code, result.output)
    assert "Traceback" not in result.output, result.output
    if result.exit_code == 1:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pd: error: "), result.stderr
    if output is not None:
        assert output.read_text() == OLD
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ----- profiles: every field broken every way --------------------------------------------------

def _profile_edits():
    edits = []
    for field, values in {
        "batch_size": [0, -1, "8", 1.5, None, 2**70],
        "step_ms": [-1, "fast", None, [], 1e13],
        "update_ms": [-1, "x"],
        "data_ms": [-1, {}],
        "reduce_ms": [-2, "slow"],
        "message_ms_per_mib": [-0.5, "cheap"],
        "method": ["magic", 3],
        "split": ["sideways", 1],
        "granularity": ["atoms"],
        "depth": [0, "deep"],
        "fingerprint": [None, 7],
        "inputs": ["x", [{"shape": [-1], "dtype": "float32"}], [{"shape": "4x4"}]],
        "edges": [[[1, 0]], [[0, 0]], [[0, 99]], [[0, 1], [0, 1]], [["a", "b"]], "none", [[0]]],
        "layers": [[], "many", None],
        "shared": [[{"param": "w", "layers": [0]}], [{"param": "w", "layers": [0, 99]}], [{"param": 1}], "x"],
        "schema": ["pdtool.plan/1", "pdtool.profile/9", None],
        "unknown_field": [1],
    }.items():
        for value in values:
            edits.append((f"{field}={value!r:.20}", lambda d, f=field, v=value: d.__setitem__(f, v)))
    for field in ("step_ms", "layers", "edges", "method", "fingerprint", "inputs", "batch_size"):
        edits.append((f"no {field}", lambda d, f=field: d.pop(f)))
    for field, values in {"fwd_ms": [-1, "1", None, 1e13], "bwd_ms": [-0.5], "act_bytes": [-8, 1.5, 2**60, 1e40],
                          "param_bytes": [-1, "big"], "id": [5, -1], "name": [3, None], "ops": ["x", [1]],
                          "bogus": [0]}.items():
        for value in values:
            edits.append((f"layers[0].{field}={value!r:.20}", lambda d, f=field, v=value: d["layers"][0].__setitem__(f, v)))
    edits.append(("duplicate layer name", lambda d: d["layers"][1].__setitem__("name", d["layers"][0]["name"])))
    return edits


@pytest.mark.parametrize("label, edit", _profile_edits(), ids=[label for label, _ in _profile_edits()])
def test_a_broken_profile_is_one_line(good, tmp_path, label, edit):
    path = edited(good[0], edit, tmp_path / "bad.profile.json")
    check(["plan", path, "--cluster", "2x1GB/s", "-o", tmp_path / "out.plan.json"], tmp_path, tmp_path / "out.plan.json")
    check(["show", path], tmp_path)


@pytest.mark.parametrize("text", ["", "{", "[]", "null", "42", '{"schema": "pdtool.profile/1"}', "NaN",
                                  '{"a": Infinity}', '{"a": 1e400}', "[" * 200000 + "]" * 200000, "\udcff"],
                         ids=["empty", "truncated", "list", "null", "number", "only schema", "NaN", "Infinity",
                              "1e400", "nested 200000 deep", "bad unicode"])
def test_a_file_that_is_not_a_profile_is_one_line(tmp_path, text):
    path = tmp_path / "bad.profile.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    check(["plan", path, "--cluster", "2x1GB/s", "-o", tmp_path / "out.plan.json"], tmp_path, tmp_path / "out.plan.json")


# ----- plans ---------------------------------------------------------------------------------------

def _plan_edits():
    edits = []
    for field, values in {"mode": ["turbo", 1], "cost_model": ["magic"], "state_space": ["all"], "straight": ["yes"],
                          "schema": ["pdtool.profile/1", "x"], "stages": [[], "two"], "shared": [[{"param": "w", "stages": [0]}]],
                          "unknown": [1]}.items():
        for value in values:
            edits.append((f"{field}={value!r:.20}", lambda d, f=field, v=value: d.__setitem__(f, v)))
    for field, values in {"ranks": [[], [0, 0], [99], "0"], "replicas": [3, 0], "layers": [[], [99], [0, 0], "all"],
                          "in_flight": [0, -2], "time_ms": [-1, "x"], "memory_bytes": [-1], "id": [4]}.items():
        for value in values:
            edits.append((f"stages[0].{field}={value!r:.20}",
                          lambda d, f=field, v=value: d["stages"][0].__setitem__(f, v)))
    edits += [
        ("a layer in two stages", lambda d: d["stages"][1]["layers"].append(d["stages"][0]["layers"][0])),
        ("a rank in two stages", lambda d: d["stages"][1].__setitem__("ranks", d["stages"][0]["ranks"])),
        ("a layer in no stage", lambda d: d["stages"][1]["layers"].pop()),
        ("cluster levels empty", lambda d: d["cluster"].__setitem__("levels", [])),
        ("cluster count 0", lambda d: d["cluster"]["levels"][0].__setitem__("count", 0)),
        ("cluster bandwidth text", lambda d: d["cluster"]["levels"][0].__setitem__("bandwidth", "fast")),
        ("profile method", lambda d: d["profile"].__setitem__("method", "magic")),
        ("profile split", lambda d: d["profile"].__setitem__("split", "sideways")),
        ("profile layers 0", lambda d: d["profile"].__setitem__("layers", 0)),
        ("predicted time NaN", lambda d: d["predicted"].__setitem__("time_per_minibatch_ms", "NaN")),
        ("no provenance", lambda d: d.pop("provenance")),
    ]
    return edits


@pytest.mark.parametrize("label, edit", _plan_edits(), ids=[label for label, _ in _plan_edits()])
def test_a_broken_plan_is_one_line_in_every_command(good, tmp_path, label, edit):
    path = edited(good[1], edit, tmp_path / "bad.plan.json")
    check(["simulate", path, "--trace", tmp_path / "t.json"], tmp_path, tmp_path / "t.json")
    check(["show", path], tmp_path)
    check(["train", path, "--steps", "1", "--metrics", tmp_path / "m.csv"], tmp_path, tmp_path / "m.csv")


def _reversed(data):
    """The two stages' layers swapped: every field valid, but stage 0 reads what stage 1 computes."""
    first, second = data["stages"]
    for key in ("layers", "first_layer", "last_layer"):
        first[key], second[key] = second[key], first[key]


def _reversed_with_records(data):
    """The two stages swapped whole (layers, names and what each receives and sends)."""
    data["stages"][0], data["stages"][1] = data["stages"][1], data["stages"][0]
    for index, stage in enumerate(data["stages"]):
        stage["id"], stage["ranks"] = index, [index]


@pytest.mark.parametrize("where", ["beside", "--profile", "nowhere"])
@pytest.mark.parametrize("edit", [_reversed, _reversed_with_records], ids=["layers swapped", "stages swapped"])
def test_stages_out_of_data_flow_order_are_refused_by_every_command(good, tmp_path, where, edit):
    """The plan records what each stage receives and sends, so the order is checked from the
    plan alone when its profile is nowhere to be found."""
    folder = tmp_path / "plans"
    folder.mkdir()
    if where != "nowhere":
        profile = (folder if where == "beside" else tmp_path) / ("m.profile.json" if where == "beside" else "else.json")
        profile.write_text(json.dumps(good[0]))
    path = edited(good[1], edit, folder / "m.plan.json")
    given = ["--profile", profile] if where == "--profile" else []
    check(["simulate", path, *given, "--trace", tmp_path / "t.json"], tmp_path, tmp_path / "t.json", codes=(1,))
    check(["show", path, *given], tmp_path, codes=(1,))
    check(["show", path, *given, "--render", tmp_path / "p.dot"], tmp_path, tmp_path / "p.dot", codes=(1,))
    check(["train", path, "--steps", "1"], tmp_path, codes=(1,))
    result = CliRunner().invoke(cli, ["simulate", str(path), *map(str, given)])
    assert "not in data-flow order" in result.stderr


def test_a_plan_from_before_stages_recorded_their_data_flow_says_to_make_it_again(good, tmp_path):
    def forget(data):
        for stage in data["stages"]:
            del stage["receives"], stage["sends"]
    path = edited(good[1], forget, tmp_path / "old.plan.json")
    for args in (["show", path], ["simulate", path], ["train", path, "--steps", "1"]):
        check(args, tmp_path, codes=(1,))
    result = CliRunner().invoke(cli, ["show", str(path)])
    assert result.stderr.endswith(f"; make it again with {good[1]['provenance']['command']} -o {path}\n")


def test_a_profile_that_is_not_the_plans_is_refused(good, tmp_path):
    plan = tmp_path / "m.plan.json"
    plan.write_text(json.dumps(good[1]))
    other = edited(good[0], lambda d: d.__setitem__("step_ms", d["step_ms"] * 2), tmp_path / "other.json")
    for args in (["simulate", plan, "--profile", other], ["show", plan, "--profile", other, "--render", tmp_path / "p.dot"]):
        check(args, tmp_path, codes=(1,))


def test_a_picture_graphviz_fails_to_draw_is_one_line_and_no_file(good, tmp_path, monkeypatch):
    folder = tmp_path / "plans"
    folder.mkdir()
    (folder / "m.profile.json").write_text(json.dumps(good[0]))
    (folder / "m.plan.json").write_text(json.dumps(good[1]))
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Warning: x' >&2\nfor i in 1 2 3; do echo \"Error: trouble in init_rank $i\" >&2; "
                    "done\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    check(["show", folder / "m.plan.json", "--render", folder / "p.svg"], tmp_path, folder / "p.svg", codes=(1,))
    result = CliRunner().invoke(cli, ["show", str(folder / "m.plan.json"), "--render", str(folder / "p.svg")])
    assert "(Error: trouble in init_rank 1); --render p.dot writes the picture's source instead" in result.stderr
    assert not (folder / "p.dot").exists() and result.stdout == ""


def test_a_plan_whose_model_changed_is_refused_before_any_worker(good, tmp_path):
    data = copy.deepcopy(good[1])
    data["profile"]["model"]["kwargs"]["hidden"] = 9  # another model than the one profiled
    path = tmp_path / "changed.plan.json"
    path.write_text(json.dumps(data))
    check(["train", path, "--steps", "1"], tmp_path, codes=(1,))


@pytest.mark.parametrize("spec", ["os:system", "subprocess:Popen", "builtins:exec", "shutil:rmtree", "torch.hub:load",
                                  "pdtool.cli:main", "pdtool.zoo:NOPE", "no_such_module_xyz:f", "justtext", ":f", "m:"])
def test_a_plan_naming_a_non_factory_is_refused_before_anything_runs(good, tmp_path, spec, monkeypatch):
    data = copy.deepcopy(good[1])
    data["profile"]["model"] = {"spec": spec, "kwargs": {"command": "touch PWNED", "path": str(tmp_path)}}
    path = tmp_path / "evil.plan.json"
    path.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    check(["train", path, "--steps", "1"], tmp_path, codes=(1,))
    assert not (tmp_path / "PWNED").exists() and tmp_path.exists()


# ----- clusters, options, model specs ----------------------------------------------------------------

@pytest.mark.parametrize("spec", ["", "4", "x", "4x", "x1GB/s", "0x1GB/s", "-2x1GB/s", "4x0GB/s", "4x-1GB/s",
                                  "4x1e-30B/s", "2x1e30GB/s", "100000000000x2GB/s", "4x12XB/s", "4x12", "4x12GB/s,",
                                  "4x1GB/s,,2x1GB/s", "cluster-z", "cluster-a:0", "cluster-a:-1", "4x1GB/s;rm -rf /",
                                  "4xNaNGB/s", "4xinfGB/s", "1.5x1GB/s", "no_such_file.json",
                                  "2x1GB/s+fast", "2x1GB/s+5", "2x1GB/s+11s", "2x1GB/s+-1us", "2x1GB/s+infs",
                                  "２x2GB/s", "٢x2GB/s", "2x１GB/s", "2x2GB/s,४x1GB/s", "2x1GB/s+５us",
                                  "cluster-a:٢", "cluster-a:２", "cluster-b:¹", "2\u200bx1GB/s"])
def test_a_bad_cluster_is_one_line(good, tmp_path, spec):
    path = tmp_path / "m.profile.json"
    path.write_text(json.dumps(good[0]))
    check(["plan", path, "--cluster", spec, "-o", tmp_path / "out.plan.json"], tmp_path, tmp_path / "out.plan.json")


@pytest.mark.parametrize("args", [
    ["--memory", "0GiB"], ["--memory", "16Gbit"], ["--memory", "lots"], ["--memory", "1e400B"],
    ["--cost-model", "magic"], ["--mode", "turbo"], ["--optimizer", "lbfgs"],
], ids=lambda a: " ".join(a))
def test_bad_plan_options(good, tmp_path, args):
    path = tmp_path / "m.profile.json"
    path.write_text(json.dumps(good[0]))
    check(["plan", path, "--cluster", "2x1GB/s", *args, "-o", tmp_path / "out.plan.json"], tmp_path,
          tmp_path / "out.plan.json")


@pytest.mark.parametrize("args", [
    ["--lr", "nan"], ["--lr", "inf"], ["--lr", "-1"], ["--lr", "0"], ["--momentum", "nan"], ["--momentum", "1.5"],
    ["--weight-decay", "-1"], ["--timeout", "0"], ["--timeout", "nan"], ["--steps", "0"], ["--steps", "10000000000"],
    ["--epochs", "0"], ["--group", "0"], ["--threads", "0"], ["--threads", "100000"], ["--seed", "-1"],
    ["--checkpoint-every", "-1"], ["--nnodes", "0"], ["--master-port", "0"], ["--master-port", "70000"],
    ["--device", "tpu"], ["--mode", "turbo"], ["--data", "nothing_here:f"], ["--data", "justtext"],
    ["--resume"], ["--evaluate"], ["--rdzv-endpoint", "h:1", "--node-rank", "1"], ["--nnodes", "2"],
    ["--iface", "nosuch0"], ["--steps", "\u0662"], ["--lr", "\uff12"], ["--timeout", "\u0665"],
    ["--max-restarts", "1"], ["--max-restarts", "-1"], ["--startup-timeout", "0"],
], ids=lambda a: " ".join(a))
def test_bad_train_options_start_no_worker(good, tmp_path, args, monkeypatch):
    path = tmp_path / "m.plan.json"
    path.write_text(json.dumps(good[1]))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    check(["train", path, *args], tmp_path)
    # no scratch folder left behind (e.g. by a rendezvous that failed); multiprocessing's own pymp-*
    # folder (the forkserver pd train starts while it checks) goes when the process exits
    assert [p for p in temp.iterdir() if not p.name.startswith("pymp-")] == []


@pytest.mark.parametrize("args", [
    ["-n", "0"], ["-n", "100000000"], ["--group", "0"], ["--mode", "turbo"], ["--trace", "/no/such/folder/t.json"],
    ["--profile", "/no/such/profile.json"],
], ids=lambda a: " ".join(a))
def test_bad_simulate_options(good, tmp_path, args):
    path = tmp_path / "m.plan.json"
    path.write_text(json.dumps(good[1]))
    check(["simulate", path, *args], tmp_path)


@pytest.mark.parametrize("args", [
    ["-m", "os:system"], ["-m", "subprocess:run"], ["-m", "nope_xyz:f"], ["-m", "x"],
    ["-m", "toymodels:raises"], ["-m", "toymodels:not_a_model"], ["-m", "toymodels:vector_loss"],
    ["-m", "toymodels:wrong_shape"], ["-m", "toymodels:dynamic", "--method", "fx"],
    ["-m", "toymodels:dynamic", "--method", "export"], ["-m", "pdtool.zoo:mlp", "-a", "bogus"],
    ["-m", "pdtool.zoo:mlp", "-a", "hidden=-1"], ["-m", "pdtool.zoo:mlp", "-b", "0"], ["-m", "pdtool.zoo:mlp", "-b", "-3"],
    ["-m", "pdtool.zoo:mlp", "--repeats", "0"], ["-m", "pdtool.zoo:mlp", "--repeats", "100000"],
    ["-m", "pdtool.zoo:mlp", "--device", "tpu"], ["-m", "pdtool.zoo:mlp", "--depth", "0"],
    ["-m", "toymodels:fixed_sample", "-b", "8"], ["--from-pipedream", "/no/such/graph.txt"], [],
], ids=lambda a: " ".join(a) or "nothing")
def test_bad_profile_requests(tmp_path, args, monkeypatch):
    """(A spec typed after -m is the user's own choice and is called: `pdtool.consent`.)"""
    monkeypatch.chdir(tmp_path)
    check(["profile", *args, "-o", tmp_path / "out.profile.json"], tmp_path, tmp_path / "out.profile.json")
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("target", ["input", "fifo", "folder", "missing folder"])
def test_an_output_that_cannot_be_a_new_file_is_one_line(good, tmp_path, target):
    import os

    path = tmp_path / "m.profile.json"
    path.write_text(json.dumps(good[0]))
    out = {"input": path, "fifo": tmp_path / "fifo", "folder": tmp_path, "missing folder": tmp_path / "no" / "x.json"}[target]
    if target == "fifo":
        os.mkfifo(out)
    before = path.read_text()
    check(["plan", path, "--cluster", "2x1GB/s", "-o", out], tmp_path)
    assert path.read_text() == before
