"""`pd simulate PLAN.json`: the summary, the trace, and one-line errors."""
import json
import re

import pytest
from click.testing import CliRunner

from pdtool.cli import cli
from pdtool.artifacts.profile import Layer, Profile
from test_cli import assert_one_line_error


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def chain_profile(layers: int) -> Profile:
    """A chain of `layers` equal layers (10 ms each, 400 MB of parameters, 1 kB out), batch 32."""
    return Profile(model=None, batch_size=32, inputs=(), device="cpu", torch_version="", fingerprint="f" * 64,
                   method="pipedream", granularity="module", depth=None, repeats=1, step_ms=0.0, step_ms_spread=0.0,
                   layers=tuple(Layer(id=i, name=f"l{i}", kind="Linear", fwd_ms=10 / 3, bwd_ms=20 / 3, act_bytes=1000,
                                      param_bytes=400_000_000) for i in range(layers)),
                   edges=tuple((i, i + 1) for i in range(layers - 1)))


@pytest.fixture
def files(tmp_path):
    """A profile of a compute-bound 8-layer chain and its plan: 4 straight stages on 4x1GB/s."""
    profile = tmp_path / "chain.profile.json"
    chain_profile(8).save(profile)
    plan = tmp_path / "chain.plan.json"
    result = invoke("plan", str(profile), "-c", "4x1GB/s", "-o", str(plan))
    assert result.exit_code == 0, result.output
    return profile, plan


def test_simulate_prints_a_summary_beside_the_cost_model(files):
    _, plan = files
    result = invoke("simulate", str(plan))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "mode pipedream, 64 minibatches, 4 workers in 4 stages" in out
    predicted = re.search(r"predicted +([\d.]+) ms per minibatch \(([\d.]+) samples/s\) in steady state", out)
    assert float(predicted[1]) == pytest.approx(20.0, abs=0.01)  # 2 layers of 10 ms per stage; the 1 kB messages add ~0
    assert float(predicted[2]) == pytest.approx(1600.0, abs=1)
    assert "cost model   20.000 ms per minibatch" in out and "bubble fraction" in out
    header = next(line for line in out.splitlines() if "busy %" in line)
    assert header.split() == ["rank", "stage", "replica", "busy", "%", "peak", "versions", "peak", "in-flight",
                              "peak", "act", "MB"]
    rows = [line.split() for line in out.splitlines()[out.splitlines().index(header) + 1:]]
    assert [(r[0], r[1], r[5]) for r in rows] == [("0", "0", "4"), ("1", "1", "3"), ("2", "2", "2"), ("3", "3", "1")]
    assert result.stderr == ""


def test_simulate_writes_a_trace_and_says_where(files, tmp_path):
    _, plan = files
    out = tmp_path / "t.json"
    result = invoke("simulate", str(plan), "--mode", "flush", "--minibatches", "8", "--trace", str(out))
    assert result.exit_code == 0, result.output
    assert "mode flush, 8 minibatches, 4 microbatches per step" in result.stdout
    assert f"wrote {out}: " in result.stderr and "perfetto" in result.stderr
    trace = json.loads(out.read_text())
    threads = sorted(e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 0)
    assert threads == [f"rank {r}: stage {r} replica 0" for r in range(4)]
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"0F0", "3B7", "0U"} <= names
    assert trace["otherData"]["mode"] == "flush" and trace["otherData"]["minibatches"] == 8


def test_trace_to_stdout_moves_the_summary_to_stderr(files):
    _, plan = files
    result = invoke("simulate", str(plan), "-n", "4", "--trace", "-")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["otherData"]["minibatches"] == 4
    assert "predicted" in result.stderr


@pytest.mark.parametrize("args, code, fragment", [
    (["--mode", "nope"], 2, None),
    (["--minibatches", "0"], 2, None),
    (["--group", "2"], 1, "group=2 does not apply to mode 'pipedream'"),
    (["--mode", "flush", "-n", "6"], 1, "not a multiple of group=4"),
])
def test_bad_options_fail_and_write_no_trace(files, tmp_path, args, code, fragment):
    _, plan = files
    out = tmp_path / "t.json"
    result = invoke("simulate", str(plan), *args, "--trace", str(out))
    if code == 1:
        assert_one_line_error(result, fragment)
    else:
        assert result.exit_code == 2 and "Traceback" not in result.output
    assert not out.exists()


