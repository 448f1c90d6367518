"""Two `pd train` launchers of 2 workers each form one 4-worker job on 127.0.0.1, as two
machines would with torch.distributed's static rendezvous (--nnodes, --node-rank, --master-*)."""
import csv
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import config_for, gradient_accumulation, plan_with


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_launchers_form_one_job(tmp_path):
    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1), ((2, 2), 1), ((3, 3), 1)], mode="flush")
    pd = str(Path(sys.executable).parent / "pd")
    port = free_port()
    common = ["train", str(path), "--steps", "3", "--group", "4", "--lr", "0.05", "--seed", "0", "--quiet",
              "--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--timeout", "30"]
    metrics = tmp_path / "node1.csv"
    nodes = [subprocess.Popen([pd, *common, "--node-rank", str(rank)] + (["--metrics", str(metrics)] if rank else []),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "on 2 workers" in outputs[1][0]  # the last stage (rank 3) runs on node 1
    losses, _ = gradient_accumulation(plan, config_for(path, steps=3, group=4))
    rows = list(csv.DictReader(metrics.open()))
    assert [float(r["loss"]) for r in rows] == pytest.approx(
        [sum(losses[b] for b in range(4 * k, 4 * k + 4)) / 4 for k in range(3)], rel=1e-5)


def test_two_launchers_meet_at_a_c10d_rendezvous(tmp_path):
    """--rdzv-endpoint: no node ranks given; the rendezvous numbers the machines as they join."""
    plan, path = plan_with(tmp_path, [((0, 0), 1), ((1, 1), 1), ((2, 2), 1), ((3, 3), 1)], mode="flush")
    pd = str(Path(sys.executable).parent / "pd")
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["train", str(path), "--steps", "2", "--group", "4", "--lr", "0.05", "--seed", "0", "--quiet",
              "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", "t1", "--timeout", "30"]
    metrics = [tmp_path / f"node{k}.csv" for k in (0, 1)]
    nodes = [subprocess.Popen([pd, *common, "--metrics", str(m)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for m in metrics]
    outputs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    reporting = [k for k in (0, 1) if "on 2 workers" in outputs[k][0]]
    assert len(reporting) == 1, outputs  # one machine got ranks 2-3, with the last stage
    losses, _ = gradient_accumulation(plan, config_for(path, steps=2, group=4))
    rows = list(csv.DictReader(metrics[reporting[0]].open()))
    assert [float(r["loss"]) for r in rows] == pytest.approx(
        [sum(losses[b] for b in range(4 * k, 4 * k + 4)) / 4 for k in range(2)], rel=1e-5)
