"""Running under a cluster's launcher (`runtime.launcher.external`): which launcher, where this process
sits, SLURM's host lists (pure: environments given as dicts)."""
import pytest

from click.testing import CliRunner

from pdtool.cli import cli
from pdtool.errors import LaunchError
from pdtool.runtime.launcher.cluster_env import Place, detect, expand_hosts, place, slurm_port, tasks_per_node

SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123457",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[01-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NUM_NODES": "2", "SLURMD_NODENAME": "gpu07"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("localhost", ["localhost"]),
    ("node[01-03,7],gpu2", ["node01", "node02", "node03", "node7", "gpu2"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("rack[1-2]n[0-1]", ["rack1n0", "rack1n1", "rack2n0", "rack2n1"]),
    ("host-1.example.org,10.0.0.5", ["host-1.example.org", "10.0.0.5"]),
    ("x[009-011]", ["x009", "x010", "x011"]),
])
def test_slurm_host_lists_expand_in_order(nodelist, hosts):
    assert expand_hosts(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "n[[1]]", "a,,b", "n[]", ","])
def test_a_malformed_host_list_is_one_line(nodelist):
    with pytest.raises(LaunchError, match="cannot read the SLURM host list .*; set MASTER_ADDR"):
        expand_hosts(nodelist)


def test_tasks_per_node_expand_slurm_repeat_counts():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(LaunchError, match="tasks per node"):
        tasks_per_node("2(x)")


@pytest.mark.parametrize("env, launcher", [
    ({}, "local"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, "torchrun"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", **SRUN}, "torchrun"),  # torchrun under srun: torchrun's ranks
    (SRUN, "slurm"),
    ({**SRUN, "SLURM_NTASKS": "1"}, "local"),  # srun -n1 pd train: pd train starts the workers
    ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}, "local"),  # the batch script itself, not srun
    ({**SRUN, "SLURM_STEP_ID": "4294967294"}, "local"),  # the batch step
])
def test_auto_detects_the_launcher_from_the_environment(env, launcher):
    assert detect("auto", env) == launcher
    assert detect("local", env) == "local"


def test_slurm_variables_place_the_process_and_its_store():
    where = place("slurm", SRUN)
    assert where == Place(launcher="slurm", rank=1, world=4, local_rank=1, local_world=2, machines=2,
                          master_addr="gpu07", master_port=slurm_port(123457))
    assert slurm_port(123457) == 10000 + 123457 % 20000
    given = place("slurm", {**SRUN, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})
    assert (given.master_addr, given.master_port) == ("10.1.2.3", 29500)
    job_list = place("slurm", {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NODELIST"})
    assert job_list.master_addr == "gpu01"


@pytest.mark.parametrize("change, says", [
    ({"SLURM_NTASKS": "four"}, "SLURM_NTASKS='four'"),
    ({"SLURM_PROCID": "4"}, "not a place in a job"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT within 1-65535"),
])
def test_bad_slurm_variables_are_one_line(change, says):
    with pytest.raises(LaunchError, match=says):
        place("slurm", {**SRUN, **change})


def test_torchrun_variables_place_the_process():
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}
    assert place("torchrun", env) == Place(launcher="torchrun", rank=3, world=4, local_rank=1, local_world=2,
                                           machines=2, master_addr="node0", master_port=29400)
    with pytest.raises(LaunchError, match="--launcher torchrun, but RANK is not set"):
        place("torchrun", {})
    with pytest.raises(LaunchError, match="--launcher slurm, but SLURM_PROCID is not set"):
        place("slurm", {})
    assert place("local", env) is None


@pytest.mark.parametrize("option", [["--nnodes", "2"], ["--master-port", "29500"], ["--rdzv-endpoint", "h:1"],
                                    ["--max-restarts", "1"], ["--transport", "shared-memory"]])  # --evaluate works: through the pipeline
def test_options_of_the_own_launcher_are_usage_errors_under_srun(option):
    result = CliRunner().invoke(cli, ["train", "never-read.plan.json", *option], env={**SRUN, "SLURM_PROCID": "0"})
    assert result.exit_code == 2 and "under slurm" in result.stderr, result.output


@pytest.mark.parametrize("change, says", [
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x9999999999)"}, "name more machines than the step's 4 task"),
    ({"SLURM_STEP_NODELIST": "node[0-999999999]"}, "names more machines than the step's 4 task"),
    ({"SLURM_STEP_NODELIST": "a[0-9][0-9][0-9]"}, "names more machines than the step's 4 task"),
])
def test_absurd_slurm_expansions_are_one_line_at_once(change, says):
    """Issue 35 item 12: `2(x9999999999)` was a MemoryError, `node[0-999999999]` 52 s of memory growth; every
    expansion is bounded by the step's task count (a machine holds at least one task)."""
    import time

    began = time.monotonic()
    with pytest.raises(LaunchError, match=says) as info:
        place("slurm", {**SRUN, **change})
    assert time.monotonic() - began < 1 and "\n" not in str(info.value)
