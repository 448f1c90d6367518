"""The joint search of pd plan (`planner.search`): modes, chunks per worker and the group together."""
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.plan import Plan
from pdtool.artifacts.profile import Profile
from pdtool.cli import cli
from pdtool.errors import ArtifactError, PlanError
from pdtool.planner import make_plan
from pdtool.planner.chunks import make_chunked_plan
from pdtool.planner.search import Family, families, search, table
from pdtool.schedule.modes import synchronous_modes
from pdtool.sim.steady import steady_state

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from plan_speed import transformer  # noqa: E402


def shipped(name: str) -> Profile:
    return Profile.load(ROOT / "profiles" / f"{name}.profile.json")


def test_auto_is_every_synchronous_mode_at_the_chunks_each_places():
    assert synchronous_modes() == ("flush", "gpipe", "zb", "zb2", "interleaved", "zbv", "dualpipev")
    assert [f.label for f in families(synchronous_modes(), None)] == [
        "flush", "gpipe", "zb", "zb2", "interleaved v=2", "interleaved v=4", "zbv v=2", "dualpipev v=2"]
    assert families(("flush", "interleaved", "zbv"), 2) == [Family("interleaved", 2), Family("zbv", 2)]
    assert families(("interleaved", "zbv"), 3) == [Family("interleaved", 3)]
    assert families(("flush", "pipedream"), 1) == [Family("flush", 1), Family("pipedream", 1)]
    with pytest.raises(PlanError, match="none of the modes zbv or dualpipev runs 4 stages on a worker"):
        families(("zbv", "dualpipev"), 4)


def _alone(profile, cluster, family, group):
    """A family planned by itself, as pd plan --mode M [--virtual-stages V] --group m plans it."""
    if family.chunks == 1:
        return make_plan(profile, cluster, mode=family.mode, group=group)
    return make_chunked_plan(profile, cluster, chunks=family.chunks, mode=family.mode, group=group)


@pytest.mark.slow  # every family planned twice, on 8-16 workers: 1-6 s a case
@pytest.mark.parametrize("name, spec", [("gpt", "8x1GB/s"), ("gpt", "16x10GB/s"), ("resnet50", "8x10Gbit/s"),
                                        ("resnet50", "8x25GB/s,2x10Gbit/s")])
def test_the_pick_is_no_slower_than_any_family_planned_alone(name, spec):
    profile, cluster = shipped(name), parse_cluster(spec)
    plan, outcomes = search(profile, cluster, modes=synchronous_modes(), virtual=None, group=None)
    group = plan.group
    assert group == max(f.chunks for f in families(synchronous_modes(), None)
                        if f.chunks * cluster.workers <= len(profile.layers) or f.chunks == 1) * cluster.workers
    for outcome in outcomes:
        try:
            alone = _alone(profile, cluster, outcome.family, group)
        except PlanError:
            assert outcome.plan is None
            continue
        # the search predicts by the steady state, a family alone by the event simulation: equal within 2%
        assert plan.predicted.expected_ms <= alone.predicted.expected_ms * 1.02, outcome.family
        assert outcome.plan.predicted.expected_ms == pytest.approx(alone.predicted.expected_ms, rel=0.02)


def test_it_picks_several_chunks_a_worker_where_they_are_faster():
    """Transformer blocks on 8 workers at 10 GB/s: ZB-V's two chunks beat every plan of one stage a
    worker (ZB-H2 included) at the same group; at 1 GB/s the transfers of twice the stages do not pay."""
    profile = transformer(32)
    plan, outcomes = search(profile, parse_cluster("8x10GB/s"), modes=synchronous_modes(), virtual=None, group=None)
    assert plan.placement and plan.mode == "zbv" and plan.group == 32
    one_stage = [o.plan.predicted.expected_ms for o in outcomes if o.family.chunks == 1]
    assert plan.predicted.expected_ms < min(one_stage)
    slow, _ = search(profile, parse_cluster("8x1GB/s"), modes=synchronous_modes(), virtual=None, group=None)
    assert not slow.placement


def test_the_plan_records_the_group_and_is_simulated_with_it(tmp_path):
    profile, cluster = shipped("gpt-small"), parse_cluster("4x10GB/s")
    plan = make_plan(profile, cluster, mode="flush", straight=True, group=12)
    assert plan.group == 12 and plan.run().group == 12 and plan.run("gpipe").group == 12
    assert plan.run("pipedream").group == 1 and plan.run(group=8).group == 8
    assert plan.predicted.expected_ms == pytest.approx(
        make_plan(profile, cluster, mode="flush", straight=True, group=12, quick=True).predicted.expected_ms, rel=0.02)
    bigger = make_plan(profile, cluster, mode="flush", straight=True, group=48)
    assert bigger.predicted.expected_ms < plan.predicted.expected_ms  # a smaller bubble share
    path = tmp_path / "p.json"
    plan.save(str(path))
    assert json.loads(path.read_text())["group"] == 12 and Plan.load(str(path)).group == 12
    assert "group" not in make_plan(profile, cluster, mode="flush").to_json()  # today's plans: absent


@pytest.mark.parametrize("mode, group, message", [
    ("flush", 0, "group: must be >= 1, found 0"),
    ("pipedream", 4, "mode 'pipedream' steps per round of its replicas, not per group"),
    ("interleaved", 6, "so the group must be a multiple of 4"),
])
def test_a_group_the_mode_cannot_run_is_refused_when_the_plan_is_read(tmp_path, mode, group, message):
    profile, cluster = shipped("gpt-small"), parse_cluster("4x10GB/s")
    plan = (make_chunked_plan(profile, cluster, chunks=2, mode=mode) if mode == "interleaved"
            else make_plan(profile, cluster, mode=mode))
    data = plan.to_json()
    data["group"] = group
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=message):
        Plan.load(str(path))


