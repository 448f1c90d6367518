"""The job's store (`runtime.peers`): a worker joins its own job's store, never another's."""
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pdtool.errors import LaunchError
from pdtool.runtime import peers


def test_a_rank_that_reaches_another_jobs_store_says_so_at_once(monkeypatch):
    """Issue 35 item 11: two jobs given one MASTER_PORT (SLURM variables by hand): the second job's rank 1
    reached the first job's store and waited silently; its rank 0's bind failure said 'within 600 s'."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    first = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    first.set(peers.JOB_KEY, "slurm-7.0")  # the first job's rank 0 hosts its store there
    for name in ("TORCHELASTIC_RUN_ID", "PDTOOL_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    started = time.monotonic()
    with pytest.raises(LaunchError, match=rf"rank 1 reached the store of another job at 127.0.0.1:{port} "
                                          r"\(slurm-7.0; this one is slurm-8.-\).*own MASTER_PORT"):
        peers.join(1, 2, 20)
    with pytest.raises(LaunchError, match=f"rank 0 cannot host the job's store at 127.0.0.1:{port}: the port is in use"):
        peers.join(0, 2, 20)
    assert time.monotonic() - started < 5
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    peers.join(1, 2, 20)  # its own job's store
    assert peers.job_id({}) is None and peers.job_id({"TORCHELASTIC_RUN_ID": "r1"}) == "torchrun-r1"
