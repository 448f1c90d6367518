"""What a worker measures of its own memory, by the terms of the planner's memory model
(`planner.costmodel.Memory.terms`): the peak from the operating system (CPU: the process's peak
resident set; CUDA: the most memory torch allocated on the device) beyond what the process held
when it started, and of it the bytes of the stage's weights and their stashed versions, its
gradients and its optimizer state, counted exactly; the rest is activations and the runtime's
own buffers (messages, shared-memory rings, the allocator's cache)."""
from __future__ import annotations

import os
import resource

import torch

TERMS = ("weights", "gradients", "optimizer", "activations")


def resident_bytes() -> int:
    """This process's resident set now (/proc/self/statm; 0 where /proc lacks it)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
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
    """What the process holds before its stage is built: the baseline its peak is measured from."""
    return in_use(device)


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


def measure(worker, device: torch.device, base: int, startup: int = 0) -> dict[str, int]:
    """`base`, `peak` (the whole process's), `training` (the peak since `training_starts`, which
    returned `startup`, start-up's peak) and training's peak beyond `base` by term (`TERMS`), for a
    `StageWorker` whose run is done: its weights and the most versions it stashed, one gradient per
    parameter (as every backward has), its optimizer's state tensors; `activations` is what
    remains of the peak."""
    if device.type == "cuda":
        training = torch.cuda.max_memory_allocated(device)
    else:
        training = peak_resident_bytes()
    params = sum(p.numel() * p.element_size() for p in worker.live)
    state = worker.optimizer.state.values() if worker.optimizer is not None else ()
    optimizer = sum(t.numel() * t.element_size() for entry in state for t in entry.values() if torch.is_tensor(t))
    exact = {"weights": params * (1 + worker.peak_versions), "gradients": params, "optimizer": optimizer}
    rest = max(training - base - sum(exact.values()), 0)
    return {"base": base, "peak": max(training, startup), "training": training, **exact, "activations": rest}
