"""Which device and backend a worker takes (runtime.device), for machines with and without GPUs."""
import pytest
import torch

from pdtool.errors import LaunchError
from pdtool.runtime.device import choose


@pytest.mark.parametrize("requested, gpus", [("cpu", 0), ("cpu", 4), ("auto", 0), ("auto", 1)])
def test_cpu_workers_use_gloo(requested, gpus):
    placement = choose(requested, local_rank=1, local_workers=2, gpus=gpus)
    assert (placement.device, placement.backend) == (torch.device("cpu"), "gloo")


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_gpu_workers_take_the_gpu_of_their_local_rank_and_nccl(requested):
    placements = [choose(requested, local_rank=r, local_workers=4, gpus=4) for r in range(4)]
    assert [p.device for p in placements] == [torch.device("cuda", r) for r in range(4)]
    assert {p.backend for p in placements} == {"nccl"}


def test_cuda_without_gpus_is_one_clear_error():
    with pytest.raises(LaunchError, match=r"^--device cuda, but this torch sees no CUDA GPU; use --device cpu"):
        choose("cuda", local_rank=0, local_workers=2, gpus=0)


def test_more_workers_than_gpus_is_refused_for_cuda_and_the_cpu_for_auto():
    with pytest.raises(LaunchError, match=r"^4 workers on this machine but torch sees 2 GPU\(s\), and NCCL needs one "
                                          r"GPU per worker; run --nproc-per-node 2 per machine or --device cpu$"):
        choose("cuda", local_rank=0, local_workers=4, gpus=2)
    assert choose("auto", local_rank=0, local_workers=4, gpus=2).backend == "gloo"


def test_this_machine_without_gpus():
    expected = "gloo" if not torch.cuda.is_available() else "nccl"
    assert choose("auto", 0, 1).backend == expected
