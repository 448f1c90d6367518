"""runtime.worker.comm without a real process group: a fake torch.distributed records what it is asked."""
import pytest
import torch

from pdtool.runtime.worker import comm
from pdtool.schedule import generate, lower


class FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def is_completed(self):
        return False  # like gloo: a send is not reported complete before it is waited on

    def wait(self):
        self.log.append(self.name)


class FakeGroup:
    """A process group that hands out `FakeWork`s (or what `send`/`recv` are replaced with)."""

    def __init__(self, log, send=None, recv=None):
        self.log = log
        self.send = send or (lambda tensors, dst, tag: FakeWork(log, (dst, tag)))
        self.recv = recv


def fake_routes(monkeypatch, group):
    monkeypatch.setattr(comm.Link, "route", lambda self, peer, direction: (group, peer))


def test_each_link_keeps_at_most_window_messages_and_confirms_the_oldest_first(monkeypatch):
    waited = []
    fake_routes(monkeypatch, FakeGroup(waited))
    link = comm.Link(torch.device("cpu"), window=3)
    for b in range(100):
        link.send([torch.zeros(3), torch.zeros(1, dtype=torch.int64)], peer=1 + b % 2, minibatch=b,
                  direction=comm.ACTIVATION)
        assert all(len(queue) <= 3 for queue in link.sends.values())
    # peer 1 got the even minibatches, peer 2 the odd ones, each message as one transfer (both
    # tensors are small: one shared buffer, tagged as position 2); each link confirmed all but its last 3
    sent = {peer: [(peer, comm.tag(b, 2, comm.ACTIVATION)) for b in range(peer - 1, 100, 2)] for peer in (1, 2)}
    for peer in (1, 2):
        mine = [w for w in waited if w[0] == peer]
        assert mine == sent[peer][:len(mine)] and len(mine) == 50 - 3
    link.flush()
    assert sorted(waited) == sorted(sent[1] + sent[2]) and all(not q for q in link.sends.values())


def test_small_tensors_share_one_buffer_and_come_back_equal_large_ones_travel_alone():
    big = torch.arange(comm.PACK_BYTES // 4 + 1, dtype=torch.float32)  # over PACK_BYTES: alone
    tensors = [torch.randn(3, 5)[:, 1:4], big, torch.tensor([True, False, True]), torch.tensor(7, dtype=torch.int64),
               torch.zeros(0, 4), torch.randn(2, dtype=torch.float64)]
    specs = [comm.BoundaryTensor(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    shape = comm.layout([(t.shape, t.dtype) for t in tensors])
    assert shape.alone == (1,) and [p for p, _, _ in shape.packed] == [0, 2, 3, 4, 5]
    assert all(offset % 16 == 0 for _, offset, _ in shape.packed)  # any dtype can be viewed there
    buffer = shape.pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == shape.size
    back = shape.unpack(buffer.clone(), {1: big.clone()}, specs)
    for sent, got in zip(tensors, back):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
    one = comm.layout([((4,), torch.float32), ((10 ** 6,), torch.float32)])
    assert one.packed == () and one.alone == (0, 1)  # a single small tensor goes as it is, no copy


def test_a_message_of_small_tensors_is_one_transfer_and_arrives_whole(monkeypatch):
    sent = {}

    class Done:
        def wait(self, *args):
            return True

    def send(tensors, dst, tag):
        sent[tag] = tensors[0].clone()
        return Done()

    def recv(tensors, src, tag):
        tensors[0].copy_(sent.pop(tag))
        return Done()

    fake_routes(monkeypatch, FakeGroup([], send, recv))
    tensors = [torch.randn(4, 8), torch.tensor([3, 1, 2])]
    specs = [comm.BoundaryTensor("x", (4, 8), torch.float32), comm.BoundaryTensor("target", (3,), torch.int64)]
    link = comm.Link(torch.device("cpu"), window=2)
    link.send(tensors, peer=1, minibatch=5, direction=comm.GRADIENT)
    assert list(sent) == [comm.tag(5, 2, comm.GRADIENT)]
    link.post_recv((comm.GRADIENT, 5), 0, specs, comm.GRADIENT)
    got = link.wait_recv((comm.GRADIENT, 5))
    assert all(torch.equal(a, b) for a, b in zip(got, tensors)) and not sent


def test_a_posted_receive_has_arrived_once_its_transfers_completed(monkeypatch):
    done = []

    class Work:
        def is_completed(self):
            return bool(done)

    fake_routes(monkeypatch, FakeGroup([], recv=lambda tensors, src, tag: Work()))
    link = comm.Link(torch.device("cpu"), window=2)
    link.post_recv((comm.ACTIVATION, 3), 0, [comm.BoundaryTensor("x", (4, 8), torch.float32)], comm.ACTIVATION)
    assert not link.arrived((comm.ACTIVATION, 3))
    done.append(True)
    assert link.arrived((comm.ACTIVATION, 3))


@pytest.mark.parametrize("stages, rank, expected", [
    ([(0,), (1,), (2,)], 1, {(0, 0), (0, 1), (2, 0), (2, 1)}),
    ([(0, 1), (2,)], 2, {(0, 0), (0, 1), (1, 0), (1, 1)}),
    ([(0, 1), (2, 3)], 0, {(2, 0), (2, 1)}),  # b mod 2 is the same on both stages: 0 only meets 2
    ([(0, 1, 2, 3), (4, 5)], 5, {(1, 0), (1, 1), (3, 0), (3, 1)}),
])
def test_link_groups_pair_the_workers_that_exchange_minibatches(monkeypatch, stages, rank, expected):
    """The groups come from the lowered schedule's sends: every rank makes the same ones, in one order."""
    lowered = lower(generate("pipedream", [len(s) for s in stages], 8), ranks=[r for s in stages for r in s])
    made = []
    monkeypatch.setattr(comm.dist, "new_group", lambda ranks: made.append(tuple(ranks)) or tuple(ranks))
    groups = comm.link_groups(lowered, rank)
    assert set(groups) == expected
    assert all(rank in group for group in groups.values())
    assert len(made) == 2 * len({g for g in made})  # two groups (directions) per linked pair
    everyone = made[:]
    made.clear()
    comm.link_groups(lowered, stages[0][0])
    assert made == everyone  # every rank makes every group, in the same order
