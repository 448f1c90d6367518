"""Multi-machine training over a real network stack: two emulated machines (network namespaces
joined by a switch, links shaped by tc; `bench/links.py`), one `pd train --nnodes 2` launcher
in each. Skipped where namespaces cannot be made (not root)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import plan_with

from pdtool.artifacts.profile import ModelRef

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import links  # noqa: E402 - the bench helper that makes the machines

PD = str(Path(sys.executable).parent / "pd")
DIGITS = ModelRef("pdtool.zoo:mlp", {"in_features": 64, "hidden": 16, "depth": 2, "classes": 10})

pytestmark = pytest.mark.skipif(links.available() is not None, reason=f"no emulated links: {links.available()}")


def ours():
    """The namespaces this test process made and left (another process's run, a bench, may have its own)."""
    return [name for name in links._namespaces() if name.startswith(f"{links.PREFIX}-{os.getpid()}-")]


def run_on(machines, plan, extra=(), on_second=()):
    """`pd train plan` on both machines (node 0 hosts the rendezvous); [(returncode, stderr lines, stdout)]."""
    processes = []
    for rank, machine in enumerate(machines):
        argv = [PD, "train", str(plan), "--data", "digits", "--steps", "10", "--nnodes", "2", "--node-rank", str(rank),
                "--master-addr", machines[0].address, "--master-port", "29650", "--timeout", "20", *extra,
                *(on_second if rank == 1 else ())]
        processes.append(machine.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for process in processes:
        out, err = process.communicate(timeout=240)
        results.append((process.returncode, err.strip().splitlines(), out))
    return results


def test_two_machines_train_over_a_shaped_link(tmp_path):
    _, plan = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=DIGITS, batch_size=32)
    with links.machines(2, "100Mbit") as machines:
        results = run_on(machines, plan)
    assert [code for code, _, _ in results] == [0, 0], results
    for rank, (_, lines, _) in enumerate(results):  # each picked its namespace's interface, not loopback
        assert f"talks on eth0 ({links.SUBNET}.{rank + 1})" in "\n".join(lines), lines
    assert "trained steps 1-10" in results[1][2]  # the machine of the last stage reports the run
    assert not ours()


def test_a_machine_on_the_wrong_interface_fails_within_seconds_with_one_line(tmp_path):
    _, plan = plan_with(tmp_path, [((0, 1), 1), ((2, 2), 1)], ref=DIGITS, batch_size=32)
    began = time.monotonic()
    with links.machines(2, "100Mbit") as machines:
        results = run_on(machines, plan, extra=["--quiet"], on_second=["--iface", "lo"])
    assert time.monotonic() - began < 30
    for code, lines, _ in results:
        errors = [line for line in lines if line.startswith("pd: error:")]
        assert code == 1 and len(errors) == 1 and "cannot reach machine" in errors[0], lines
        assert "Traceback" not in "\n".join(lines)


def test_the_latency_probe_times_a_small_all_reduce_between_busy_machines():
    with links.machines(2, "1Gbit") as (a, b):
        idle = links.collective_latency(a, b, compute_ms=0.0, rounds=10)
        busy = links.collective_latency(a, b, compute_ms=5.0, rounds=10)
    assert 0 < idle < 0.05 and 0 < busy < 0.05  # seconds: well under the 5 ms of work between the rounds
    assert not ours()
