"""Weight stashing's versions in one worker (`runtime.worker.executor.VersionStore`): what each
action runs on, and how many copies of the weights it holds."""
import pytest
import torch

from pdtool.runtime.worker.executor import VersionStore
from pdtool.schedule import generate, stash_copies


def _run(mode, replicas, stage, minibatches=12, group=None):
    """Stage `stage`'s actions on its first worker, as the worker runs them: a forward takes its
    version (`get`), a backward checks the forward's weights still hold that version, a step
    keeps what is needed and changes the live weights in place. (the store, copies made, the
    values each forward ran on)."""
    schedule = generate(mode, replicas, minibatches, group=group)
    table = schedule.versions()
    actions = tuple(a for a in schedule.workers[schedule.rank(stage, 0)] if a.stage == stage)
    live = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    store = VersionStore(names=["a", "b"], live=live, actions=actions, versions=table)
    copies = []
    real = store.fresh_storage
    store.fresh_storage = lambda: copies.append(store.current) or real()
    ran = {}
    for action in actions:
        if action.kind == "U":
            store.keep_current()
            with torch.no_grad():
                for p in live:
                    p.add_(1.0)  # the step: version v + 1 holds v + 1 everywhere
            store.advance()
            continue
        v = store.version_of[(action.kind, action.minibatch)]
        if action.kind == "F":
            weights = store.get(v)
            ran[action.minibatch] = (v, weights)
            assert all(torch.equal(w, torch.full_like(w, float(v))) for w in weights.values())
        else:
            version, weights = ran[action.minibatch]
            assert version == v
            assert all(torch.equal(w, torch.full_like(w, float(v))) for w in weights.values()), action
        store.used(v)
    return store, copies, stash_copies(table, schedule.workers[schedule.rank(stage, 0)], stage)


@pytest.mark.parametrize("mode, replicas, group", [("pipedream", (1, 1), None), ("pipedream", (1, 1, 1, 1), None),
                                                   ("vsync", (1, 1, 1), None), ("2bw", (1, 1), 4),
                                                   ("flush", (1, 1), 4)])
def test_every_backward_runs_on_its_forwards_version_with_one_copy_per_kept_version(mode, replicas, group):
    """The store copies the weights exactly where `stash_copies` says (what the simulator
    prices), at the step, and holds no more copies than the versions in flight: the live weights
    and, on pipedream's stage 0 of 2, one more (a forward on the current version runs on views of
    the live weights until the step)."""
    for stage in range(len(replicas)):
        store, copies, expected = _run(mode, replicas, stage, group=group)
        assert copies == sorted(expected), (stage, copies)
        if mode == "flush":
            assert store.peak == 0
    store, _, _ = _run("pipedream", (1, 1), 0)
    assert store.peak == 1  # the version of the minibatch in flight; 2 when the forward copied
