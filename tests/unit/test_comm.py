"""runtime.comm without a real process group: a fake torch.distributed records what it is asked."""
import pytest
import torch

from pdtool.runtime import comm


class FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def is_completed(self):
        return False  # like gloo: a send is not reported complete before it is waited on

    def wait(self):
        self.log.append(self.name)


def test_each_link_keeps_at_most_window_messages_and_confirms_the_oldest_first(monkeypatch):
    waited = []
    monkeypatch.setattr(comm.dist, "isend", lambda t, dst, group, tag: FakeWork(waited, (dst, tag)))
    link = comm.Link(torch.device("cpu"), window=3)
    for b in range(100):
        link.send([torch.zeros(3), torch.zeros(1, dtype=torch.int64)], peer=1 + b % 2, minibatch=b,
                  direction=comm.ACTIVATION)
        assert all(len(queue) <= 3 for queue in link.sends.values())
    # peer 1 got the even minibatches, peer 2 the odd ones; each link confirmed all but its last 3
    sent = {peer: [(peer, comm.tag(b, i, comm.ACTIVATION)) for b in range(peer - 1, 100, 2) for i in range(2)]
            for peer in (1, 2)}
    for peer in (1, 2):
        mine = [w for w in waited if w[0] == peer]
        assert mine == sent[peer][:len(mine)] and len(mine) == 2 * (50 - 3)
    link.flush()
    assert sorted(waited) == sorted(sent[1] + sent[2]) and all(not q for q in link.sends.values())


@pytest.mark.parametrize("stages, rank, expected", [
    ([(0,), (1,), (2,)], 1, {(0, 0), (0, 1), (2, 0), (2, 1)}),
    ([(0, 1), (2,)], 2, {(0, 0), (0, 1), (1, 0), (1, 1)}),
    ([(0, 1), (2, 3)], 0, {(2, 0), (2, 1)}),  # b mod 2 is the same on both stages: 0 only meets 2
    ([(0, 1, 2, 3), (4, 5)], 5, {(1, 0), (1, 1), (3, 0), (3, 1)}),
])
def test_link_groups_pair_the_workers_that_exchange_minibatches(monkeypatch, stages, rank, expected):
    made = []
    monkeypatch.setattr(comm.dist, "new_group", lambda ranks: made.append(tuple(ranks)) or tuple(ranks))
    groups = comm.link_groups(stages, rank)
    assert set(groups) == expected
    assert all(rank in group for group in groups.values())
    assert len(made) == 2 * len({g for g in made})  # two groups (directions) per linked pair, every rank makes all
