"""A replicated stage's parameters sharded across its replicas (`--shard parameters`: ZeRO stage 3),
with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) over the replicas' process group.

Each replica keeps 1/r of every parameter (a DTensor sharded on its first dimension), its
gradient and its optimizer state; the optimizer is the recipe's own, over those shards (an
element-wise optimizer steps a shard as it would step the parameter). The units FSDP gathers
and frees one at a time are the submodules the stage calls that hold parameters (a Linear, an
Embedding: `units`), and the stage itself for the rest (parameters its graph reads directly).

Two ways to run, by whether the mode splits its backward (`Mode.split`):

- **whole backwards** (flush, gpipe, data parallelism): FSDP's own hooks gather a unit's
  parameters before its forward and free them after, gather them again for its backward, and
  reduce-scatter its gradients as soon as the backward made them (after every backward, as
  `--shard gradients` reduces), adding them to the replica's gradient shard. Nothing whole of the
  stage is kept: a unit or two gathered at a time, and a unit's gradients while they wait.
- **split backwards** (zb, zb2): W computes the weight gradients after B, on the parameters B
  saw, so they cannot be freed in between; the parameters are gathered at the step's first
  forward and kept until the step (as torch.distributed.pipelining runs FSDP), the gradients
  accumulate whole and are reduce-scattered once, at the step (`reduce_for_step`).

FSDP sums the replicas' gradients (the divide factor 1; gloo has no pre-multiplied sum: plain
sums, `set_force_sum_reduction_for_comms`), and the step divides by the backwards of the step
over all replicas, so the weights are those of `--shard none` within fp32's rounding (a
reduce-scatter adds in another order than an all-reduce). Every replica must run the same
sequence of forwards and backwards on the stage (each is a collective of the replicas): the
launcher and `pd plan` refuse a plan whose schedule does not (`schedule.check.check_same_order`).

Checkpoints keep the unsharded layout: `full` gathers a parameter (or a state value) on every
replica (a collective), replica 0 writes it; `load` takes this replica's shard of a whole tensor.
"""
from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from ...errors import LaunchError

# torch.distributed.tensor and .fsdp are imported where used: importing them takes about half a second, which
# only a worker that shards its parameters pays


def units(module: nn.Module) -> list[nn.Module]:
    """The submodules of a stage that become FSDP units of their own: the modules its fx graph
    calls (`call_module` targets) that hold parameters, none of them shared with another module
    or read by the graph directly (`get_attr`). Everything else is the stage's own unit, gathered
    for the whole forward and again for the whole backward: all of a stage that is not an fx
    graph (torch.export's graphs read every weight by attribute; a module that is not a graph may
    read a child's weight without calling it, as `nn.MultiheadAttention` reads its `out_proj`'s)."""
    graphs = [(name, m) for name, m in module.named_modules() if isinstance(m, torch.fx.GraphModule)]
    owners = Counter(id(p) for m in module.modules() for p in m.parameters(recurse=False))
    called, read = set(), []
    for name, graph in graphs:
        for node in graph.graph.nodes:
            target = f"{name}.{node.target}" if name else str(node.target)
            if node.op == "call_module":
                called.add(target)
            elif node.op == "get_attr":
                read.append(target)
    found = []
    for target in sorted(called):
        m = module.get_submodule(target)
        own = list(m.parameters())
        if not own or any(owners[id(p)] > 1 for p in own) or any(r.startswith(f"{target}.") for r in read):
            continue
        found.append(m)
    return found


def scalar_parameters(module: nn.Module) -> list[str]:
    """The stage's parameters without dimensions (FSDP shards along the first: none to shard)."""
    return [name for name, p in module.named_parameters() if p.dim() == 0]


class ParameterSharding:
    """FSDP2 over replica group `group` (a torch.distributed process group) applied to `module`
    (a stage's), `split`: whether its mode splits the backward (see the module docstring)."""

    def __init__(self, module: nn.Module, group, device: torch.device, split: bool):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.module, self.split, self.group = module, split, group
        scalars = scalar_parameters(module)
        if scalars:
            raise LaunchError(f"--shard parameters shards each weight along its first dimension, but {scalars[0]} "
                              f"(and {len(scalars) - 1} more) has none; use --shard gradients")
        # FSDP warns of every unit whose output is a view (an in-place op on it would skip the unit's gather for the
        # backward): a stage graph's ops on a unit's output are those of the model, whose gradients the equality
        # tests compare with the unsharded run's (tests/dist/test_shard.py); the warning says nothing a user can act on
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        mesh = DeviceMesh.from_group(group, device_type=device.type)
        for unit in units(module):
            fully_shard(unit, mesh=mesh, reshard_after_forward=not split)
        fully_shard(module, mesh=mesh, reshard_after_forward=not split)
        self.fsdp = module  # now an FSDPModule
        for unit in self._units():  # each unit's own setting
            unit.set_gradient_divide_factor(1.0)  # sums: the step divides by its backwards (`Stepper.mean_gradients`)
            unit.set_force_sum_reduction_for_comms(True)
        self._accumulate(split)

    def _units(self) -> list:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def _accumulate(self, on: bool) -> None:
        """Split backwards: keep the gathered parameters and whole gradients until the step (on)."""
        self.fsdp.set_requires_gradient_sync(not on)
        self.fsdp.set_reshard_after_backward(not on)

    def gathered(self) -> list[torch.Tensor]:
        """The stage's parameters as its graph uses them now (split backwards: gathered since the
        step's first forward), in the order of `module.named_parameters()`."""
        return [p for _, p in self.module.named_parameters()]

    def reduce_for_step(self) -> None:
        """Split backwards, at the step: every unit's whole gradients reduce-scattered into the
        shards and its gathered parameters freed (a collective per unit, in one order on every
        replica), then FSDP's end of a backward (it waits for the reductions and lets their buffers
        go), as torch.distributed.pipelining ends FSDP's backward in its schedules."""
        if not self.split:
            return
        from torch.distributed.fsdp import fully_shard

        self._accumulate(False)
        fully_shard.state(self.module)._root_post_backward_final_callback()
        self._accumulate(True)

    def allreduce(self, tensor: torch.Tensor) -> None:
        """A sum over the replicas, in place (counts, squared norms)."""
        dist.all_reduce(tensor, group=self.group)


def local(t: torch.Tensor) -> torch.Tensor:
    """This replica's part of a sharded tensor (the tensor itself if it is not one)."""
    return t.to_local() if _sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole on every replica (a collective); any other as it is."""
    return t.full_tensor() if _sharded(t) else t


def load(into: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this replica's shard of `whole` (the unsharded value) into `into` (a sharded tensor,
    or a plain one, which takes it all)."""
    if _sharded(into):
        from torch.distributed.tensor import distribute_tensor

        whole = whole.to(device=into.device, dtype=into.dtype)
        into.to_local().copy_(distribute_tensor(whole, into.device_mesh, into.placements, src_data_rank=None).to_local())
    else:
        into.copy_(whole)


def shard_like(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` (an optimizer state value of the unsharded parameter) as the sharded parameter
    `param` holds it (a DTensor placed as `param`)."""
    if not _sharded(param) or whole.dim() == 0:
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def _sharded(t) -> bool:
    """Whether `t` is a DTensor (without importing torch.distributed.tensor)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")
