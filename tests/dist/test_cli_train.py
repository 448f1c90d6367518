"""`pd train` from the command line (click's CliRunner; workers are real processes)."""
import re
import csv

import pytest
import torch

from click.testing import CliRunner
from helpers import plan_with

from pdtool.cli import cli
from pdtool.runtime.worker import shm


def test_pd_train_runs_a_plan_and_reports_loss_and_time(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="pipedream")
    metrics = tmp_path / "metrics.csv"
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "5", "--metrics", str(metrics)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "trained steps 1-5 (5 minibatches) on 2 workers" in result.stdout
    assert "time per minibatch: measured" in result.stdout and "predicted" in result.stdout
    assert re.search(r"peak memory per worker: stage 0 [\d.]+ (?:[kKMGT]i?)?B measured \(rank \d+, beyond [\d.]+ (?:[kKMGT]i?)?B at its start\), [\d.]+ (?:[kKMGT]i?)?B planned", result.stdout), result.stdout
    if shm.use_shared_memory("auto", torch.device("cpu"), 2):  # x86, /dev/shm and 2 cores: the default's rings
        assert "; 2 link direction(s) over shared memory" in result.stdout
    rows = list(csv.DictReader(metrics.open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert all(float(r["loss"]) > 0 and float(r["samples_per_s"]) > 0 for r in rows)
    assert all(0 <= float(r[f"busy_rank{k}"]) <= 1 for r in rows for k in (0, 1))
    assert all(float(r[f"memory_mb_rank{k}"]) > 1 for r in rows for k in (0, 1))  # MB held at its nearest step


def test_pd_train_failure_is_one_line_and_exit_1(tmp_path):
    from pdtool.artifacts.profile import ModelRef

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=ModelRef("toymodels:exploding", {"after": 8}))
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "10"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("pd: error: worker rank 1 failed:") and "boom after 8 forwards" in lines[-1]


def test_pd_train_on_a_device_this_machine_lacks_is_one_line(tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "2", "--device", "cuda"])
    assert result.exit_code == 1
    assert result.stderr.strip() == ("pd: error: --device cuda, but this torch sees no CUDA GPU; use --device cpu "
                                     "(or install a CUDA build of torch 2.13.0)")


def test_pd_train_auto_device_with_too_few_gpus_warns_and_trains_on_the_cpu(tmp_path, monkeypatch):
    """The launcher's checks (`job.prepare`, which pd train runs before any worker starts): the
    warning, and a job on the CPU. Its warnings reach stderr as the next test's does, and each
    worker's own choice is `device.choose` (tests/unit/test_device.py), so no worker starts here."""
    from helpers import config_for

    from pdtool.runtime import device
    from pdtool.runtime.launcher.job import prepare

    monkeypatch.setattr(device, "visible_gpus", lambda: 1)  # a one-GPU machine, two workers
    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    said = []
    job = prepare(plan, config_for(path, steps=2, device="auto"), warn=said.append)
    assert job.on_cpu and job.config.device == "auto"
    assert any("torch sees 1 GPU(s) for 2 workers on this machine, so they train on the CPU" in line for line in said)


def test_pd_train_gives_each_cpu_worker_a_share_of_the_cores_by_default(tmp_path, monkeypatch):
    import pdtool.cli

    monkeypatch.setattr(pdtool.cli.os, "cpu_count", lambda: 2)
    _, path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1), ((2, 2), 1), ((3, 3), 1)])
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "16", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "4 workers x 1 thread(s) share 2 CPU cores" in result.stderr  # not torch's default of every core each
    if "the cost model's prediction, because:" in result.stdout:  # measured more than 1.5x off: say why
        assert "4 workers x 1 thread(s) share 2 cores (2.0x oversubscribed" in result.stdout


