"""Links between workers of one machine through shared memory: rings of message slots.

A gloo transfer between two processes of one machine costs a socket write, a wake-up of
gloo's receiving thread and a wake-up of the waiting worker: 70-600 us one way on the 2-core
VM this was built on, where a blocked process that wakes also finds its caches cold (a 0.2 ms
compute right after such a wake-up took 140-200 us longer than after a polling wait). Between
two workers started by one `pd train` launcher, each direction of a link is instead a ring in
a shared file (`/dev/shm`): `slots` message slots and two counters, messages written (by the
sender) and taken (by the receiver). The sender copies a message's tensors into the next free
slot and counts it written; the receiver waits for it, copies it out and counts it taken
(bench/train_speed.py's overhead rows time a 32 KB ping-pong over both transports: 31-44 us one
way over rings, 79-97 us over gloo, docs/benchmarks.md).

A worker that waits polls the counter: it spins (yielding the CPU at every turn, so that its
own helper threads run) when its machine has a core for each of its workers, and otherwise
sleeps between polls (`Waiter`). Every `CHECK_S` of a wait it checks its timeout and whether
the peer's process still exists, so a peer that died or stopped ends the job as a gloo
transfer would.

The counters are plain 8-byte stores and loads, ordered by the hardware only on x86 (TSO:
the slot's bytes are visible before the count that follows them); elsewhere links use the
process group. The ring has the link's `window` slots (`Lowered.windows`): a sender blocks once `window` messages are
untaken, as `Link.send` waits for its oldest unconfirmed transfer, and the receiver takes in
the link's one order (schedule rule 8; tests/unit/test_comm_protocol.py replays every
generated schedule with receives taken only when needed: no deadlock)."""
from __future__ import annotations

import errno
import glob
import os
import platform
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ...errors import LaunchError
from ..peers import running

CHECK_S = 0.1  # seconds between checks of the timeout and of the peer's process during a wait
_SHM_DIR = "/dev/shm"
_LINE = 64  # bytes: the counters sit on cache lines of their own, and so does each slot's header
_WRITTEN, _TAKEN = 0, _LINE // 8  # indices of the counters in the int64 view of the header


def cores_for_each(local_workers: int) -> bool:
    """Whether this process may use as many CPUs as there are workers on its machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return local_workers <= cpus


def available(device: torch.device) -> bool:
    """Whether links of this machine can go through shared memory: CPU tensors, x86, /dev/shm."""
    return (device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
            and os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK))


def use_shared_memory(transport: str, device: torch.device, local_workers: int) -> bool:
    """`auto`: where available and the workers of this machine each have a core (a spinning
    wait would otherwise take a core from a computing worker); `shared-memory`: where
    available; `process-group`: never."""
    if transport == "process-group" or not available(device):
        return False
    return transport == "shared-memory" or cores_for_each(local_workers)


@dataclass(frozen=True, kw_only=True)
class Waiter:
    """How a worker waits for a ring's counter: `spin` (yield between polls) or sleep."""

    spin: bool
    timeout_s: float | None
    rank: int
    peer: int
    peer_pid: int | None

    def until(self, counters, index: int, value: int, what: str) -> None:
        if counters[index] >= value:
            return
        began = time.monotonic()
        check = began + CHECK_S
        pause = 10e-6
        while counters[index] < value:
            if self.spin:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(pause * 2, 500e-6)
            now = time.monotonic()
            if now >= check:
                check = now + CHECK_S
                self._check(now - began, what)

    def _check(self, waited_s: float, what: str) -> None:
        from ..peers import PeerTimeout

        if self.peer_pid is not None and not running(self.peer_pid):
            raise LaunchError(f"rank {self.rank} waited for {what}: rank {self.peer}'s remote process exited")
        if self.timeout_s is not None and waited_s > self.timeout_s:
            raise PeerTimeout(f"rank {self.rank} waited {self.timeout_s:g} s for {what}, which stopped answering (hung, "
                              "stopped, or busy longer than that, e.g. making a slow minibatch); the job was stopped "
                              "(--timeout sets how long a worker waits)", self.peer)


