"""Mixed precision (`--precision fp32|bf16|fp16`): what layers compute in and messages travel in.

The weights stay fp32 (the master weights) and so do their gradients and the optimizer's state;
layers compute under `torch.autocast` in the compute dtype (on the CPU and on CUDA), and every
floating tensor that crosses between stages (activations forward, their gradients backward)
travels in it: half the bytes of fp32. `pd profile --precision` times the layers the same way
and counts their outputs in it (`Profile.precision`); `pd plan` then charges the halved
messages and the memory model counts autocast's half-size weight copies
(`planner.costmodel.COMPUTE_COPY`). fp16 also scales the loss (`runtime.worker.optim.LossScale`).
"""
from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The autocast region of `precision` on `device` (nothing for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def message_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    """The dtype a tensor of `dtype` travels in between stages: floating ones in the compute dtype."""
    return DTYPES[precision] if dtype.is_floating_point and precision != "fp32" else dtype
