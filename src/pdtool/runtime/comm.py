"""Point-to-point messages between neighbouring stages, over torch.distributed.

A stage only talks to the stage before it and the stage after it (skip connections are
relayed through the stages in between, see `runtime.stages`). Minibatch b goes to replica
b mod r of every stage (1F1B-RR), so the peer of every message follows from the plan. Shapes
and dtypes of every message are known in advance (`Boundary`), so receives are posted
ahead of need into preallocated buffers and transfers overlap compute; sends never block.
Messages carry a tag made of the minibatch, the tensor's position and the direction, so
that no two messages between the same two workers can be confused under gloo. NCCL ignores
tags and matches the messages between two ranks by order, on one stream per pair of ranks; so
each direction has a process group of its own (a receive posted early for a gradient cannot
block an activation going the other way), and the schedule validator guarantees that each
direction of each link sends and receives its minibatches in one order.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

ACTIVATION, GRADIENT = 0, 1
_MAX_TENSORS = 256
MAX_PENDING_SENDS = 32  # tensors a worker keeps in flight before it waits for its oldest send


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def tag(minibatch: int, position: int, direction: int) -> int:
    return (minibatch * _MAX_TENSORS + position) * 2 + direction


class Link:
    """Messages of one worker: activations from the previous stage and to the next one,
    gradients from the next stage and to the previous one."""

    def __init__(self, device: torch.device, groups: dict[int, object] | None = None):
        self.device = device
        self.groups = groups or {}  # direction -> process group (of the whole world); default group if absent
        self.pending: dict[tuple[int, int], tuple[list, list[torch.Tensor]]] = {}
        self.sends: deque = deque()  # (work, tensor) of sends not yet known to be complete, oldest first

    def post_recv(self, key: tuple[int, int], peer: int, specs: list[TensorSpec], direction: int) -> None:
        """Start receiving message `key` = (direction, minibatch) from `peer` into new buffers."""
        if key in self.pending:
            return
        buffers = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
        group = self.groups.get(direction)
        works = [dist.irecv(t, src=peer, group=group, tag=tag(key[1], i, direction)) for i, t in enumerate(buffers)]
        self.pending[key] = (works, buffers)

    def wait_recv(self, key: tuple[int, int]) -> list[torch.Tensor]:
        works, buffers = self.pending.pop(key)
        for work in works:
            work.wait()
        return buffers

    def send(self, tensors: list[torch.Tensor], peer: int, minibatch: int, direction: int) -> None:
        """Send without waiting; the tensors are kept alive until the transfer completes.

        At most MAX_PENDING_SENDS sends stay unconfirmed: beyond that the oldest is waited for
        (gloo reports a send complete only once waited on, so without a bound every sent
        tensor would stay alive). That wait cannot deadlock: the receiver posts the matching
        receive before it needs anything this worker sends later (messages of a link go in
        minibatch order, schedule rule 8), and it is long done in any 1F1B steady state."""
        group = self.groups.get(direction)
        for i, t in enumerate(tensors):
            t = t.contiguous()
            self.sends.append((dist.isend(t, dst=peer, group=group, tag=tag(minibatch, i, direction)), t))
        while self.sends and (len(self.sends) > MAX_PENDING_SENDS or self.sends[0][0].is_completed()):
            self.sends.popleft()[0].wait()

    def flush(self) -> None:
        while self.sends:
            self.sends.popleft()[0].wait()