class Ring:
    """One direction of one link: `slots` slots of `size` payload bytes in a shared file.

    File layout: the written counter, the taken counter (one cache line each), then the slots,
    each a header line holding the minibatch it carries and the payload (`Layout` offsets)."""

    def __init__(self, path: str, slots: int, size: int, waiter: Waiter):
        self.slots, self.size, self.waiter = slots, size, waiter
        self.stride = _LINE + -(-max(size, 1) // _LINE) * _LINE
        data = torch.from_file(path, shared=True, size=ring_bytes(slots, size), dtype=torch.uint8)
        self.data = data
        self.counters = data[:2 * _LINE].numpy().view("int64")  # plain loads and stores, no tensor per poll
        self.headers = [data[self._slot(k):self._slot(k) + 8].numpy().view("int64") for k in range(slots)]
        self.payloads = [data[self._slot(k) + _LINE:self._slot(k) + _LINE + size] for k in range(slots)]
        self.written = int(self.counters[_WRITTEN])  # this side's count (the sender's or the receiver's)
        self.taken = int(self.counters[_TAKEN])

    def _slot(self, k: int) -> int:
        return 2 * _LINE + k * self.stride

    def put(self, layout, tensors: Sequence[torch.Tensor], minibatch: int, what: str) -> None:
        """Copy one message into the next slot once it is free (at most `slots` untaken)."""
        k = self.written
        self.waiter.until(self.counters, _TAKEN, k + 1 - self.slots, what)
        slot = k % self.slots
        with torch.no_grad():
            layout.pack_into(self.payloads[slot], tensors)
        self.headers[slot][0] = minibatch
        self.written = k + 1
        self.counters[_WRITTEN] = self.written  # after the slot's bytes (x86 stores stay in order)

    def arrived(self) -> bool:
        """Whether the next message is in the ring already (taking it would not wait)."""
        return int(self.counters[_WRITTEN]) > self.taken

    def take(self, layout, specs, minibatch: int, what: str) -> list[torch.Tensor]:
        """Wait for the next message, copy it out of its slot and free the slot."""
        k = self.taken
        self.waiter.until(self.counters, _WRITTEN, k + 1, what)
        slot = k % self.slots
        found = int(self.headers[slot][0])
        if found != minibatch:
            raise LaunchError(f"rank {self.waiter.rank} expected {what} but its link carried minibatch {found}: "
                              "the workers run different schedules; start them from the same plan and options")
        payload = self.payloads[slot].clone()
        self.taken = k + 1
        self.counters[_TAKEN] = self.taken
        return layout.unpack(payload, {}, specs)


def ring_bytes(slots: int, size: int) -> int:
    return 2 * _LINE + slots * (_LINE + -(-max(size, 1) // _LINE) * _LINE)


def ring_path(node: str, sender: int, receiver: int, direction: int) -> str:
    return os.path.join(_SHM_DIR, f"pdtool-{node}-{sender}-{receiver}-{direction}")


def create(path: str, nbytes: int) -> bool:
    """Make a zeroed shared file of `nbytes`, its memory reserved now (a full /dev/shm, e.g. a
    container's 64 MB, refuses here instead of killing a worker with SIGBUS later); False
    where it cannot be made."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.EINVAL, errno.EFBIG):
            raise
        os.unlink(path)
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True, kw_only=True)
class Direction:
    """One direction of one of this worker's links that stays on this machine."""

    peer: int
    direction: int
    receiving: bool
    nbytes: int  # a message's bytes in a ring slot (`Layout.size` with every tensor packed)
    slots: int   # messages the ring holds: the link's window for this direction (`Lowered.windows`)


def open_rings(store, node: str, rank: int, directions: Sequence[Direction], waiter_for) -> tuple[dict[tuple[int, int, bool], Ring], list[str]]:
    """The rings of this worker's same-machine links, keyed (peer, direction, receiving) as `Link` keys them,
    and the files it made.

    The receiver of each direction makes its file and says in the job's store whether it
    could ("ok") or not ("no": that direction stays on the process group); the sender then
    maps it. The caller removes the files (`remove`) once every worker has mapped its rings
    (a barrier), so nothing is left in /dev/shm whatever way the job ends after that."""
    rings, made = {}, []
    for d in directions:
        if d.receiving:
            path = ring_path(node, d.peer, rank, d.direction)
            ok = create(path, ring_bytes(max(d.slots, 1), d.nbytes))
            store.set(_key(d.peer, rank, d.direction), "ok" if ok else "no")
            if ok:
                made.append(path)
                rings[(d.peer, d.direction, True)] = Ring(path, max(d.slots, 1), d.nbytes, waiter_for(d.peer))
    for d in directions:
        if not d.receiving and store.get(_key(rank, d.peer, d.direction)) == b"ok":
            rings[(d.peer, d.direction, False)] = Ring(ring_path(node, rank, d.peer, d.direction), max(d.slots, 1), d.nbytes,
                                                waiter_for(d.peer))
    return rings, made


def remove(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_node(node: str) -> None:
    """Every ring file of one launcher's workers (what a killed worker left behind)."""
    remove(glob.glob(ring_path(node, "*", "*", "*")))


def _key(sender: int, receiver: int, direction: int) -> str:
    return f"pdtool/ring/{sender}-{receiver}-{direction}"
