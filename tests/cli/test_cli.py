import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdtool.cli import cli
from pdtool.artifacts.profile import Profile
from pdtool.units import parse_duration

PIPEDREAM = Path(__file__).resolve().parents[2] / "profiles" / "pipedream"

TINY = ["--model", "pdtool.zoo:mlp", "-a", "in_features=12", "-a", "hidden=8", "-a", "depth=2",
        "-b", "4", "--repeats", "2", "--warmup", "0"]


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_line_error(result, fragment, code=1):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pd: error: "), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.output


def test_profile_writes_a_valid_profile_and_reports_on_stderr(tmp_path):
    out = tmp_path / "m.profile.json"
    result = invoke("profile", *TINY, "-o", str(out))
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)
    assert [l.name for l in profile.layers] == ["0", "2", "4"]
    assert profile.model.kwargs == {"in_features": 12, "hidden": 8, "depth": 2}
    assert result.stdout == "" and f"wrote {out}: 3 layers" in result.stderr


def test_profile_threads_are_recorded_with_the_device(tmp_path):
    import torch

    out, before = tmp_path / "t.json", torch.get_num_threads()
    try:
        assert invoke("profile", *TINY, "--threads", "1", "-o", str(out)).exit_code == 0
    finally:
        torch.set_num_threads(before)
    assert Profile.load(out).device == "cpu (1 thread)"


def test_profile_to_stdout_writes_only_json_there():
    result = invoke("profile", *TINY, "-o", "-", "--quiet")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["schema"] == "pdtool.profile/1"


def test_profile_options_reach_the_profiler(tmp_path):
    out = tmp_path / "p.json"
    result = invoke("profile", *TINY, "-o", str(out), "--granularity", "op", "--method", "modules")
    assert result.exit_code == 0, result.output
    profile = Profile.load(out)
    assert profile.method == "modules" and profile.granularity == "op" and len(profile.layers) == 5


def test_show_prints_heaviest_layers_and_totals(tmp_path):
    out = tmp_path / "m.profile.json"
    invoke("profile", *TINY, "-o", str(out))
    result = invoke("show", str(out), "--top", "2")
    assert result.exit_code == 0
    assert "heaviest 2 of 3 layers" in result.stdout
    assert "layer sum / step" in result.stdout and "pdtool.zoo:mlp" in result.stdout
    assert len([l for l in result.stdout.splitlines() if l.strip().startswith(("0 ", "1 ", "2 "))]) == 2


@pytest.mark.parametrize("args, fragment", [
    (["--model", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["--model", "pdtool.zoo:nothing"], "has no attribute 'nothing'"),
    (["--model", "toymodels:raises"], "the factory raised ValueError"),
    (["--model", "pdtool.zoo:mlp", "-a", "bogus=1"], "unexpected keyword argument 'bogus'"),
    (["--model", "toymodels:wrong_shape"], "rejected its sample input"),
    (["--model", "pdtool.zoo:mlp", "-a", "width"], "not KEY=VALUE"),
    (["--model", "toymodels:dynamic", "--method", "fx"], "torch.fx cannot trace"),
])
def test_bad_models_get_one_line_exit_1_and_no_file(tmp_path, args, fragment):
    out = tmp_path / "x.json"
    result = invoke("profile", *args, "-o", str(out), "--repeats", "1")
    assert_one_line_error(result, fragment)
    assert not out.exists()


def test_a_failed_profile_leaves_the_old_output_untouched(tmp_path):
    out = tmp_path / "x.json"
    out.write_text("old\n")
    result = invoke("profile", "--model", "toymodels:raises", "-o", str(out))
    assert result.exit_code == 1 and out.read_text() == "old\n"


def test_missing_model_is_a_usage_error():
    result = invoke("profile", "-o", "x.json")
    assert result.exit_code == 2 and "give exactly one of --model and --from-pipedream" in result.stderr


def test_output_into_a_missing_folder_is_one_line(tmp_path):
    result = invoke("profile", *TINY, "-o", str(tmp_path / "no" / "x.json"))
    assert_one_line_error(result, "does not exist")


@pytest.mark.parametrize("content, fragment", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ('{"schema": "pdtool.plan/9"}', "schema is 'pdtool.plan/9'"),
    ('{"schema": "pdtool.profile/1"}', "missing field; regenerate the file"),
    ("[1, 2]", "not a pdtool artifact"),
])
def test_show_rejects_bad_files_in_one_line(tmp_path, content, fragment):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    assert_one_line_error(invoke("show", str(path)), fragment)


