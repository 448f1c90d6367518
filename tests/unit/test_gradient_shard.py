"""`worker.gradient_shard` without processes: r replicas as threads of one process whose
all-reduce sums through shared memory. Each replica hands over its gradients one parameter at a
time in the order a backward makes them; its slice must end as that slice of the mean of every
replica's backwards, and it must never hold more than a bucket of them."""
import threading

import pytest
import torch

from pdtool.runtime import optimizers
from pdtool.runtime.recipe import OptimizerConfig
from pdtool.runtime.worker.gradient_shard import GradientReducer
from pdtool.runtime.worker.optimizer_shard import ShardedOptimizer

ADAMW = OptimizerConfig(name="adamw", lr=0.01, momentum=None, weight_decay=0.1)
SHAPES = [(6, 5), (5,), (4, 6), (4,), (3,), ()]  # weights and biases; a 0-dim parameter too


class _Sum:
    """`allreduce` for r replicas in threads: every replica's buffer becomes the sum, in place."""

    def __init__(self, r: int):
        self.r, self.barrier, self.parts, self.calls = r, threading.Barrier(r), {}, []

    def of(self, me: int):
        def allreduce(buffer):
            self.parts[me] = buffer.clone()
            self.barrier.wait()
            total = sum(self.parts[i] for i in range(self.r))
            self.barrier.wait()
            buffer.copy_(total)
            if me == 0:
                self.calls.append(buffer.numel())
        return allreduce


