"""torch.distributed.pipelining's schedule CSV both ways (issue 39 item 2): `pd simulate --write-schedule`
writes a plan's step, `pd simulate --schedule` reads one (pdtool's or dumped by torch's own schedules),
checks it with pdtool's validator and times it on the plan."""
import csv
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from pdtool.artifacts.cluster import parse_cluster
from pdtool.artifacts.profile import Profile
from pdtool.cli import cli
from pdtool.errors import ScheduleError
from pdtool.planner import make_plan
from pdtool.planner.chunks import make_chunked_plan
from pdtool.schedule import generate, validate
from pdtool.schedule.torch_csv import read_csv, schedule_of, to_csv
from pdtool.sim.simulate import simulate, simulate_schedule

ROOT = Path(__file__).resolve().parents[2]
GPT = Profile.load(str(ROOT / "profiles" / "gpt-small.profile.json"))


def _plan(mode):
    if mode in ("interleaved", "zbv", "dualpipev"):
        return make_chunked_plan(GPT, parse_cluster("2x10GB/s"), chunks=2, mode=mode, group=4)
    return make_plan(GPT, parse_cluster("4x10GB/s"), straight=True, mode=mode, every_worker=True)


@pytest.mark.parametrize("mode", ["flush", "gpipe", "zb", "zb2", "interleaved", "zbv", "dualpipev"])
def test_a_written_step_reads_back_as_the_same_schedule_and_simulates_exactly_as_it(mode):
    plan = _plan(mode)
    group = 4
    own = generate(mode, tuple(1 for _ in plan.stages), group, group, placement=plan.placement)
    text = to_csv(own)
    assert len(text.splitlines()) == len(own.workers) and "U" not in text
    back = schedule_of(read_csv(text), mode, own.replicas, plan.placement)
    validate(back)
    assert [sorted(map(str, w)) for w in back.workers] == [sorted(map(str, w)) for w in own.workers]
    assert [[str(a) for a in w if a.kind != "U"] for w in back.workers] == \
        [[str(a) for a in w if a.kind != "U"] for w in own.workers]
    assert simulate_schedule(plan, back).makespan_ms == simulate(plan, minibatches=group, group=group).makespan_ms


def _torchs_csv(schedule_class, workers, group):
    """What torch's schedule of `schedule_class` dumps (`_dump_csv`: a row of `_Action`s and idle
    slots per rank), made from its own order without building stages."""
    shell = SimpleNamespace(pp_group_size=workers, _n_microbatches=group, num_stages=2 * workers, n_local_stages=2,
                            microbatches_per_round=workers)
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in range(workers):
        writer.writerow(schedule_class._calculate_single_rank_operations(shell, rank))
    return out.getvalue()


@pytest.mark.parametrize("mode, torch_class", [("interleaved", "ScheduleInterleaved1F1B"),
                                               ("zbv", "ScheduleZBVZeroBubble")])
def test_torchs_own_schedules_are_checked_and_timed(tmp_path, mode, torch_class):
    from torch.distributed.pipelining import schedules

    text = _torchs_csv(getattr(schedules, torch_class), 2, 4)
    assert ",," in text or "\n," in text  # torch's idle slots are empty cells
    path = tmp_path / "torch.csv"
    path.write_text(text)
    plan_path = tmp_path / "p.json"
    _plan(mode).save(plan_path)
    result = CliRunner().invoke(cli, ["simulate", str(plan_path), "--schedule", str(path)])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("schedule"))
    assert f"4 microbatches, checked in mode {mode}" in line
    if mode == "zbv":  # pdtool's ZB-V is torch's order: the same time
        assert "(1.000x)" in line


def _pd_simulate(tmp_path, text, mode="flush", *args):
    plan_path = tmp_path / "p.json"
    make_plan(GPT, parse_cluster("2x10GB/s"), straight=True, mode=mode, every_worker=True).save(plan_path)
    path = tmp_path / "s.csv"
    path.write_text(text)
    return CliRunner().invoke(cli, ["simulate", str(plan_path), "--schedule", str(path), *args])


@pytest.mark.parametrize("text, message", [
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", "is not a schedule pdtool can run"),            # 0B1 missing
    ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "is not a schedule pdtool can run"),        # a deadlock
    ("0F0,0B0\n1F0,1B0\n2F0,2B0\n", "has 3 rows (ranks), the plan 2 workers"),          # a rank too many
    ("0F0,0X0\n1F0,1B0\n", "'0X0' is not an action"),                                  # an unknown kind
    ("0UNSHARD,0F0,0B0\n1F0,1B0\n", "0UNSHARD shards parameters"),                     # FSDP's actions
    ("1F0,1B0\n0F0,0B0\n", "rank 0 runs 1F0, but the plan places stage 1 on worker 1"),
    ("", "is empty"),
])
def test_a_schedule_pdtool_cannot_run_is_one_line(tmp_path, text, message):
    result = _pd_simulate(tmp_path, text)
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_messages_and_overlaps_map_onto_the_plans_own_actions(tmp_path):
    text = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n1RECV_F0,1F0,1B0,1SEND_B0,(1F1;1B1)OVERLAP_F_B\n"
    rows = read_csv(text)
    assert rows[1] == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)]
    result = _pd_simulate(tmp_path, text)
    assert result.exit_code == 0 and "checked in mode flush" in result.output, result.output
    with pytest.raises(ScheduleError, match="write 1I0 for its input gradients"):
        schedule_of(read_csv("0F0,0I0,0W0\n1F0,1B0,1W0\n"), "zb", (1, 1), ())


def test_write_schedule_refuses_what_torchs_schedules_cannot_hold(tmp_path):
    runner = CliRunner()
    path = tmp_path / "p.json"
    make_plan(GPT, parse_cluster("4x10GB/s"), data_parallel=True).save(path)
    result = runner.invoke(cli, ["simulate", str(path), "--write-schedule", str(tmp_path / "s.csv")])
    assert result.exit_code != 0 and "replicas, which torch.distributed.pipelining" in result.output
    make_plan(GPT, parse_cluster("2x10GB/s"), straight=True, every_worker=True).save(path)  # pipedream
    result = runner.invoke(cli, ["simulate", str(path), "--write-schedule", str(tmp_path / "s.csv")])
    assert result.exit_code != 0 and "mode pipedream steps each stage after its own minibatches" in result.output
    result = runner.invoke(cli, ["simulate", str(path), "--mode", "zb", "--group", "4", "--write-schedule",
                                 str(tmp_path / "s.csv")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "s.csv").read_text().splitlines()[0].startswith("0F0,0F1")


def test_blank_lines_at_the_end_are_no_ranks_and_every_modes_reason_is_given(tmp_path):
    assert len(read_csv("0F0,0B0\n1F0,1B0\n\n\n")) == 2
    result = _pd_simulate(tmp_path, "0F0,0F1,0F2,0B0,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n")
    assert result.exit_code == 0 and "checked in mode" in result.output, result.output
    result = _pd_simulate(tmp_path, "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    assert "in mode flush: deadlock" in result.output and "in mode gpipe: deadlock" in result.output
