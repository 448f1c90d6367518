"""A replicated stage's gradients sharded across its replicas (`--shard gradients`: ZeRO stage 2,
on top of `optimizer_shard`'s layout).

With `--shard optimizer` every replica adds each backward's gradients into the whole stage's
`.grad` and the replicas all-reduce them once a step. Here they are reduced after every
backward instead, bucket by bucket while the backward runs, and each replica keeps only its
slice of the sum: the slice of `ShardedOptimizer`'s flat layout its optimizer steps, an
accumulator of 1/r of the stage (`accumulators`), which the pieces' `.grad` view. A bucket is a
run of consecutive parameters of one parameter group, in the reverse of the stage's order (the
order a backward makes them), of at most `BUCKET_BYTES` (or one larger parameter), the weight-decay
group's buckets before the no-decay group's (biases and norms, spread over every layer: their
buckets complete only at the backward's end, so they wait, small, and the weights' buckets go
as they complete); once every parameter of the next bucket has its gradient, the bucket is
flattened into one reused buffer, all-reduced among the replicas (what gloo runs for a reduce-scatter anyway; NCCL's
reduce-scatter would move half the bytes), its part of this replica's slice added to the
accumulator, and its gradients let go. A parameter the backward's graph does not reach (an unused
head, an expert no token was routed to: `reached`, as DDP's `find_unused_parameters`) adds zeros
at once instead of holding its bucket and the ones after it back. So a replica holds, beyond its
slice, the gradients of at most the bucket being filled and the bucket's buffer; where a
backward cannot hand its gradients over one at a time (the `W` of the split-backward modes computes them together), one
backward's.

Buckets are reduced in their order, every one after every backward (`flush` reduces what the
backward left: zeros for a parameter it gave no gradient), so the k-th collective of every
replica is the same bucket of its k-th backward. A replica that runs fewer backwards than
another before a step reduces empty ones (`schedule.lower`'s padding: zeros), and the last
bucket carries how many real backwards each replica reduced, so the mean divides by the
backwards the step covers, as the unsharded all-reduce's count does.

The sum differs from `--shard optimizer`'s in the order it adds: (a + b) + (c + d) over the
replicas' backwards instead of (a + c) + (b + d), equal within float rounding, not bit for bit.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...errors import LaunchError
from ...memory import GRADIENT_BUCKET_BYTES as BUCKET_BYTES  # a bucket's gradients (a larger parameter: its own)

Allreduce = Callable[[torch.Tensor], None]  # sums a flat buffer over the stage's replicas, in place


class GradientReducer:
    """The reduction of one replica's gradients after each backward (see the module docstring).
    `layout`: `ShardedOptimizer.layout`, whose groups' parameters are the stage's live ones;
    `index`: the position in the stage's parameter list of each of them; `allreduce` is set once
    the replicas' process group exists."""

    def __init__(self, layout, index: dict[torch.Tensor, int], bucket_bytes: int = BUCKET_BYTES):
        self.layout = layout
        self.accumulators = [torch.zeros(g.slice, dtype=g.buffer.dtype, device=g.buffer.device) for g in layout]
        # each bucket: (its group, [(stage parameter index, offset in the group's buffer, elements)], lo, hi)
        self.buckets: list[tuple[int, list[tuple[int, int, int]], int, int]] = []
        for k, group in enumerate(layout):
            offsets, at = [], 0
            for p in group.params:
                offsets.append((index[p], at, p.numel()))
                at += p.numel()
            current: list[tuple[int, int, int]] = []
            for entry in reversed(offsets):
                size = entry[2] * group.buffer.element_size()
                if current and (sum(n for *_, n in current) * group.buffer.element_size() + size > bucket_bytes):
                    self._bucket(k, current)
                    current = []
                current.append(entry)
            if current:
                self._bucket(k, current)
        self.bucket_of = {i: b for b, (_, entries, _, _) in enumerate(self.buckets) for i, _, _ in entries}
        largest = max((hi - lo for _, _, lo, hi in self.buckets), default=0)
        like = layout[0].buffer if layout else torch.empty(0)
        self.buffer = torch.empty(largest + 1, dtype=like.dtype, device=like.device)  # + the count of backwards
        self.held: dict[int, torch.Tensor] = {}   # parameter index -> its gradient of this backward
        self.next = 0                             # the next bucket to reduce in this backward
        self.reduced = 0.0                        # the replicas' backwards summed since the accumulators were zeroed
        self.allreduce: Allreduce | None = None

    def _bucket(self, group: int, entries: list[tuple[int, int, int]]) -> None:
        lo = min(at for _, at, _ in entries)
        hi = max(at + n for _, at, n in entries)
        self.buckets.append((group, sorted(entries, key=lambda e: e[1]), lo, hi))

    def absent(self, index: int) -> None:
        """Parameter `index` gets no gradient in this backward (autograd's graph does not reach
        it, `reached`): it adds zeros, and the buckets it completes are reduced, so that an unused
        parameter does not hold the buckets after it back until the backward ends."""
        if index not in self.held:
            self.held[index] = None
            self._advance()

    def take(self, index: int, grad: torch.Tensor) -> None:
        """Parameter `index`'s gradient of this backward (added to one it already gave); the
        buckets it completes are reduced."""
        if self.bucket_of[index] < self.next:  # its bucket went: the sum would carry it into the next backward
            raise LaunchError(f"parameter {index} of this stage got a second gradient in one backward after its bucket "
                              "was reduced (a reentrant torch.utils.checkpoint around a weight used twice?); use "
                              "--shard optimizer, or checkpoint with use_reentrant=False")
        held = self.held.get(index)
        self.held[index] = grad if held is None else held.add_(grad)
        self._advance()

    def _advance(self) -> None:
        while self.next < len(self.buckets) and all(i in self.held for i, _, _ in self.buckets[self.next][1]):
            self._reduce(self.next, 1.0)
            self.next += 1

    def flush(self, real: bool = True) -> None:
        """The end of a backward: every bucket not reduced yet is (a parameter without a gradient
        adds zeros), ready for the next backward; `real` False: an empty one (zeros, no backward)."""
        while self.next < len(self.buckets):
            self._reduce(self.next, 1.0 if real else 0.0)
            self.next += 1
        self.next = 0
        assert not self.held, "every bucket was reduced, so no gradient is held"

    def _reduce(self, b: int, count: float) -> None:
        if self.allreduce is None:
            raise RuntimeError("the replicas' process group of a gradient shard was not set")
        k, entries, lo, hi = self.buckets[b]
        group = self.layout[k]
        last = b == len(self.buckets) - 1  # it carries the backward's count
        flat = self.buffer[:hi - lo + last]
        if last:
            flat[-1] = count
        with torch.no_grad():
            for i, at, n in entries:
                grad = self.held.pop(i, None)
                if grad is None:
                    flat[at - lo:at - lo + n].zero_()
                else:
                    flat[at - lo:at - lo + n].copy_(grad.reshape(-1))
            self.allreduce(flat)
            if last:
                self.reduced += float(flat[-1])
            a, z = max(lo, group.start), min(hi, group.start + group.slice)  # this replica's part of the bucket
            if a < z:
                self.accumulators[k][a - group.start:z - group.start].add_(flat[a - lo:z - lo])

    def mean(self) -> None:
        """The accumulators become the mean over every replica's backwards since they were zeroed."""
        for acc in self.accumulators:
            acc.div_(max(self.reduced, 1.0))

    def zero(self) -> None:
        """After a step: the accumulators hold nothing (their memory stays)."""
        for acc in self.accumulators:
            acc.zero_()
        self.reduced = 0.0

    def views(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each piece's gradient: its part of this replica's accumulator (`ShardedOptimizer`'s pieces)."""
        found = {}
        for group, acc in zip(self.layout, self.accumulators):
            for _, _, at, piece in group.pieces:
                found[piece] = acc[at - group.start:at - group.start + piece.numel()]
        return found

    @property
    def nbytes(self) -> int:
        """The bytes this reducer keeps: its slice's accumulators and the bucket buffer."""
        return sum(a.numel() * a.element_size() for a in self.accumulators) + \
            self.buffer.numel() * self.buffer.element_size()


def reached(roots) -> set[int]:
    """The ids of the leaf tensors whose gradients a backward from `roots` accumulates: the
    variables of the AccumulateGrad nodes its graph reaches (as DDP's `find_unused_parameters`)."""
    found, seen = set(), set()
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
