"""What a worker measures of its own memory, by the terms of the planner's memory model
(`planner.costmodel.Memory.terms`): the peak from the operating system (CPU: the process's peak
resident set less its file pages; CUDA: the most memory torch allocated on the device) beyond what
the process held when it started, and of it the bytes of the stage's weights and their stashed
versions, its gradients and its optimizer state, counted exactly; the rest is activations,
autograd's and the optimizer's temporaries and the runtime's own buffers (messages,
shared-memory rings, the allocator's cache).

File pages (`RssFile`: the code of torch's libraries as a worker first runs each kernel, 25-27 MiB
a worker on bench/recompute.py, and files it maps, such as --init-from's safetensors) are left out
of the figures the plan is compared with and reported as `files`: they belong to no stage, the
page cache shares them between the workers of a machine, and the kernel drops them under pressure.
The kernel keeps no peak of the other pages alone, so the peak is VmHWM less the file pages at the
end (they only grow while nothing presses on memory): at most what the file pages added during
training under the true figure."""
from __future__ import annotations

import os
import resource

import torch

from .parameter_shard import local

TERMS = ("weights", "gradients", "optimizer", "activations")


def resident_bytes() -> int:
    """This process's resident set now (/proc/self/statm; 0 where /proc lacks it)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def file_bytes() -> int:
    """This process's resident file pages now (RssFile of /proc/self/status, Linux 4.5 and later;
    0 where it lacks them): mapped libraries and files."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def peak_resident_bytes() -> int:
    """This process's peak resident set (VmHWM of /proc/self/status: since the process started or
    was forked; `ru_maxrss` instead keeps the peak of the process that exec'd it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def in_use(device: torch.device) -> int:
    """Bytes the process holds now: on CUDA what torch has allocated on the device, else its
    resident set."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else resident_bytes()


def start(device: torch.device) -> int:
    """What the process holds before its stage is built, less its file pages: the baseline its
    peak is measured from."""
    return in_use(device) - (file_bytes() if device.type != "cuda" else 0)


def training_starts(device: torch.device) -> int:
    """The peak so far (start-up's: building the stage, joining the group), and the peak counter
    reset, so that `measure` sees the peak of training alone (CPU: writing 5 to
    /proc/self/clear_refs resets VmHWM, Linux 4.0 and later; where it cannot, the peak stays the
    whole process's)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    peak = peak_resident_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
    return peak


def measure(workers, device: torch.device, base: int, startup: int = 0) -> dict[str, int]:
    """`base`, `peak` (the whole process's, file pages included), `training` (the peak since
    `training_starts`, which returned `startup`, start-up's peak; less the file pages, as `base`),
    `files` (the file pages at the end) and training's peak beyond `base` by term (`TERMS`), for a
    `StageWorker` whose run is done: its weights and the most versions it stashed, one gradient per
    parameter (as every backward has) and, on a replicated stage, the flat buffer its replicas
    all-reduce in (with sharded gradients: the slice it keeps and its bucket buffer instead), its
    optimizer's state tensors; `activations` is what
    remains of the peak. `workers`: one StageWorker, or the list of a worker of several stages."""
    workers = workers if isinstance(workers, (list, tuple)) else [workers]
    files = 0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        files, peak = file_bytes(), peak_resident_bytes()
    training = peak - files
    exact = {"weights": 0, "gradients": 0, "optimizer": 0}
    for worker in workers:
        params = sum(_nbytes(p) for p in worker.live)  # sharded parameters: this replica's shards
        state = worker.stepper.optimizer.state.values() if worker.stepper.optimizer is not None else ()
        exact["optimizer"] += sum(_nbytes(t) for entry in state for t in entry.values() if torch.is_tensor(t))
        exact["weights"] += params * (1 + worker.peak_versions)
        reducer = getattr(worker.stepper, "reducer", None)  # --shard gradients: its slice and bucket buffer, not a whole gradient
        flat = getattr(worker.stepper, "_flat", None)  # replicas unsharded: the buffer they all-reduce in, kept
        exact["gradients"] += (params + (_nbytes(flat) if flat is not None else 0)
                               if reducer is None else reducer.nbytes)
    rest = max(training - base - sum(exact.values()), 0)
    return {"base": base, "peak": max(peak, startup), "training": training, **exact, "activations": rest,
            "files": files}


def _nbytes(t: torch.Tensor) -> int:
    """The bytes `t` holds in this process (of a sharded parameter or state, this replica's part)."""
    t = local(t)
    return t.numel() * t.element_size()