def test_pd_train_runs_the_plans_group_by_default():
    from pdtool.runtime.run import RunConfig, resolved

    plan = make_plan(shipped("gpt-small"), parse_cluster("4x10GB/s"), mode="flush", straight=True, group=12)
    assert resolved(plan, RunConfig(plan_path="p.json", steps=1)).group == 12
    assert resolved(plan, RunConfig(plan_path="p.json", steps=1, group=4)).group == 4
    assert resolved(plan, RunConfig(plan_path="p.json", steps=1, mode="pipedream")).group == 1


def _pd_plan(tmp_path, *args):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(cli, ["plan", str(ROOT / "profiles" / "gpt-small.profile.json"), "-c", "4x10GB/s",
                                      *args, "-o", str(out)])
    return result, out


def test_pd_plan_prints_every_familys_best_beside_the_pick(tmp_path):
    result, out = _pd_plan(tmp_path, "--mode", "flush,zbv,pipedream", "--batch", "64")
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("family"))
    rows = {line.split()[0] + (" " + line.split()[1] if "v=" in line else ""): line for line in lines[header + 1:header + 4]}
    assert set(rows) == {"flush", "zbv v=2", "pipedream"}
    plan = Plan.load(str(out))
    assert plan.group == 8 and "the pick" in rows[plan.mode if plan.mode != "zbv" else "zbv v=2"]
    assert rows["pipedream"].split()[2] == "-"  # no group: it steps per round
    assert f"the fastest of 3 schedule families at 8 microbatches per step ({plan.mode}" in plan.predicted.why


@pytest.mark.parametrize("args, message", [
    (["--mode", "flush", "--batch", "60"], "--batch 60 is not a multiple of the profile's batch 8"),
    (["--mode", "flush", "--batch", "64", "--group", "4"], "--group 4 and --batch 64 disagree"),
    (["--mode", "flush,nosuch"], "'nosuch' is not a mode"),
    (["--group", "4"], "--group 4: mode pipedream steps after every round of its replicas"),
    (["--mode", "zbv,dualpipev", "--virtual-stages", "4"], "none of the modes zbv or dualpipev runs 4 stages"),
    (["--mode", "auto", "--data-parallel"], "--data-parallel plans one mode without cuts"),
    (["--mode", "interleaved", "--virtual-stages", "2", "--group", "6"], "the group must be a multiple of 4"),
])
def test_what_the_search_cannot_do_is_one_line_and_no_file(tmp_path, args, message):
    result, out = _pd_plan(tmp_path, *args)
    assert result.exit_code != 0 and message in result.stderr and not out.exists()
    assert "Traceback" not in result.stderr


def test_the_families_table_says_why_a_family_has_no_plan():
    profile = transformer(12)
    plan, outcomes = search(profile, parse_cluster("4x10GB/s"), modes=("flush", "interleaved"), virtual=None,
                            group=None)
    lines = table(outcomes, plan)
    assert plan.group == 8  # interleaved v=4 cannot be cut (16 stages of 12 layers): v=2's default
    assert any(line.startswith("interleaved v=4") and "no plan: the model cannot be cut into 16 stages" in line
               for line in lines)
    assert steady_state(plan).time_per_minibatch_ms == pytest.approx(plan.predicted.expected_ms, rel=1e-6)


def test_chunks_that_do_not_fit_recompute_under_recompute_auto():
    """gpt-small, interleaved on 4x10GB/s, 2 chunks a worker: the busiest worker needs about 193 MiB
    keeping its activations and 140 MiB recomputing them."""
    profile = shipped("gpt-small")
    fits = make_chunked_plan(profile, parse_cluster("4x10GB/s", memory="170MiB"), chunks=2, mode="interleaved")
    assert all(stage.recompute for stage in fits.stages)
    with pytest.raises(PlanError, match=r"worker \d needs .* for its chunks in mode interleaved, more than the 170"):
        make_chunked_plan(profile, parse_cluster("4x10GB/s", memory="170MiB"), chunks=2, mode="interleaved",
                          recompute="none")
    with pytest.raises(PlanError, match=r"\(even with every chunk recomputing its activations\)$"):
        make_chunked_plan(profile, parse_cluster("4x10GB/s", memory="120MiB"), chunks=2, mode="interleaved")
    roomy = make_chunked_plan(profile, parse_cluster("4x10GB/s", memory="1GiB"), chunks=2, mode="interleaved")
    assert not any(stage.recompute for stage in roomy.stages)


def test_chunks_are_planned_where_data_parallelism_does_not_fit():
    """The baseline does not rule a family out: GPT (619 MiB of weights) on 8 workers of 2 GiB, where
    one stage on every worker is over the limit, still gets its ZB-V plan, which says by how much."""
    plan = make_chunked_plan(shipped("gpt"), parse_cluster("8x10GB/s", memory="2GiB"), chunks=2, mode="zbv")
    assert len(plan.stages) == 16 and plan.predicted.data_parallel_over_bytes > 0


def test_a_search_whose_families_the_layers_cannot_fill_says_why_in_one_line():
    """A 7-layer model on 4 workers: zbv needs 8 stages (was a ValueError from max() of nothing)."""
    from pdtool.planner.search import Family, common_group

    assert common_group([Family("zbv", 2)], 4, 7) == 8
