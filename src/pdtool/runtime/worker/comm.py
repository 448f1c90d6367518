"""Point-to-point messages between neighbouring stages, over torch.distributed.

A stage only talks to the stage before it and the stage after it (skip connections are
relayed through the stages in between, see `model.stages`). Minibatch b goes to replica
b mod r of every stage (1F1B-RR), so the peer of every message follows from the plan. Shapes
and dtypes of every message are known in advance (the launcher's capture,
`model.capture.Capture.specs`), so receives are posted ahead of need (`Prefetch`) and transfers
overlap compute; sends do not block.
A message's small tensors (at most `PACK_BYTES` each: a target, masks, a small model's
activations) travel together in one byte buffer (`Layout`): every transfer costs gloo about
50-100 us however small, so a 2-tensor message took 160 us one way where one tensor took 110.
Larger tensors go as they are (copying them would cost more than a transfer's overhead).
Transfers carry a tag made of the minibatch, the tensor's position and the direction, so
that no two messages between the same two workers can be confused under gloo. NCCL ignores
tags and matches the messages of a communicator by order, on one stream per communicator;
so every direction of every link (two neighbouring workers) has a two-rank process group of
its own (`link_groups`), and the schedule validator guarantees that each carries its
minibatches in one order (rule 8).

A send is known to be complete only once waited on (gloo never reports one complete before),
so a link keeps at most `window` unconfirmed messages per direction and then waits for its
oldest; each direction of a link uses the most minibatches either of its two workers holds in
flight (`schedule.stash_depth`, `Lowered.windows`): never more of its messages travel at once, and
a worker's message buffers grow with its own depth, not with the deepest worker of the pipeline
(the memory model's `messages` term, `planner.costmodel`). Such a wait ends without this worker doing anything more: each direction of a link
carries its messages in one order (schedule rule 8) and the peer posts the receives of its
next messages of a direction in that order (`Prefetch`), before it needs them.
tests/unit/test_comm_protocol.py replays the generated schedules of every mode under these
rules (replicated stages, their all-reduces and tied weights included): no deadlock with these
windows, with the schedule's largest depth everywhere, or with a window of 1; a window of 0 (each send waiting for its own receive) deadlocks.

Between two workers of one launcher a direction of a link may instead be a shared-memory ring
(`runtime.worker.shm`, `Link.rings`): its messages are written into and taken out of the ring, with
nothing to post; the same window bounds it.
"""
from __future__ import annotations

import bisect
import functools
import math
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from ...schedule import ACTIVATION, GRADIENT, Lowered
from ..peers import PeerTimeout

_MAX_TENSORS = 256


@dataclass(frozen=True)
class BoundaryTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def incoming_specs(specs, s: int, direction: int) -> list[BoundaryTensor]:
    """What stage s receives in one direction: the previous stage's outputs and the target
    (activations), or the gradients of its own floating-point outputs (none on the last stage)."""
    if direction == ACTIVATION:
        return (specs[s - 1] if s > 0 else []) + specs[-1]
    return [t for t in specs[s] if t.dtype.is_floating_point] if s < len(specs) - 1 else []


def message_specs(specs, lowered: Lowered, op) -> list[BoundaryTensor]:
    """What the message of a `send`/`recv` op carries: what its receiving stage takes in
    (`incoming_specs`)."""
    return incoming_specs(specs, lowered.receiver_stage(op), op.direction)


class Prefetch:
    """Which receives a worker posts before it runs each of its lowered ops (`schedule.lower`):
    for each direction, its next `window + 1` recv ops (the current one included), in order;
    `window` is one number for every direction, or the worker's windows by (peer, direction)
    (`Lowered.windows`), of which a direction takes its largest.

    A transfer can only run while its receive is posted (gloo reads a message into the buffer
    of its receive; the kernel's socket buffers hold only the start of a large one), so posting
    one action ahead left a transfer longer than one action's compute waiting (fc on a
    100 Mbit/s link: 103 ms per minibatch, against 90 ms with this window). The buffers are
    bounded like the sends: `window` is the most minibatches any worker of the schedule holds
    in flight."""

    def __init__(self, ops, window: int | dict[tuple[int, int], int]):
        self.ops = ops
        self.waiting: dict[int, list[int]] = {}  # direction -> indices of the recv ops of that direction
        for j, op in enumerate(ops):
            if op.kind == "recv":
                self.waiting.setdefault(op.direction, []).append(j)
        self.counts = {d: 1 + (window if isinstance(window, int) else
                               max((w for (_, direction), w in window.items() if direction == d), default=1))
                       for d in self.waiting}
        # fresh[i]: the recv ops that enter the window before op i (posted there, once each): what
        # the worker posts, so that no op pays for walking a window it posted before (~30 us an op)
        self.fresh: list[list] = [[] for _ in ops]
        for direction, indices in self.waiting.items():
            k = end = 0
            for i in range(len(ops)):
                while k < len(indices) and indices[k] < i:
                    k += 1
                stop = min(k + self.counts[direction], len(indices))
                if stop > end:
                    self.fresh[i].extend(ops[j] for j in indices[end:stop])
                    end = stop

    def before(self, i: int) -> list:
        """The recv ops that are posted (if not yet) before op i runs."""
        found = []
        for direction, indices in self.waiting.items():
            k = bisect.bisect_left(indices, i)
            found.extend(self.ops[j] for j in indices[k:k + self.counts[direction]])
        return found


