"""runtime.worker.shm: rings of message slots in a shared file, between two mappings or two processes."""
import os
import time

import pytest
import torch

from pdtool.errors import LaunchError
from pdtool.runtime.worker import comm, shm

pytestmark = pytest.mark.skipif(not shm.available(torch.device("cpu")), reason="shared-memory links need x86 and /dev/shm")

TENSORS = [torch.randn(3, 5)[:, 1:4], torch.arange(20000, dtype=torch.float32), torch.tensor([True, False]),
           torch.tensor(7, dtype=torch.int64), torch.zeros(0, 4), torch.randn(2, dtype=torch.complex64)]
SPECS = [comm.BoundaryTensor(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(TENSORS)]
LAYOUT = comm.layout([(t.shape, t.dtype) for t in TENSORS], pack_all=True)


def waiter(timeout_s=5.0, peer_pid=None, spin=True):
    return shm.Waiter(spin=spin, timeout_s=timeout_s, rank=0, peer=1, peer_pid=peer_pid)


def pair(tmp_path, slots=2, **kwargs):
    path = str(tmp_path / "ring")
    assert shm.create(path, shm.ring_bytes(slots, LAYOUT.size))
    return (shm.Ring(path, slots, LAYOUT.size, waiter(**kwargs)), shm.Ring(path, slots, LAYOUT.size, waiter(**kwargs)))


def message(b):
    return [t + b if t.dtype != torch.bool else t for t in TENSORS]


def assert_message(got, b):
    for sent, back in zip(message(b), got):
        assert back.dtype == sent.dtype and back.shape == sent.shape and torch.equal(back, sent)


def test_pack_all_puts_every_tensor_in_the_buffer_even_a_single_or_large_one():
    assert LAYOUT.alone == () and [p for p, _, _ in LAYOUT.packed] == list(range(len(TENSORS)))
    single = comm.layout([((4,), torch.float32)], pack_all=True)
    assert single.packed == ((0, 0, 16),) and single.size == 16


def test_messages_come_back_equal_in_order_around_the_ring(tmp_path):
    sender, receiver = pair(tmp_path, slots=2)
    for b in range(7):  # wraps around the 2 slots several times
        sender.put(LAYOUT, message(b), b, "w")
        got = receiver.take(LAYOUT, SPECS, b, "w")
        assert_message(got, b)
    assert sender.written == receiver.taken == 7


def test_arrived_says_whether_the_next_message_is_in_the_ring(tmp_path):
    sender, receiver = pair(tmp_path, slots=2)
    assert not receiver.arrived()
    sender.put(LAYOUT, message(0), 0, "w")
    assert receiver.arrived()
    receiver.take(LAYOUT, SPECS, 0, "w")
    assert not receiver.arrived()
    link = comm.Link(torch.device("cpu"), window=2, rings={(1, comm.ACTIVATION, True): receiver})
    link.post_recv((comm.ACTIVATION, 1), 1, SPECS, comm.ACTIVATION)
    assert not link.arrived((comm.ACTIVATION, 1))
    sender.put(LAYOUT, message(1), 1, "w")
    assert link.arrived((comm.ACTIVATION, 1))
    assert_message(link.wait_recv((comm.ACTIVATION, 1)), 1)


def test_a_taken_message_owns_its_memory_the_slot_can_be_reused(tmp_path):
    sender, receiver = pair(tmp_path, slots=1)
    sender.put(LAYOUT, message(0), 0, "w")
    first = receiver.take(LAYOUT, SPECS, 0, "w")
    sender.put(LAYOUT, message(1), 1, "w")  # overwrites the only slot
    assert_message(first, 0)


def test_a_full_ring_makes_the_sender_wait_then_time_out_with_one_line(tmp_path):
    sender, _ = pair(tmp_path, slots=2, timeout_s=0.3)
    sender.put(LAYOUT, message(0), 0, "w")
    sender.put(LAYOUT, message(1), 1, "w")
    began = time.monotonic()
    with pytest.raises(comm.PeerTimeout, match=r"rank 0 waited 0.3 s for rank 1 to take it, which stopped answering"):
        sender.put(LAYOUT, message(2), 2, "rank 1 to take it")
    assert 0.3 <= time.monotonic() - began < 2


def test_a_receiver_whose_peer_process_is_gone_stops_within_a_check(tmp_path):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a process id that no longer exists
    _, receiver = pair(tmp_path, timeout_s=60, peer_pid=pid, spin=False)
    began = time.monotonic()
    with pytest.raises(LaunchError, match="waited for the gradients: rank 1's remote process exited"):
        receiver.take(LAYOUT, SPECS, 0, "the gradients")
    assert time.monotonic() - began < 1


def test_a_message_of_another_minibatch_is_refused(tmp_path):
    sender, receiver = pair(tmp_path)
    sender.put(LAYOUT, message(3), 3, "w")
    with pytest.raises(LaunchError, match="expected w but its link carried minibatch 3"):
        receiver.take(LAYOUT, SPECS, 4, "w")


def echo(there, back, count):
    """Another process: takes `count` messages from ring `there` and puts each back on `back`."""
    inbox, outbox = shm.Ring(there, 2, LAYOUT.size, waiter()), shm.Ring(back, 2, LAYOUT.size, waiter())
    for b in range(count):
        outbox.put(LAYOUT, inbox.take(LAYOUT, SPECS, b, "w"), b, "w")


@pytest.mark.slow
def test_two_processes_exchange_messages_through_two_rings(tmp_path):
    """A ping-pong with a spawned process: what one writes, the other reads whole and in order."""
    import multiprocessing

    there, back = str(tmp_path / "there"), str(tmp_path / "back")
    for path in (there, back):
        assert shm.create(path, shm.ring_bytes(2, LAYOUT.size))
    peer = multiprocessing.get_context("spawn").Process(target=echo, args=(there, back, 50))
    peer.start()
    try:
        outbox, inbox = shm.Ring(there, 2, LAYOUT.size, waiter(30)), shm.Ring(back, 2, LAYOUT.size, waiter(30))
        for b in range(50):
            outbox.put(LAYOUT, message(b), b, "w")
            assert_message(inbox.take(LAYOUT, SPECS, b, "w"), b)
    finally:
        peer.join(30)
    assert peer.exitcode == 0


def test_create_refuses_a_file_that_exists(tmp_path):
    path = str(tmp_path / "ring")
    assert shm.create(path, 4096)
    assert os.path.getsize(path) == 4096
    assert not shm.create(path, 4096)


def test_which_links_use_shared_memory():
    cpu = torch.device("cpu")
    assert shm.use_shared_memory("auto", cpu, 1)
    assert not shm.use_shared_memory("auto", cpu, 10 ** 6)  # more workers than cores: no spinning, the process group
    assert shm.use_shared_memory("shared-memory", cpu, 10 ** 6)
    assert not shm.use_shared_memory("process-group", cpu, 1)
    assert not shm.use_shared_memory("auto", torch.device("meta"), 1)


def test_remove_node_removes_only_that_launchers_files():
    mine, other = shm.ring_path("testnodeA", 0, 1, 0), shm.ring_path("testnodeB", 0, 1, 0)
    try:
        assert shm.create(mine, 64) and shm.create(other, 64)
        shm.remove_node("testnodeA")
        assert not os.path.exists(mine) and os.path.exists(other)
    finally:
        shm.remove([mine, other])
