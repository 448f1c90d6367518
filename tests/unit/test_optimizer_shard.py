"""`worker.optimizer_shard` without processes: r replicas as threads of one process whose `gather`
hands slices over through shared memory, against one unsharded optimizer (bit for bit)."""
import threading

import pytest
import torch

from pdtool.runtime import optimizers
from pdtool.runtime.recipe import OptimizerConfig
from pdtool.runtime.worker.optimizer_shard import ShardedOptimizer

ADAMW = OptimizerConfig(name="adamw", lr=0.01, momentum=None, weight_decay=0.1)
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.01)


class _Replicas:
    """`gather` for r replicas running in threads: replica i's slice is copied into everyone's buffer."""

    def __init__(self, r: int):
        self.r, self.barrier, self.slot = r, threading.Barrier(r), None

    def gather_of(self, me: int):
        def gather(buffer, size, whole=True):
            for i in range(self.r):
                if i == me:
                    self.slot = (buffer[i * size:(i + 1) * size] if whole else buffer).clone()
                self.barrier.wait()
                if whole and i != me:
                    buffer[i * size:(i + 1) * size].copy_(self.slot)
                self.barrier.wait()
        return gather


def _named(values):
    params = [torch.nn.Parameter(v.clone()) for v in values]
    return params, [(f"p{i}", p) for i, p in enumerate(params)], frozenset(f"p{i}" for i, v in enumerate(values)
                                                                            if v.dim() < 2)


def _sharded(values, recipe, r, steps, grads, state=None):
    """Each replica's (weights, optimizer, gathered state of replica 0) after `steps` steps."""
    replicas, found, errors = _Replicas(r), [None] * r, []

    def replica(me):
        try:
            params, named, plain = _named(values)
            groups = optimizers.param_groups(named, recipe.weight_decay, plain)
            shard = ShardedOptimizer(groups, lambda flat: optimizers.build_over(recipe, flat), r, me)
            shard.gather = replicas.gather_of(me)
            if state is not None:
                shard.load_param_state({p: {k: v.clone() for k, v in s.items()} for p, s in zip(params, state)})
            for step in range(steps):
                for p, g in zip(params, grads[step]):
                    p.grad = g.clone()
                shard.step()
                shard.zero_grad()
            found[me] = (params, shard, shard.param_state(keep=me == 0))
        except Exception as error:  # noqa: BLE001 - reported below, the other threads released
            errors.append(error)
            replicas.barrier.abort()

    threads = [threading.Thread(target=replica, args=(me,)) for me in range(r)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]
    return found


def _plain(values, recipe, steps, grads):
    params, named, plain = _named(values)
    optimizer = optimizers.build_optimizer(recipe, named, 1.0, plain)
    for step in range(steps):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        optimizer.step()
        optimizer.zero_grad()
    return params, optimizer


@pytest.mark.parametrize("recipe", [ADAMW, SGD], ids=["adamw", "sgd"])
@pytest.mark.parametrize("r, shapes", [
    (2, [(3, 5), (5,), (4, 3), (4,)]),   # groups of 27 and 9 elements: padded to a multiple of 2
    (4, [(7, 3), (2,)]),                 # the no-decay group (2 elements) leaves replicas 2 and 3 without pieces
    (3, [(), (2, 2)]),                   # a 0-dim parameter
])
def test_replicas_end_with_the_unsharded_weights_and_state(recipe, r, shapes):
    torch.manual_seed(0)
    values = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    params, optimizer = _plain(values, recipe, 3, grads)
    found = _sharded(values, recipe, r, 3, grads)
    for mine, shard, _ in found:
        assert all(torch.equal(a, b) for a, b in zip(mine, params))
    mine, shard, state = found[0]
    for p, q in zip(mine, params):
        for key, value in optimizer.state[q].items():
            if torch.is_tensor(value):
                assert torch.equal(state[p][key].reshape(value.shape), value), key
    if r == 4 and shapes == [(7, 3), (2,)]:
        assert found[3][1].layout[1].pieces == []  # replica 3 holds nothing of the no-decay group


def test_a_sharded_replica_resumes_from_an_unsharded_state_also_of_a_0_dim_parameter():
    torch.manual_seed(1)
    values, shapes = [torch.randn(()), torch.randn(3, 3)], [(), (3, 3)]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    params, optimizer = _plain(values, ADAMW, 2, grads[:2])
    state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
    resumed = _sharded([p.detach() for p in params], ADAMW, 2, 2, grads[2:], state=state)
    for p, g in zip(params, grads[2]):
        p.grad = g.clone()
    optimizer.step()
    optimizer.zero_grad()
    for p, g in zip(params, grads[3]):
        p.grad = g.clone()
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(resumed[0][0], params))


def test_before_any_step_the_gathered_state_is_empty_as_unsharded():
    """A checkpoint before the first step taken (fp16 skipping every step so far) holds no optimizer state:
    zero moments without Adam's step count would not load back."""
    found = _sharded([torch.randn(4, 2), torch.randn(4)], ADAMW, 2, 0, [])
    assert found[0][2] == {} and found[1][2] == {}