# ----- pd profile --from-pipedream, pd plan, pd show PLAN -------------------------------------------
VGG = str(PIPEDREAM / "vgg16.graph.txt")


def imported(tmp_path, model="vgg16"):
    out = tmp_path / f"{model}.profile.json"
    result = invoke("profile", "--from-pipedream", str(PIPEDREAM / f"{model}.graph.txt"), "-o", str(out))
    assert result.exit_code == 0, result.output
    return out


def test_from_pipedream_writes_a_profile(tmp_path):
    profile = Profile.load(imported(tmp_path))
    assert profile.method == "pipedream" and profile.batch_size == 128 and len(profile.layers) == 40


def test_from_pipedream_needs_a_batch_size_when_it_cannot_infer_one(tmp_path):
    out = tmp_path / "g.json"
    result = invoke("profile", "--from-pipedream", str(PIPEDREAM / "gnmt.graph.txt"), "-o", str(out))
    assert_one_line_error(result, "--batch-size")
    assert not out.exists()
    assert invoke("profile", "--from-pipedream", str(PIPEDREAM / "gnmt.graph.txt"), "-b", "64",
                  "-o", str(out)).exit_code == 0


def test_plan_writes_the_original_figures_and_show_explains_them(tmp_path):
    profile = imported(tmp_path)
    out = tmp_path / "vgg16.plan.json"
    result = invoke("plan", str(profile), "--cluster", "4x1.25e9B/s", "--cost-model", "pipedream", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "cost model 176.349 ms, 3.81x, 2.84x" in result.stderr
    data = json.loads(out.read_text())
    assert [s["replicas"] for s in data["stages"]] == [3, 1]
    assert data["provenance"]["command"] == ("pd plan vgg16.profile.json --cluster 4x1.25e9B/s --cost-model pipedream "
                                             "--optimizer sgd")
    shown = invoke("show", str(out))
    assert shown.exit_code == 0
    assert "<- bottleneck" in shown.stdout and "(cost model 3.81x)" in shown.stdout and "(cost model 2.84x)" in shown.stdout


def test_plan_is_byte_identical_when_run_twice(tmp_path):
    profile = imported(tmp_path)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        assert invoke("plan", str(profile), "-c", "cluster-a:2", "-o", str(out)).exit_code == 0
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("args, fragment", [
    (["--cluster", "4x12GB"], "12GB"),
    (["--cluster", "0x12GB/s"], "0"),
    (["--cluster", "4x12GB/s", "--memory", "1MiB"], "no plan fits in 1 MiB per worker"),
    (["--cluster", "nosuchpreset"], "cluster-a"),
])
def test_plan_bad_input_is_one_line_and_no_file(tmp_path, args, fragment):
    profile = imported(tmp_path)
    out = tmp_path / "p.json"
    assert_one_line_error(invoke("plan", str(profile), *args, "-o", str(out)), fragment)
    assert not out.exists()


def test_plan_refuses_a_profile_with_a_dangling_edge(tmp_path):
    profile = imported(tmp_path)
    data = json.loads(profile.read_text())
    data["edges"].append([3, 99])
    profile.write_text(json.dumps(data))
    assert_one_line_error(invoke("plan", str(profile), "-c", "4x12GB/s", "-o", str(tmp_path / "p.json")),
                          "edge 3->99 names a layer that does not exist")


def test_show_renders_a_plan_beside_its_profile(tmp_path):
    profile = imported(tmp_path)
    plan = tmp_path / "vgg16.plan.json"
    invoke("plan", str(profile), "-c", "4x1.25e9B/s", "--cost-model", "pipedream", "-o", str(plan))
    picture = tmp_path / "vgg16.dot"
    result = invoke("show", str(plan), "--render", str(picture))  # the profile is found beside the plan
    assert result.exit_code == 0, result.output
    assert "cluster_stage_0" in picture.read_text() and f"wrote {picture}" in result.stderr


def test_render_without_a_profile_or_on_a_profile_is_a_usage_error(tmp_path):
    profile = imported(tmp_path)
    plan = tmp_path / "elsewhere.json"
    invoke("plan", str(profile), "-c", "4x12GB/s", "-o", str(plan))
    found = invoke("show", str(plan), "--render", str(tmp_path / "x.svg"))  # the profile with the plan's sha256
    assert found.exit_code == 0 and (tmp_path / "x.svg").exists() or (tmp_path / "x.dot").exists()
    profile.rename(tmp_path / "moved.json")  # no *.profile.json of that sha256 beside it or here
    result = invoke("show", str(plan), "--render", str(tmp_path / "x.svg"))
    assert result.exit_code == 2 and "give --profile PROFILE.json" in result.stderr
    (tmp_path / "moved.json").rename(profile)
    assert invoke("show", str(profile), "--render", str(tmp_path / "x.svg")).exit_code == 2
    wrong = tmp_path / "other.profile.json"
    invoke("profile", "--from-pipedream", str(PIPEDREAM / "alexnet.graph.txt"), "-o", str(wrong))
    assert_one_line_error(invoke("show", str(plan), "--render", str(tmp_path / "x.svg"), "--profile", str(wrong)),
                          "is not the profile")


def test_help_and_version():
    assert "profile" in invoke("--help").stdout
    assert "--granularity" in invoke("profile", "--help").stdout
    assert invoke("--version").stdout.startswith("pdtool, version ")


def test_shell_completion_scripts_come_from_click():
    import os
    import subprocess
    import sys
    from pathlib import Path

    pd = str(Path(sys.executable).parent / "pd")
    for shell in ("bash", "zsh", "fish"):
        script = subprocess.run([pd], env={**os.environ, "_PD_COMPLETE": f"{shell}_source"},
                                capture_output=True, text=True).stdout
        assert "_PD_COMPLETE" in script, shell
    words = subprocess.run([pd], env={**os.environ, "_PD_COMPLETE": "bash_complete", "COMP_WORDS": "pd pl",
                                      "COMP_CWORD": "1"}, capture_output=True, text=True).stdout
    assert "plan" in words


def test_plan_straight_mode_and_optimizer_flags_reach_the_plan(tmp_path):
    profile = imported(tmp_path)
    sgd, adam = tmp_path / "sgd.json", tmp_path / "adam.json"
    for out, optimizer in ((sgd, "sgd"), (adam, "adam")):
        result = invoke("plan", str(profile), "-c", "4x1.25e9B/s", "--straight", "--mode", "flush",
                        "--optimizer", optimizer, "-o", str(out))
        assert result.exit_code == 0, result.output
    plans = [json.loads(p.read_text()) for p in (sgd, adam)]
    assert all(p["straight"] and p["mode"] == "flush" for p in plans)
    assert all(s["replicas"] == 1 for s in plans[0]["stages"])
    # Adam keeps two optimizer buffers per parameter, SGD with momentum one: more memory per worker
    assert plans[1]["stages"][0]["memory_bytes"] > plans[0]["stages"][0]["memory_bytes"]


def test_plan_with_a_link_latency_keeps_it_in_the_plan_and_the_simulation_pays_it(tmp_path):
    profile = imported(tmp_path)
    plain, slow = tmp_path / "plain.json", tmp_path / "slow.json"
    for out, cluster in ((plain, "4x1.25e9B/s"), (slow, "4x1.25e9B/s+2ms")):
        result = invoke("plan", str(profile), "-c", cluster, "--straight", "-o", str(out))
        assert result.exit_code == 0, result.output
    assert parse_duration(json.loads(slow.read_text())["cluster"]["levels"][0]["latency"]) == pytest.approx(0.002)
    assert "latency" not in json.loads(plain.read_text())["cluster"]["levels"][0]
    shown = invoke("simulate", str(slow))
    assert shown.exit_code == 0 and "+ 2 ms" in shown.output
    times = [json.loads(p.read_text())["predicted"]["simulated"]["time_per_minibatch_ms"] for p in (plain, slow)]
    assert times[1] > times[0]


def test_every_help_example_parses_with_its_command(tmp_path, monkeypatch):
    """The examples in each sub-command's --help name only options that exist, with valid values
    (a run file an example names is made here with one setting)."""
    import shlex

    from pdtool.cli import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text("lr = 0.1\n")
    for name, command in cli.commands.items():
        examples = [line.strip() for line in (command.epilog or "").splitlines() if line.strip().startswith("pd ")]
        assert examples, f"pd {name} --help has no examples"
        for example in examples:
            args = shlex.split(example)[2:]
            with command.make_context(name, args) as context:
                assert context.params


def _profile(tmp_path, spec, name, batch=3):
    out = tmp_path / f"{name}.profile.json"
    result = invoke("profile", "-m", spec, "-b", str(batch), "--repeats", "1", "--warmup", "0", "-o", str(out))
    assert result.exit_code == 0, result.output
    return out, result


def test_plan_gives_tied_weights_across_stages_a_mode_that_trains_them(tmp_path):
    profile, _ = _profile(tmp_path, "toymodels:tied_lm", "tied")
    out = tmp_path / "tied.plan.json"
    result = invoke("plan", str(profile), "--cluster", "4x1GB/s", "--straight", "-o", str(out))
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["mode"] == "2bw" and plan["shared"][0]["param"] == "emb.weight" and len(plan["shared"][0]["stages"]) > 1
    assert "pd: note: parameter emb.weight is used by stages" in result.stderr and "uses mode 2bw" in result.stderr
    shown = invoke("show", str(out))
    assert "tied         emb.weight is used by stages" in shown.stdout
    refused = tmp_path / "refused.plan.json"
    result = invoke("plan", str(profile), "--cluster", "4x1GB/s", "--straight", "--mode", "pipedream", "-o", str(refused))
    assert_one_line_error(result, "parameter emb.weight is used by stages")
    assert "--mode 2bw, flush, gpipe, zb or zb2" in result.stderr and not refused.exists()
    assert invoke("plan", str(profile), "--cluster", "4x1GB/s", "--straight", "--mode", "flush",
                  "-o", str(refused)).exit_code == 0


def test_plan_keeps_a_model_no_tracer_captures_in_one_stage_or_cuts_between_children(tmp_path):
    profile, made = _profile(tmp_path, "toymodels:tied_dynamic", "dynamic")
    assert "neither torch.fx (" in made.stderr and "nor torch.export (" in made.stderr
    out = tmp_path / "dynamic.plan.json"
    result = invoke("plan", str(profile), "--cluster", "4x1GB/s", "--straight", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "planned as one stage" in result.stderr
    assert len(json.loads(out.read_text())["stages"]) == 1
    sequential, _ = _profile(tmp_path, "toymodels:gated_sequential", "seq")
    result = invoke("plan", str(sequential), "--cluster", "4x1GB/s", "--straight", "-o", str(out))
    assert result.exit_code == 0, result.output
    layers = Profile.load(sequential).layers
    for stage in json.loads(out.read_text())["stages"]:  # every stage starts a child of the nn.Sequential
        first = layers[stage["layers"][0]].name
        assert stage["layers"][0] == 0 or layers[stage["layers"][0] - 1].name.split(".")[0] != first.split(".")[0]


def test_an_output_that_is_an_input_or_not_a_regular_file_is_refused(tmp_path):
    import os

    profile = tmp_path / "m.profile.json"
    assert invoke("profile", *TINY, "-o", str(profile)).exit_code == 0
    before = profile.read_bytes()
    assert_one_line_error(invoke("plan", str(profile), "--cluster", "2x1GB/s", "-o", str(profile)),
                          "it is also this command's input")
    assert profile.read_bytes() == before
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_one_line_error(invoke("plan", str(profile), "--cluster", "2x1GB/s", "-o", str(fifo)),
                          "it exists and is not a regular file")
    assert fifo.is_fifo()
    plan = tmp_path / "m.plan.json"
    assert invoke("plan", str(profile), "--cluster", "2x1GB/s", "-o", str(plan)).exit_code == 0
    assert_one_line_error(invoke("simulate", str(plan), "--trace", str(plan)), "it is also this command's input")


def test_data_parallel_replicates_one_stage_on_every_worker(tmp_path):
    """On a slow link the planner leaves a worker idle rather than all-reduce; --data-parallel
    forces the baseline as a plan (to train it beside the pick), and refuses --straight."""
    profile = imported(tmp_path)
    slow, forced = tmp_path / "slow.plan.json", tmp_path / "dp.plan.json"
    invoke("plan", str(profile), "-c", "4x10MB/s", "-o", str(slow))
    result = invoke("plan", str(profile), "-c", "4x10MB/s", "--data-parallel", "-o", str(forced))
    assert result.exit_code == 0, result.output
    data = json.loads(forced.read_text())
    assert [s["ranks"] for s in data["stages"]] == [[0, 1, 2, 3]] and "--data-parallel" in data["provenance"]["command"]
    assert data["predicted"]["time_per_minibatch_ms"] == pytest.approx(data["predicted"]["data_parallel_ms"])
    assert data["predicted"]["speedup_over_data_parallel"] == pytest.approx(1.0)
    assert json.loads(slow.read_text())["predicted"]["time_per_minibatch_ms"] < data["predicted"]["time_per_minibatch_ms"]
    assert_one_line_error(invoke("plan", str(profile), "-c", "4x1GB/s", "--data-parallel", "--straight",
                                 "-o", str(tmp_path / "x.json")), "give one of them")


def test_the_note_on_disagreeing_layers_names_only_layers_that_were_measured(tmp_path, monkeypatch):
    """Issue 35 item 18: a layer that carries an identical earlier one's figures (`same_as`) was never measured."""
    import dataclasses

    from pdtool import profiler

    measured = Profile.load(PIPEDREAM.parent / "mlp.profile.json")
    first, second = measured.layers[:2]
    noisy = dict(fwd_ms=1.0, fwd_ms_spread=0.9)  # the spread over a quarter of the median: noisy
    layers = (dataclasses.replace(first, **noisy), dataclasses.replace(second, **noisy, same_as=first.id))
    monkeypatch.setattr(profiler, "profile_model",
                        lambda *a, **k: dataclasses.replace(measured, layers=layers + measured.layers[2:]))
    result = invoke("profile", *TINY, "-o", str(tmp_path / "p.json"))
    warning = next(line for line in result.stderr.splitlines() if "kept disagreeing" in line)
    assert "of 1 layer " in warning and first.name in warning and f", {second.name}" not in warning


def test_layer_by_layer_progress_says_how_many_and_the_time_left():
    from pdtool.profiler.layerwise import _progress

    assert _progress(0, 163, 0.0) == "layer 1 of 163"
    assert _progress(10, 163, 5.0) == "layer 11 of 163, about 76 s left"
    assert _progress(1, 300, 2.0) == "layer 2 of 300, about 10 min left"