def tag(minibatch: int, position: int, direction: int) -> int:
    return (minibatch * _MAX_TENSORS + position) * 2 + direction


PACK_BYTES = 64 * 1024  # a tensor up to this size travels in its message's shared buffer
_ALIGN = 16  # offsets in the shared buffer: a view of any dtype may start there


@dataclass(frozen=True)
class Layout:
    """How the tensors of one message travel: `packed` (position, offset, bytes) are copied
    into one byte buffer of `size` bytes, sent as the transfer of position `len(specs)`; the
    positions in `alone` are sent as they are, one transfer each. Sender and receiver derive it
    from the same shapes and dtypes."""

    count: int
    packed: tuple[tuple[int, int, int], ...]
    size: int
    alone: tuple[int, ...]

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.pack_into(torch.empty(self.size, dtype=torch.uint8, device=tensors[0].device), tensors)

    def pack_into(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        for position, offset, nbytes in self.packed:
            t = tensors[position]
            buffer[offset:offset + nbytes].view(t.dtype).view(t.shape).copy_(t)
        return buffer

    def unpack(self, buffer: torch.Tensor | None, alone: dict[int, torch.Tensor],
               specs: Sequence["BoundaryTensor"]) -> list[torch.Tensor]:
        """The message's tensors in position order: views of `buffer` and the `alone` ones."""
        found = dict(alone)
        for position, offset, nbytes in self.packed:
            spec = specs[position]
            found[position] = buffer[offset:offset + nbytes].view(spec.dtype).view(spec.shape)
        return [found[i] for i in range(self.count)]


def layout(specs: Sequence[tuple[tuple[int, ...], torch.dtype]], pack_all: bool = False) -> Layout:
    """How a message of these shapes and dtypes travels; `pack_all`: every tensor in the one
    buffer (a shared-memory ring's slot, `runtime.worker.shm`)."""
    return _layout(tuple((tuple(shape), dtype) for shape, dtype in specs), pack_all)


@functools.lru_cache(maxsize=256)
def _layout(specs: tuple[tuple[tuple[int, ...], torch.dtype], ...], pack_all: bool) -> Layout:
    packed, alone, offset = [], [], 0
    for position, (shape, dtype) in enumerate(specs):
        nbytes = math.prod(shape) * dtype.itemsize
        if pack_all or nbytes <= PACK_BYTES:
            packed.append((position, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        else:
            alone.append(position)
    if len(packed) < 2 and not pack_all:  # nothing to share: a single small tensor goes as it is
        return Layout(len(specs), (), 0, tuple(range(len(specs))))
    return Layout(len(specs), tuple(packed), offset, tuple(alone))


class Link:
    """Messages of one worker: activations from the previous stage and to the next one,
    gradients from the next stage and to the previous one."""

    def __init__(self, device: torch.device, window: int | dict[tuple[int, int], int],
                 groups: dict[tuple[int, int], object] | None = None,
                 timeout_s: float | None = None, rank: int | None = None, rings: dict | None = None):
        self.device = device
        # (peer, direction, receiving) -> shm.Ring: that direction goes through shared memory (a worker of several
        # stages may both send and receive activations of one peer: a ring each way)
        self.rings = rings or {}
        # unconfirmed messages per link and direction (module docstring): one number for all, or by (peer, direction)
        self.window = window
        self.groups = groups or {}  # (peer, direction) -> process group; the default group if absent
        self.pending: dict[tuple[int, int], tuple[list, tuple, int]] = {}  # key -> (works, buffers, peer)
        self.sends: dict[tuple[int, int], deque] = {}  # (peer, direction) -> (works, tensors, minibatch), oldest first
        self.timeout_s = timeout_s  # how long one message may take before its peer counts as gone (None: forever)
        self.rank = rank
        self.routes: dict[tuple[int, int], tuple[object, int]] = {}

    def window_of(self, peer: int, direction: int) -> int:
        """The unconfirmed messages one direction of a link keeps (a link no window names: the largest)."""
        if isinstance(self.window, int):
            return self.window
        return self.window.get((peer, direction)) or max(self.window.values(), default=1)

    def route(self, peer: int, direction: int) -> tuple[object, int]:
        """(process group, the peer's rank in it) of one direction of a link, resolved once.

        Transfers call the group's own `send`/`recv`: `dist.isend` and `dist.irecv` resolve the
        group and the rank again at every call, ~50 us of a 105 us message here (gloo, a
        32 KB tensor one way on this machine: 155-180 us through them)."""
        found = self.routes.get((peer, direction))
        if found is None:
            group = self.groups.get((peer, direction)) or dist.group.WORLD
            found = self.routes[(peer, direction)] = (group, dist.get_group_rank(group, peer))
        return found

    def post_recv(self, key: tuple[int, int], peer: int, specs: list[BoundaryTensor], direction: int) -> None:
        """Start receiving message `key` = (direction, minibatch) from `peer` into new buffers."""
        if key in self.pending:
            return
        if (peer, direction, True) in self.rings:  # nothing to post: the sender writes into the ring
            self.pending[key] = (None, specs, peer)
            return
        shape = layout([(s.shape, s.dtype) for s in specs])
        group, source = self.route(peer, direction)
        alone = {i: torch.empty(specs[i].shape, dtype=specs[i].dtype, device=self.device) for i in shape.alone}
        works = [group.recv([_wire(t)], source, tag(key[1], i, direction)) for i, t in alone.items()]
        buffer = None
        if shape.packed:
            buffer = torch.empty(shape.size, dtype=torch.uint8, device=self.device)
            works.append(group.recv([buffer], source, tag(key[1], shape.count, direction)))
        self.pending[key] = (works, (shape, buffer, alone, specs), peer)

    def wait_recv(self, key: tuple[int, int]) -> list[torch.Tensor]:
        works, posted, peer = self.pending.pop(key)
        if works is None:
            return self.rings[(peer, key[0], True)].take(layout([(s.shape, s.dtype) for s in posted], pack_all=True), posted,
                                                   key[1], f"the {_WHAT[key[0]]} of minibatch {key[1]} from rank {peer}")
        shape, buffer, alone, specs = posted
        for work in works:
            self._wait(work, f"the {_WHAT[key[0]]} of minibatch {key[1]} from rank {peer}", peer)
        return shape.unpack(buffer, alone, specs)

    def arrived(self, key: tuple[int, int]) -> bool:
        """Whether message `key` (posted) is here already: `wait_recv` would not wait for it."""
        works, _, peer = self.pending[key]
        if works is None:
            return self.rings[(peer, key[0], True)].arrived()
        return all(work.is_completed() for work in works)

    def send(self, tensors: list[torch.Tensor], peer: int, minibatch: int, direction: int) -> None:
        """Send without waiting; the tensors are kept alive until the transfer is confirmed."""
        ring = self.rings.get((peer, direction, False))
        if ring is not None:
            ring.put(layout([(t.shape, t.dtype) for t in tensors], pack_all=True), tensors, minibatch,
                     f"rank {peer} to take the {_WHAT[direction]} of minibatch {minibatch}")
            return
        group, destination = self.route(peer, direction)
        shape = layout([(t.shape, t.dtype) for t in tensors])
        tensors = [tensors[i].contiguous() for i in shape.alone] + ([shape.pack(tensors)] if shape.packed else [])
        positions = list(shape.alone) + ([shape.count] if shape.packed else [])
        works = [group.send([_wire(t)], destination, tag(minibatch, i, direction)) for i, t in zip(positions, tensors)]
        queue = self.sends.setdefault((peer, direction), deque())
        queue.append((works, tensors, minibatch))
        while len(queue) > self.window_of(peer, direction):
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
            raise PeerTimeout(f"{who} waited {self.timeout_s:g} s for {what}, which stopped answering (hung, "
                              "stopped, or busy longer than that, e.g. making a slow minibatch); the job was stopped "
                              "(--timeout sets how long a worker waits)", peer)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as process groups carry it (a complex one as its real pairs, as dist.isend does)."""
    return torch.view_as_real(t) if t.is_complex() else t


_WHAT = {ACTIVATION: "activations", GRADIENT: "gradients"}


def link_groups(lowered: Lowered, rank: int) -> dict[tuple[int, int], object]:
    """Two-rank process groups, one per direction of every link the lowered schedule sends a
    message over (`Lowered.links`), keyed (peer, direction) for the links of `rank`.

    Every rank creates every group, in one order, as torch.distributed requires."""
    groups = {}
    for sender, receiver, direction in lowered.links():
        group = dist.new_group(sorted((sender, receiver)))
        if rank in (sender, receiver):
            groups[(receiver if rank == sender else sender, direction)] = group
    return groups
