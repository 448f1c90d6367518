"""Which device and which torch.distributed backend a worker uses.

`pd train --device` takes `auto` (the default: GPUs when torch sees one for every worker of this
machine, else the CPU), `cpu` or `cuda`. On GPUs every worker takes the GPU of its local rank (the rank among the workers of its
machine, `LOCAL_RANK`, set by the launcher) and the workers talk over NCCL; on the CPU they talk
over gloo. NCCL cannot run two ranks of one job on one GPU, so a machine needs at least as many
GPUs as it runs workers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LaunchError
from .run import DEVICES



@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str


def choose(requested: str, local_rank: int, local_workers: int, gpus: int | None = None) -> Placement:
    """The device of the worker with `local_rank` among `local_workers` on this machine.

    `gpus` is how many CUDA devices torch sees (asked of torch when None)."""
    if requested not in DEVICES:
        raise LaunchError(f"unknown device {requested!r}; use one of {', '.join(DEVICES)}")
    if gpus is None:
        gpus = visible_gpus()
    if requested == "cpu" or (requested == "auto" and gpus < local_workers):
        return Placement(torch.device("cpu"), "gloo")  # auto: the CPU unless every worker gets a GPU
    if gpus == 0:
        raise LaunchError("--device cuda, but this torch sees no CUDA GPU; use --device cpu "
                          "(or install a CUDA build of torch 2.13.0)")
    if local_workers > gpus:
        raise LaunchError(f"{local_workers} workers on this machine but torch sees {gpus} GPU(s), and NCCL needs "
                          f"one GPU per worker; run --nproc-per-node {gpus} per machine or --device cpu")
    return Placement(torch.device("cuda", local_rank), "nccl")


def visible_gpus() -> int:
    """How many CUDA devices this torch sees (0 on a CPU build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def synchronizer(device: torch.device):
    """A function that waits for the compute work queued on the device (a no-op on the CPU), so
    that wall-clock times taken after it cover the work they are meant to. Only the current
    stream: NCCL's streams hold receives posted ahead of need, and waiting for those would stall
    every action until its successor's input arrived (a deadlock in gpipe and flush)."""
    if device.type == "cuda":
        return lambda: torch.cuda.current_stream(device).synchronize()
    return lambda: None
