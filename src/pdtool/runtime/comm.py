"""Point-to-point messages between neighbouring stages, over torch.distributed.

A stage only talks to the stage before it and the stage after it (skip connections are
relayed through the stages in between, see `runtime.stages`). Minibatch b goes to replica
b mod r of every stage (1F1B-RR), so the peer of every message follows from the plan. Shapes
and dtypes of every message are known in advance (`boundary_specs`), so receives are posted
ahead of need (`Prefetch`) and transfers overlap compute; sends do not block.
Messages carry a tag made of the minibatch, the tensor's position and the direction, so
that no two messages between the same two workers can be confused under gloo. NCCL ignores
tags and matches the messages of a communicator by order, on one stream per communicator;
so every direction of every link (two neighbouring workers) has a two-rank process group of
its own (`link_groups`), and the schedule validator guarantees that each carries its
minibatches in one order (rule 8).

A send is known to be complete only once waited on (gloo never reports one complete before),
so a link keeps at most `window` unconfirmed messages per direction and then waits for its
oldest; the worker uses the most minibatches any of its schedule's workers holds in flight
(`schedule.stash_depth`), which bounds the tensors kept alive by what the stages stash
anyway. Such a wait ends without this worker doing anything more: each direction of a link
carries its messages in one order (schedule rule 8) and the peer posts the receives of its
next messages of a direction in that order (`Prefetch`), before it needs them.
tests/unit/test_comm_protocol.py replays the generated schedules of every mode under these
rules (replicated stages, their all-reduces and tied weights included): no deadlock with this
window or with a window of 1; a window of 0 (each send waiting for its own receive) deadlocks.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import LaunchError
from ..schedule import ACTIVATION, GRADIENT

_MAX_TENSORS = 256


@dataclass(frozen=True)
class BoundaryTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class Prefetch:
    """Which receives a worker posts before it runs each of its lowered ops (`schedule.lower`):
    for each direction, its next `window + 1` recv ops (the current one included), in order.

    A transfer can only run while its receive is posted (gloo reads a message into the buffer
    of its receive; the kernel's socket buffers hold only the start of a large one), so posting
    one action ahead left a transfer longer than one action's compute waiting (fc on a
    100 Mbit/s link: 103 ms per minibatch, against 90 ms with this window). The buffers are
    bounded like the sends: `window` is the most minibatches any worker of the schedule holds
    in flight."""

    def __init__(self, ops, window: int):
        self.ops = ops
        self.count = window + 1
        self.waiting: dict[int, list[int]] = {}  # direction -> indices of the recv ops of that direction
        for j, op in enumerate(ops):
            if op.kind == "recv":
                self.waiting.setdefault(op.direction, []).append(j)

    def before(self, i: int) -> list:
        """The recv ops that are posted (if not yet) before op i runs."""
        found = []
        for indices in self.waiting.values():
            k = bisect.bisect_left(indices, i)
            found.extend(self.ops[j] for j in indices[k:k + self.count])
        return found


def tag(minibatch: int, position: int, direction: int) -> int:
    return (minibatch * _MAX_TENSORS + position) * 2 + direction


class Link:
    """Messages of one worker: activations from the previous stage and to the next one,
    gradients from the next stage and to the previous one."""

    def __init__(self, device: torch.device, window: int, groups: dict[tuple[int, int], object] | None = None,
                 timeout_s: float | None = None, rank: int | None = None):
        self.device = device
        self.window = window  # unconfirmed messages per link and direction (module docstring)
        self.groups = groups or {}  # (peer, direction) -> process group; the default group if absent
        self.pending: dict[tuple[int, int], tuple[list, list[torch.Tensor], int]] = {}
        self.sends: dict[tuple[int, int], deque] = {}  # (peer, direction) -> (works, tensors, minibatch), oldest first
        self.timeout_s = timeout_s  # how long one message may take before its peer counts as gone (None: forever)
        self.rank = rank

    def post_recv(self, key: tuple[int, int], peer: int, specs: list[BoundaryTensor], direction: int) -> None:
        """Start receiving message `key` = (direction, minibatch) from `peer` into new buffers."""
        if key in self.pending:
            return
        buffers = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
        group = self.groups.get((peer, direction))
        works = [dist.irecv(t, src=peer, group=group, tag=tag(key[1], i, direction)) for i, t in enumerate(buffers)]
        self.pending[key] = (works, buffers, peer)

    def wait_recv(self, key: tuple[int, int]) -> list[torch.Tensor]:
        works, buffers, peer = self.pending.pop(key)
        for work in works:
            self._wait(work, f"the {_WHAT[key[0]]} of minibatch {key[1]} from rank {peer}", peer)
        return buffers

    def send(self, tensors: list[torch.Tensor], peer: int, minibatch: int, direction: int) -> None:
        """Send without waiting; the tensors are kept alive until the transfer is confirmed."""
        group = self.groups.get((peer, direction))
        tensors = [t.contiguous() for t in tensors]
        works = [dist.isend(t, dst=peer, group=group, tag=tag(minibatch, i, direction)) for i, t in enumerate(tensors)]
        queue = self.sends.setdefault((peer, direction), deque())
        queue.append((works, tensors, minibatch))
        while len(queue) > self.window:
            self._confirm_oldest(queue, peer, direction)

    def flush(self) -> None:
        for (peer, direction), queue in self.sends.items():
            while queue:
                self._confirm_oldest(queue, peer, direction)

    def _confirm_oldest(self, queue: deque, peer: int, direction: int) -> None:
        """Wait for the oldest unconfirmed message of a link and let its tensors go."""
        works, _, minibatch = queue.popleft()
        for work in works:
            self._wait(work, f"rank {peer} to take the {_WHAT[direction]} of minibatch {minibatch}", peer)

    def _wait(self, work, what: str, peer: int) -> None:
        """Wait for one transfer, at most `timeout_s`: a peer that stopped answering (hung, stopped,
        or on a dead machine) ends this worker with one line, and the launcher stops the job."""
        if self.timeout_s is None:
            work.wait()
            return
        try:
            finished = work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                raise
            finished = False
        if finished is False:
            who = f"rank {self.rank}" if self.rank is not None else "this worker"
            raise PeerTimeout(f"{who} waited {self.timeout_s:g} s for {what}, which stopped answering; the job was "
                              "stopped (--timeout sets how long a worker waits)", peer)


class PeerTimeout(LaunchError):
    """A peer (rank `peer`) did not complete a transfer within the timeout."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


_WHAT = {ACTIVATION: "activations", GRADIENT: "gradients"}


def link_groups(stage_ranks: list[tuple[int, ...]], rank: int) -> dict[tuple[int, int], object]:
    """Two-rank process groups, one per direction of every link of the plan (neighbouring
    workers that exchange minibatches), keyed (peer, direction) for the links of `rank`.

    Every rank creates every group, in one order, as torch.distributed requires."""
    groups = {}
    for before, after in zip(stage_ranks, stage_ranks[1:]):
        common = math.gcd(len(before), len(after))
        for i, a in enumerate(before):
            for j, b in enumerate(after):
                if i % common != j % common:
                    continue  # no minibatch b has b mod r_s = i and b mod r_s+1 = j
                for direction in (ACTIVATION, GRADIENT):
                    group = dist.new_group([a, b])
                    if rank in (a, b):
                        groups[(b if rank == a else a, direction)] = group
    return groups