def test_pd_train_rdzv_endpoint_refuses_a_node_rank(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    result = CliRunner().invoke(cli, ["train", str(path), "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29999",
                                      "--node-rank", "1"])
    assert result.exit_code == 2 and "drop --node-rank and --master-port" in result.stderr


def test_pd_train_bad_plan_file_is_one_line(tmp_path):
    bad = tmp_path / "x.plan.json"
    bad.write_text("{}")
    result = CliRunner().invoke(cli, ["train", str(bad)])
    assert result.exit_code == 1 and "no 'schema' field" in result.stderr


def test_pd_train_on_digits_with_epochs_trace_checkpoints_and_resume(tmp_path):
    import json

    from pdtool.artifacts.profile import ModelRef

    ref = ModelRef("pdtool.zoo:mlp", {"in_features": 64, "hidden": 16, "depth": 1, "classes": 10})
    _, path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1)], ref=ref, batch_size=256)
    trace, ckpt = tmp_path / "t.json", tmp_path / "ckpt"
    args = ["train", str(path), "--data", "digits", "--quiet", "--checkpoint-dir", str(ckpt)]
    first = CliRunner().invoke(cli, [*args, "--epochs", "1", "--trace", str(trace), "--evaluate"],
                               catch_exceptions=False)
    assert first.exit_code == 0, first.output
    assert "trained steps 1-5 (5 minibatches)" in first.stdout  # 1437 images // 256 = 5 per epoch
    assert "held-out accuracy:" in first.stdout and "of 256 samples" in first.stdout  # whole minibatches of the 360
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"0F0", "1B4", "0U"}
    again = CliRunner().invoke(cli, [*args, "--epochs", "2", "--resume"], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert "trained steps 6-10 (5 minibatches)" in again.stdout
    assert f"pd: resuming from {ckpt / 'step-00000005'} (step 5)" in again.stderr
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000005", "step-00000010"]


def test_pd_train_evaluate_needs_a_held_out_split(tmp_path):
    _, path = plan_with(tmp_path, [((0, 3), 1)])
    for flag in (["--evaluate"], ["--eval-every", "2"]):
        result = CliRunner().invoke(cli, ["train", str(path), *flag])
        assert result.exit_code == 1 and f"{flag[0]} needs a data set with a held-out split" in result.stderr
        assert "Traceback" not in result.output


def test_pd_train_unknown_data_set_is_one_line_before_any_worker(tmp_path):
    _, path = plan_with(tmp_path, [((0, 3), 1)])
    result = CliRunner().invoke(cli, ["train", str(path), "--data", "no_such_pkg_xyz:data"])
    assert result.exit_code == 1 and "cannot import 'no_such_pkg_xyz'" in result.stderr


def test_pd_train_optimizer_mode_and_checkpoint_flags_and_the_same_run_from_a_config_file(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="pipedream")
    ckpt = tmp_path / "ckpt"
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "3", "--mode", "flush", "--group", "2",
                                      "--optimizer", "adamw", "--lr", "0.001", "--weight-decay", "0.01",
                                      "--betas", "0.8", "0.99", "--lr-schedule", "cosine", "--warmup-steps", "2",
                                      "--min-lr", "0.0001", "--clip-grad-norm", "0.5", "--metrics", str(tmp_path / "m.csv"),
                                      "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                                      "--threads", "1", "--timeout", "20", "--seed", "3", "--quiet", "--verbose"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    import pandas

    metrics = pandas.read_csv(tmp_path / "m.csv")
    assert list(metrics["lr"]) == pytest.approx([0.0005, 0.001, 0.001])  # warm-up, then the cosine from its top
    assert (metrics["grad_norm"] > 0).all()
    assert "trained steps 1-3 (6 minibatches)" in result.stdout  # flush: 2 microbatches per step
    from pdtool.artifacts.plan import Plan
    from pdtool.sim.simulate import simulate

    flush_ms = simulate(Plan.load(path), mode="flush", group=2).time_per_minibatch_ms
    assert f"predicted {flush_ms:.3f} ms" in result.stdout and "(simulated, flush)" in result.stdout  # the schedule that ran
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000001", "step-00000002", "step-00000003"]
    from pdtool.artifacts.checkpoint import load_checkpoint

    _, flagged, extra = load_checkpoint(ckpt / "step-00000003")
    assert any(key.endswith("::exp_avg") for key in extra)  # Adam's state is in the checkpoint

    # The same run from a config file (keys at the top level and in their groups' tables, a path
    # relative to the file's folder, a flag on the command line winning over the file): the same weights.
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "run.toml").write_text(
        'steps = 9\nmode = "flush"\ngroup = 2\nseed = 3\n'
        '[recipe]\noptimizer = "adamw"\nlr = 0.001\nweight_decay = 0.01\nbetas = [0.8, 0.99]\n'
        'lr-schedule = "cosine"\nwarmup-steps = 2\nmin-lr = 0.0001\nclip-grad-norm = 0.5\n'
        '[checkpoints]\ncheckpoint-dir = "ck"\ncheckpoint-every = 1\n'
        '[devices]\nthreads = 1\n[launch]\ntimeout = 20\n[outputs]\nquiet = true\nmetrics = "m.csv"\n')
    result = CliRunner().invoke(cli, ["train", str(path), "--config", str(folder / "run.toml"), "--steps", "3"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    _, configured, _ = load_checkpoint(folder / "ck" / "step-00000003")
    assert configured.keys() == flagged.keys()
    assert all(torch.equal(configured[name], flagged[name]) for name in flagged)
    import json

    from pdtool.artifacts.checkpoint import read_manifest

    recorded = json.loads((folder / "m.csv.json").read_text())  # beside the metrics, which pandas reads as is
    assert recorded["config_file"] == str(folder / "run.toml") and recorded["command"] == "pd train"
    assert recorded["options"]["lr"] == 0.001 and recorded["sources"]["lr"] == "config file"
    assert recorded["options"]["steps"] == 3 and recorded["sources"]["steps"] == "command line"
    assert recorded["options"]["betas"] == [0.8, 0.99] and recorded["sources"]["nnodes"] == "default"
    assert recorded["resolved"]["mode"] == "flush" and recorded["resolved"]["minibatches_per_step"] == 2
    assert recorded["resolved"]["threads"] == 1 and recorded["resolved"]["recipe"]["optimizer"] == "adamw"
    assert len(pandas.read_csv(folder / "m.csv")) == 3
    manifest = read_manifest(folder / "ck" / "step-00000003")
    assert manifest.meta["settings"]["options"] == recorded["options"]
    assert manifest.meta["settings"]["resolved"]["steps"] == 3


def _refused_before_any_worker(args, fragment):
    """`pd train` refuses in the launcher: one line, exit 1, within seconds, no worker started."""
    import time

    began = time.perf_counter()
    result = CliRunner().invoke(cli, ["train", *args])
    assert time.perf_counter() - began < 30
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pd: error: ") and fragment in lines[0], result.stderr
    assert "worker rank" not in lines[0]  # the launcher said it, not a worker


def test_pd_train_refuses_tied_weights_in_pipedream_in_the_launcher(tmp_path):
    from pdtool.artifacts.profile import ModelRef

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="2bw", ref=ModelRef("toymodels:tied_lm"))
    _refused_before_any_worker([str(path), "--mode", "pipedream"], "parameter emb.weight is used by stages 0 and 1")


def test_pd_train_refuses_data_that_does_not_fit_the_model_in_the_launcher(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])  # 12 input features; the digits have 64
    _refused_before_any_worker([str(path), "--data", "digits"], "the first minibatch of --data digits")