def _run(r, backwards, grads, bucket_bytes, skip=(), empty=(), announce=False):
    """Each replica's (reducer, its pieces' gradients, the most gradient elements it held at once)
    after `backwards` backwards; `grads[me][k]` are replica me's gradients of backward k (in the
    stage's parameter order); a parameter in `skip` gets no gradient; (replica, k) in `empty`:
    that replica's backward k is an empty reduce (it runs fewer backwards); `announce`: the
    skipped ones are said absent before the backward (`reached` found no path to them)."""
    total = _Sum(r)
    found, errors = [None] * r, []

    def replica(me):
        try:
            params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
            named = [(f"p{i}", p) for i, p in enumerate(params)]
            groups = optimizers.param_groups(named, ADAMW.weight_decay, frozenset(n for n, p in named if p.dim() < 2))
            shard = ShardedOptimizer(groups, lambda flat: optimizers.build_over(ADAMW, flat), r, me,
                                     {p: i for i, p in enumerate(params)})
            reducer = shard.reducer
            reducer.__init__(shard.layout, {p: i for i, p in enumerate(params)}, bucket_bytes)  # small buckets
            reducer.allreduce = total.of(me)
            most = 0
            for k in range(backwards):
                if (me, k) in empty:
                    reducer.flush(real=False)
                    continue
                for i in skip if announce else ():
                    reducer.absent(i)
                for i in reversed(range(len(params))):  # as a backward makes them: the last layer's first
                    if i not in skip:
                        reducer.take(i, grads[me][k][i].clone())
                    most = max(most, sum(g.numel() for g in reducer.held.values() if g is not None))
                reducer.flush()
            reducer.mean()
            found[me] = (reducer, reducer.views(), most, shard)
        except Exception as error:  # noqa: BLE001 - reported below, the other threads released
            errors.append(error)
            total.barrier.abort()

    threads = [threading.Thread(target=replica, args=(me,)) for me in range(r)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return found, total.calls


@pytest.mark.parametrize("r, backwards, bucket_bytes, empty", [
    (2, 3, 64, ()), (3, 2, 1, ()), (2, 1, 2 ** 20, ()),
    (3, 2, 64, {(2, 1)}),  # replica 2 runs one backward fewer: an empty reduce, the mean over the 5 real ones
])
def test_each_replica_ends_with_its_slice_of_the_mean_gradient(r, backwards, bucket_bytes, empty):
    torch.manual_seed(0)
    grads = [[[torch.randn(s) for s in SHAPES] for _ in range(backwards)] for _ in range(r)]
    real = [(me, k) for me in range(r) for k in range(backwards) if (me, k) not in empty]
    mean = [sum(grads[me][k][i] for me, k in real) / len(real) for i in range(len(SHAPES))]
    found, calls = _run(r, backwards, grads, bucket_bytes, empty=empty)
    covered = 0
    for me, (reducer, views, most, shard) in enumerate(found):
        for group in shard.layout:
            for p, start, _, piece in group.pieces:  # SHAPES are unique: a shape names its parameter
                expected = mean[SHAPES.index(tuple(p.shape))].reshape(-1)[start:start + piece.numel()]
                torch.testing.assert_close(views[piece], expected, rtol=1e-6, atol=1e-7)
                covered += piece.numel()
        # it held at most a bucket (or one larger parameter) of gradients beyond its slice
        biggest = max(max(1, -(-bucket_bytes // 4)), max(torch.Size(s).numel() for s in SHAPES))
        assert most <= 2 * biggest
    assert covered == sum(torch.Size(s).numel() for s in SHAPES)  # every element stepped by exactly one replica
    # one all-reduce per bucket per backward, each at most the largest bucket
    assert len(calls) == backwards * len(found[0][0].buckets)


def test_a_parameter_without_a_gradient_adds_zeros_and_the_buckets_still_meet():
    torch.manual_seed(1)
    grads = [[[torch.randn(s) for s in SHAPES] for _ in range(2)] for _ in range(2)]
    found, calls = _run(2, 2, grads, 64, skip={1})
    for reducer, views, _, shard in found:
        assert len(calls) == 2 * len(reducer.buckets)
        for group in shard.layout:
            for p, start, _, piece in group.pieces:
                if tuple(p.shape) == SHAPES[1]:
                    assert torch.count_nonzero(views[piece]) == 0


def test_zero_keeps_the_slice_and_counts_afresh():
    torch.manual_seed(2)
    grads = [[[torch.randn(s) for s in SHAPES]] for _ in range(2)]
    found, _ = _run(2, 1, grads, 64)
    reducer = found[0][0]
    kept = [a.data_ptr() for a in reducer.accumulators]
    reducer.zero()
    assert reducer.reduced == 0 and all(torch.count_nonzero(a) == 0 for a in reducer.accumulators)
    assert [a.data_ptr() for a in reducer.accumulators] == kept
    # its bytes: the slices (padded to the replicas) and one bucket's buffer
    assert reducer.nbytes == 4 * (sum(g.slice for g in reducer.layout) + reducer.buffer.numel())


def test_a_gradient_after_its_bucket_went_is_one_line_not_a_wrong_mean():
    """A parameter whose hook fires again after its bucket was reduced (a reentrant checkpoint around a weight used
    twice) would carry its late gradient into the next backward: refused."""
    from pdtool.errors import LaunchError

    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    groups = optimizers.param_groups([(f"p{i}", p) for i, p in enumerate(params)], 0.0, frozenset())
    shard = ShardedOptimizer(groups, lambda flat: optimizers.build_over(ADAMW, flat), 1, 0,
                             {p: i for i, p in enumerate(params)})
    reducer = shard.reducer
    reducer.__init__(shard.layout, {p: i for i, p in enumerate(params)}, 1)  # a bucket a parameter
    reducer.allreduce = lambda buffer: None
    last = len(params) - 1  # the first bucket: reduced as soon as its gradient comes
    reducer.take(last, torch.ones(SHAPES[last]))
    assert reducer.next == 1
    with pytest.raises(LaunchError, match="second gradient in one backward after its bucket"):
        reducer.take(last, torch.ones(SHAPES[last]))


def test_a_parameter_the_backward_does_not_reach_holds_no_bucket_back():
    """An early bucket's parameter without a gradient holds every later bucket's gradients until the backward ends;
    said absent up front (autograd's graph does not reach it: `reached`), it adds zeros and the buckets go on."""
    from pdtool.runtime.worker.gradient_shard import reached

    torch.manual_seed(3)
    grads = [[[torch.randn(s) for s in SHAPES] for _ in range(2)] for _ in range(2)]
    late = 2  # the (4, 6) weight: the first bucket of a backward (weights before biases, the last layer first)
    blocked = _run(2, 2, grads, 64, skip={late})[0][0][2]
    found, _ = _run(2, 2, grads, 64, skip={late}, announce=True)
    assert found[0][2] < blocked and found[0][2] <= 2 * 30  # a bucket's worth (the largest parameter: 30)
    # reached: the leaves a backward from the roots accumulates into
    w, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    x = torch.ones(3, requires_grad=True)
    assert reached([(w * x).sum()]) == {id(w), id(x)}
