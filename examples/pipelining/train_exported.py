"""Train with torch.distributed.pipelining from a plan pdtool exported (`pd export-plan --to pipelining`).

    pd profile -m pdtool.zoo:llama -a layers=4 -a dim=64 -a hidden=128 -a heads=4 -a kv_heads=2 \
        -a vocab=256 -a seq_len=32 -b 4 --depth 2 -o llama.profile.json
    pd plan llama.profile.json --cluster 2x10GB/s --straight --mode flush -o llama.plan.json
    pd export-plan llama.plan.json --to pipelining -o llama.pp.json
    torchrun --nproc-per-node 2 examples/pipelining/train_exported.py llama.pp.json

Each rank builds its stages as torchtitan does (a copy of the model with the modules of other
stages removed: `pdtool.targets.torch_stage.stage_module`), wraps them in `PipelineStage` and
runs the schedule class the export names (or pdtool's own schedule from its CSV for zb and zb2).
The model is built here, by this file's code: the export's kwargs are data.
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineScheduleRuntime, get_schedule_class

from pdtool.targets.torch_stage import check_covered, stage_module


def pipeline(exported: dict, model: torch.nn.Module, loss_fn, rank: int, folder: str = "."):
    """(schedule, this rank's stage modules) for the export's stages on pipeline rank `rank`; a stage
    marked `recompute` runs its forward again in the backward (torch's checkpoint_wrapper)."""
    check_covered(model, [stage["modules"] for stage in exported["stages"]])
    mine = [stage for stage in exported["stages"] if stage["rank"] == rank]
    modules = [stage_module(copy.deepcopy(model), stage["modules"]) for stage in mine]
    total = len(exported["stages"])
    stages = [PipelineStage(checkpoint_wrapper(module) if stage["recompute"] else module, stage["index"], total,
                            torch.device("cpu")) for module, stage in zip(modules, mine)]
    count = exported["n_microbatches"]
    if exported["schedule_csv"]:  # pdtool's zb / zb2 schedule, as torch's runtime loads a CSV
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=count, loss_fn=loss_fn)
        schedule._load_csv(os.path.join(folder, exported["schedule_csv"]))
    elif issubclass(get_schedule_class(exported["schedule"]), PipelineScheduleSingle):
        schedule = get_schedule_class(exported["schedule"])(stages[0], n_microbatches=count, loss_fn=loss_fn)
    else:
        schedule = get_schedule_class(exported["schedule"])(stages, n_microbatches=count, loss_fn=loss_fn)
    return schedule, modules


def main(path: str, steps: int = 10) -> None:
    from pdtool.zoo.llama import llama  # the model class the profile measured

    with open(path, encoding="utf-8") as handle:
        exported = json.load(handle)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # every rank builds the same initial weights
    bundle = llama(**exported["model"]["kwargs"])
    schedule, modules = pipeline(exported, bundle.module, bundle.loss_fn, rank, os.path.dirname(path))
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.05, momentum=0.9)
    first, last = any(s["index"] == 0 for s in exported["stages"] if s["rank"] == rank), \
        any(s["index"] == len(exported["stages"]) - 1 for s in exported["stages"] if s["rank"] == rank)
    for step in range(steps):
        torch.manual_seed(step)  # every rank draws the same batch: the first feeds its inputs, the last its targets
        inputs, target = bundle.make_batch(exported["microbatch_size"] * exported["n_microbatches"])
        losses: list = []
        schedule.step(*((inputs,) if first else ()), **({"target": target, "losses": losses} if last else {}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if last:
            print(f"step {step}: loss {torch.stack(losses).mean():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