def test_pd_train_refuses_a_split_of_a_model_no_tracer_captures(tmp_path):
    import dataclasses

    from pdtool.artifacts.plan import Plan
    from pdtool.artifacts.profile import ModelRef

    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 2), 1)], ref=ModelRef("toymodels:dynamic"))
    assert plan.profile.split == "none"
    _refused_before_any_worker([str(path)], "trains as one stage only")
    one = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], layers=tuple(range(3)),
                                                                last_name=plan.stages[1].last_name, sends=()),))
    one.save(tmp_path / "one.plan.json")
    # one stage passes the launcher's checks (`job.prepare`, what refused the split above); that it
    # then trains the module whole is test_train.py's test_a_model_no_tracer_captures_trains_whole_...
    from helpers import config_for

    from pdtool.runtime.launcher.job import prepare

    prepare(Plan.load(tmp_path / "one.plan.json"), config_for(tmp_path / "one.plan.json", steps=2))


def test_pd_train_refuses_to_overwrite_checkpoints_without_resume(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    (tmp_path / "ckpt" / "step-00000003").mkdir(parents=True)
    _refused_before_any_worker([str(path), "--checkpoint-dir", str(tmp_path / "ckpt")],
                               "already holds checkpoints (newest: step 3)")


def test_a_plan_naming_a_non_factory_runs_nothing(tmp_path, monkeypatch):
    import json

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    data = json.loads(path.read_text())
    data["profile"]["model"] = {"spec": "os:system", "kwargs": {"command": "touch PWNED"}}
    path.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    _refused_before_any_worker([str(path)], "model 'os:system' is not a pdtool model factory")
    assert not (tmp_path / "PWNED").exists()


def test_a_plan_naming_an_unmarked_factory_trains_once_the_user_names_it_with_m(tmp_path, monkeypatch):
    """Consent by the command line: `pd train -m SPEC` builds the model with the user's spec
    (and the plan's kwargs); a file of the experiment folder needs no mark and is named first."""
    import json

    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    data = json.loads(path.read_text())
    experiment = tmp_path / "experiment"
    experiment.mkdir()
    (experiment / "mine.py").write_text("from pdtool.zoo import mlp\n\ndef build(**kwargs):\n    return mlp(**kwargs)\n")
    data["profile"]["model"]["spec"] = "mine:build"
    path.write_text(json.dumps(data))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.syspath_prepend(str(experiment))  # importable, as an installed package is, but not marked
    _refused_before_any_worker([str(path)], "model 'mine:build' is not a pdtool model factory")
    result = CliRunner().invoke(cli, ["train", str(path), "-m", "pdtool.zoo:mlp", "--steps", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    monkeypatch.chdir(experiment)
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "importing the plan's model factory mine:build from mine.py (experiment folder)" in result.stderr


def test_pd_train_says_which_file_of_the_current_folder_the_plan_imports(tmp_path, monkeypatch):
    import json
    import shutil
    from pathlib import Path

    _, path = plan_with(tmp_path, [((0, 3), 1)])
    shutil.copy(Path(__file__).resolve().parents[1] / "toymodels.py", tmp_path / "mylocalmodels.py")
    data = json.loads(path.read_text())
    data["profile"]["model"]["spec"] = "mylocalmodels:missing_factory"
    path.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["train", str(path)])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == ("pd: importing the plan's model factory mylocalmodels:missing_factory "
                                             "from mylocalmodels.py (experiment folder)")


def test_a_diverging_run_stops_in_one_line_and_keeps_a_finite_checkpoint(tmp_path):
    import torch

    from pdtool.artifacts.checkpoint import latest_complete, load_checkpoint
    from pdtool.artifacts.profile import ModelRef

    digits = ModelRef("pdtool.zoo:mlp", {"in_features": 64, "hidden": 16, "depth": 2, "classes": 10})
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=digits, batch_size=32)
    ckpt = tmp_path / "ckpt"
    result = CliRunner().invoke(cli, ["train", str(path), "--data", "digits", "--lr", "1000000", "--steps", "100",
                                      "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--quiet"])
    assert result.exit_code == 1
    line = result.stderr.strip().splitlines()[-1]
    assert "training diverged; lower --lr" in line and ("the loss became" in line or "is not finite" in line)
    _, tensors, _ = load_checkpoint(latest_complete(ckpt))
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


def test_pd_train_resume_with_only_an_interrupted_runs_leftovers_starts_over_and_says_so(tmp_path):
    """One way out, always: --resume sets aside what cannot be completed and starts from step 0."""
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    (tmp_path / "ckpt" / "step-00000002").mkdir(parents=True)  # incomplete: no manifest, no shards
    result = CliRunner().invoke(cli, ["train", str(path), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                                      "--steps", "3", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "set " in result.stderr and "aside as step-00000002.set-aside" in result.stderr
    assert "no complete checkpoint in" in result.stderr and "starts from step 0" in result.stderr
    assert "trained steps 1-3" in result.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-00000002.set-aside", "step-00000003"]


def test_forcing_shared_memory_where_it_cannot_work_is_said_before_any_worker_starts(tmp_path, monkeypatch):
    from helpers import config_for

    from pdtool.runtime.launcher.job import prepare

    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    said = []
    monkeypatch.setattr(shm, "available", lambda device: False)  # e.g. an ARM machine, or no /dev/shm
    prepare(plan, config_for(path, transport="shared-memory"), warn=said.append)
    assert said == ["--transport shared-memory needs CPU workers on x86 and a writable /dev/shm, which this "
                    "machine's workers lack: their messages go through the process group"]
    said.clear()
    monkeypatch.undo()
    prepare(plan, config_for(path, transport="shared-memory"), warn=said.append)
    assert said == [] or not shm.available(torch.device("cpu"))


def test_pd_train_transport_option(tmp_path):
    _, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)], mode="pipedream")
    result = CliRunner().invoke(cli, ["train", str(path), "--steps", "3", "--transport", "process-group", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "trained steps 1-3" in result.stdout and "shared memory" not in result.stdout
    bad = CliRunner().invoke(cli, ["train", str(path), "--transport", "pigeon"])
    assert bad.exit_code == 2 and "'pigeon' is not one of 'auto', 'shared-memory', 'process-group'" in bad.stderr


def test_a_mode_that_holds_more_than_the_plans_memory_is_refused_before_any_worker_starts(tmp_path):
    import dataclasses

    from helpers import config_for

    from pdtool.artifacts.plan import Plan
    from pdtool.errors import LaunchError
    from pdtool.runtime.launcher.job import prepare
    from pdtool.planner.costmodel import Memory
    from pdtool.sim.simulate import simulate

    plan, path = plan_with(tmp_path, [((0, 1), 1), ((2, 3), 1)])
    fits = max(
        Memory(limit=float("inf")).per_worker(plan, simulate(plan, "pipedream")).values()
    )  # 1F1B: what pd plan counts
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, memory=fits))
    plan.save(path)
    prepare(Plan.load(path), config_for(path))  # the plan's own mode fits exactly
    with pytest.raises(LaunchError, match=r"mode gpipe with 8 microbatches per step needs .* on each worker of "
                                          r"stage 0 \(1 weight version\(s\), 8 minibatch\(es\) in flight\), .* more "
                                          r"than the .* per worker of the plan's cluster; train with a mode"):
        prepare(Plan.load(path), config_for(path, mode="gpipe", group=8))
    result = CliRunner().invoke(cli, ["train", str(path), "--mode", "gpipe", "--group", "8"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.count("pd: error:") == 1 and "mode gpipe with 8 microbatches" in result.stderr
