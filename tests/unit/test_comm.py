"""runtime.comm.Link without a process group: a fake torch.distributed records what it is asked."""
import torch

from pdtool.runtime import comm


class FakeWork:
    def __init__(self, log, name):
        self.log, self.name, self.waited = log, name, False

    def is_completed(self):
        return self.waited  # like gloo: a send is reported complete only once waited on

    def wait(self):
        self.waited = True
        self.log.append(self.name)


def test_sends_stay_bounded_and_the_oldest_is_waited_for_first(monkeypatch):
    waited = []
    monkeypatch.setattr(comm.dist, "isend", lambda t, dst, group, tag: FakeWork(waited, tag))
    link = comm.Link(torch.device("cpu"))
    for b in range(1000):
        link.send([torch.zeros(3), torch.zeros(1, dtype=torch.int64)], peer=1, minibatch=b, direction=comm.ACTIVATION)
        assert len(link.sends) <= comm.MAX_PENDING_SENDS
    expected = [comm.tag(b, i, comm.ACTIVATION) for b in range(1000) for i in range(2)]
    assert waited == expected[:len(waited)] and len(waited) == 2000 - comm.MAX_PENDING_SENDS
    link.flush()
    assert waited == expected and not link.sends