def test_bad_files_are_one_line(files, tmp_path):
    profile, _ = files
    out = tmp_path / "t.json"
    assert_one_line_error(invoke("simulate", str(tmp_path / "missing.json"), "--trace", str(out)), "no such file")
    assert_one_line_error(invoke("simulate", str(profile), "--trace", str(out)),
                          "is a profile (pdtool.profile/1), not a plan; make a plan from it first: pd plan")
    other = tmp_path / "other.json"
    other.write_text('{"schema": "pdtool.cluster/1"}')
    assert_one_line_error(invoke("simulate", str(other)), "this is a cluster description (pdtool.cluster/1), not a plan")
    assert not out.exists()
    assert_one_line_error(invoke("simulate", str(profile), "--trace", str(tmp_path / "no" / "t.json")),
                          "does not exist")


def test_help_lists_simulate():
    assert "simulate" in invoke("--help").stdout
    assert "--trace" in invoke("simulate", "--help").stdout


def test_quiet_simulate_says_nothing_on_stderr(files, tmp_path):
    _, plan = files
    result = invoke("simulate", str(plan), "--trace", str(tmp_path / "t.json"), "-q")
    assert result.exit_code == 0 and result.stderr == "" and "predicted" in result.stdout


def test_the_cost_model_line_gives_the_cost_models_own_rate(files, tmp_path):
    """The plan's samples/s is the simulated rate; the cost-model line must use the cost model's time."""
    _, plan = files
    data = json.loads(plan.read_text())
    data["predicted"]["time_per_minibatch_ms"] = 40.0  # the cost model's figure, now unlike the simulator's
    edited = tmp_path / "edited.plan.json"
    edited.write_text(json.dumps(data))
    out = invoke("simulate", str(edited)).stdout
    line = re.search(r"cost model +([\d.]+) ms per minibatch \(([\d.]+) samples/s\)", out)
    assert float(line[1]) == 40.0 and float(line[2]) == pytest.approx(data["profile"]["batch_size"] / 40.0 * 1e3, abs=0.1)


def test_zero_bubble_mode_idles_less_than_flush(files):
    """`--mode zb` (ZB-H1) on the 4-stage chain: same work, the weight gradients fill the drain;
    `zb2` (ZB-H2) fills the start of a batch too, given a batch long enough for its warm-up."""
    _, plan = files
    bubbles = {}
    for mode in ("flush", "zb", "zb2"):
        result = invoke("simulate", str(plan), "--mode", mode, "--group", "8")
        assert result.exit_code == 0, result.output
        assert f"mode {mode}, " in result.stdout
        bubbles[mode] = float(re.search(r"bubble fraction ([\d.]+)", result.stdout)[1])
    assert bubbles["zb2"] < bubbles["zb"] < bubbles["flush"]


def test_simulate_says_and_charges_the_host_cost_of_messages(tmp_path):
    import dataclasses

    profile = tmp_path / "copies.profile.json"
    chain = chain_profile(2)
    chain = dataclasses.replace(chain, layers=tuple(dataclasses.replace(l, act_bytes=4 * 2 ** 20) for l in chain.layers),
                                message_ms_per_mib=0.5)
    chain.save(profile)
    plan = tmp_path / "copies.plan.json"
    assert invoke("plan", str(profile), "-c", "2x100GB/s", "--straight", "-o", str(plan)).exit_code == 0
    out = invoke("simulate", str(plan)).stdout
    assert "a message costs each end 0.5 ms of CPU per MiB (the profile's)" in out
    predicted = float(re.search(r"predicted +([\d.]+) ms per minibatch", out)[1])
    assert predicted == pytest.approx(10.0 + 2 * 4 * 0.5, abs=0.05)  # a stage: 10 ms, a 4 MiB send and a 4 MiB read
