"""Real network links with a set bandwidth and latency on one Linux machine.

`machines(n, bandwidth, latency_ms)` makes n network namespaces, the emulated machines, each
with one interface `eth0` and the address 10.201.0.(i+1)/24, plugged into a switch: a bridge in
a namespace of its own. Each machine's port is shaped in both directions by `tc` (`tbf` for the
bandwidth; `netem` for a one-way latency where the kernel has it), so every machine sends and receives at most
`bandwidth` and TCP between two machines is a real link of that speed. A process runs on a
machine with `Machine.popen`/`Machine.run` (`ip netns exec`). Every namespace is deleted on
every way out (return, exception, SIGTERM, SIGINT, interpreter exit), and what still runs on
them is killed first; leftovers of a run that
was SIGKILLed are swept by the next one (they are named after the process that made them).

`throughput` measures a link's rate (TCP streams), `collective_latency` what a small message
takes between two busy machines (a gloo all-reduce after some CPU work on both): the two
figures a cluster description carries (`2x<rate>+<latency>`).

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), `ip` and `tc`. `available()` says whether
namespaces can be made here, and why not.

    python bench/links.py [1Gbit]         # check: two machines at that bandwidth (100Mbit), timed transfers
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

PREFIX = "pdlink"
SUBNET = "10.201.0"
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def bits_per_s(text: str) -> float:
    """'100Mbit', '1Gbit', '10Gbit/s', '2.5gbit' -> bits per second."""
    found = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)bit(/s)?\s*", text.lower())
    if not found:
        raise ValueError(f"bandwidth {text!r}: write it like 100Mbit, 1Gbit or 10Gbit")
    return float(found.group(1)) * _UNITS[found.group(2)]


@dataclass(frozen=True)
class Machine:
    """One emulated machine: its namespace and its address on the switch."""

    namespace: str
    address: str
    interface: str = "eth0"

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)


def available() -> str | None:
    """None when namespaces with shaped links can be made here, else why not."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install iproute2)"
    name = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip() or 'ip netns add failed'} (run as root)"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, namespace: str | None = None) -> None:
    argv = (["ip", "-n", namespace] if namespace else ["ip"]) + list(args)
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


GSO_BYTES = 70_000  # a 64 KiB GSO packet and its headers
PACED_UP_TO = 1e9  # bits per second


def _shape(namespace: str, device: str, rate_bps: float, latency_ms: float) -> None:
    """`tbf` (the rate) on `device`'s egress; under a `netem` delay when `latency_ms` > 0."""
    def qdisc(*args: str) -> None:
        done = subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", device, *args], capture_output=True, text=True)
        if done.returncode != 0:
            kind = "netem (latency)" if "netem" in args else "tbf (bandwidth)"
            raise RuntimeError(f"tc cannot add {kind} on {device}: {done.stderr.strip()}"
                               + (" (this kernel lacks sch_netem: use latency_ms=0)" if "netem" in args else ""))

    burst = max(int(rate_bps / 8 / 250), 64 * 1024)  # one timer tick's worth, at least a GSO packet
    limit = max(int(rate_bps / 8 * 0.05), 4 * burst)  # 50 ms of queue
    tbf = ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]
    if burst > GSO_BYTES and rate_bps <= PACED_UP_TO:
        # A full bucket would let a message after an idle spell leave at veth's speed: at 1 Gbit/s
        # a 2 MiB activation went 1.30x the stream rate (real NICs send at line rate). The peak
        # bucket (one GSO packet) paces it at 1.05x. Above 1 Gbit/s that pacing costs the stream
        # rate on 2 cores (5.6 instead of 9 Gbit/s), and a message there is short beside compute.
        tbf += ["peakrate", f"{int(rate_bps * 1.05)}bit", "mtu", str(GSO_BYTES)]
    if latency_ms > 0:
        qdisc("root", "handle", "1:", "netem", "delay", f"{latency_ms}ms", "limit", "100000")
        qdisc("parent", "1:1", "handle", "10:", *tbf)
    else:
        qdisc("root", *tbf)


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX + "-")]


def _delete(names: list[str]) -> None:
    """Stop what still runs on the machines (a pd train launcher and its workers), then delete them."""
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def sweep_stale() -> None:
    """Delete namespaces left by a run of this helper whose process is gone (e.g. SIGKILLed)."""
    for name in _namespaces():
        owner = name.split("-")[1]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _delete([name])


@contextlib.contextmanager
def machines(n: int, bandwidth: str = "1Gbit", latency_ms: float = 0.0):
    """n emulated machines on a switch whose ports carry `bandwidth` each way (see module doc)."""
    if not 1 <= n <= 200:
        raise ValueError("between 1 and 200 machines")
    rate = bits_per_s(bandwidth)
    sweep_stale()
    tag = f"{PREFIX}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    switch = f"{tag}-sw"
    made: list[str] = []

    def cleanup() -> None:
        _delete(list(reversed(made)))
        made.clear()

    def on_signal(signum, frame):  # noqa: ARG001 - turn the signal into an exception, so `finally` runs
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    atexit.register(cleanup)
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("link", "add", "br0", "type", "bridge", namespace=switch)
        _ip("link", "set", "br0", "up", namespace=switch)
        found = []
        for i in range(n):
            name = f"{tag}-m{i}"
            _ip("netns", "add", name)
            made.append(name)
            _ip("link", "set", "lo", "up", namespace=name)
            port = f"p{i}"
            _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", port, "netns", switch)
            _ip("link", "set", port, "master", "br0", namespace=switch)
            _ip("link", "set", port, "up", namespace=switch)
            address = f"{SUBNET}.{i + 1}"
            _ip("addr", "add", f"{address}/24", "dev", "eth0", namespace=name)
            _ip("link", "set", "eth0", "up", namespace=name)
            _shape(name, "eth0", rate, latency_ms)     # what the machine sends
            _shape(switch, port, rate, latency_ms)     # what it receives
            found.append(Machine(name, address))
        yield found
    finally:
        cleanup()
        atexit.unregister(cleanup)
        for s, handler in previous.items():
            signal.signal(s, handler)


def throughput(sender: Machine, receiver: Machine, seconds: float = 0.6, bandwidth: str = "1Gbit",
               both_ways: bool = False) -> float:
    """Bits per second of one TCP stream from `sender` to `receiver`, about `seconds` long at
    `bandwidth` (the link's nominal rate sets how many bytes are sent). `both_ways`: a stream
    each way at once (what an all-reduce and a 1F1B pipeline put on a link); the slower one's
    rate. Where the kernel's copies are the limit (veth at 10 Gbit/s on 2 cores) that is well
    below one stream alone."""
    size = int(bits_per_s(bandwidth) / 8 * seconds)
    pairs = [(sender, receiver)] + ([(receiver, sender)] if both_ways else [])
    servers = [b.popen([sys.executable, "-c", "import socket\ns=socket.create_server(('0.0.0.0', 5999))\n"
                        "c,_=s.accept()\nn=0\nwhile (d:=c.recv(1<<20)): n+=len(d)\nprint(n)"],
                       stdout=subprocess.PIPE, text=True) for _, b in pairs]
    time.sleep(0.5)
    began = time.perf_counter()
    clients = [a.popen([sys.executable, "-c", f"import socket\nc=socket.create_connection(('{b.address}', 5999))\n"
                        f"c.sendall(bytes({size}))\nc.close()"]) for a, b in pairs]
    rates = []
    for client, server in zip(clients, servers):
        if client.wait(timeout=120) != 0:
            raise RuntimeError("links: a timed transfer failed")
        got = int(server.communicate(timeout=120)[0])
        rates.append(got * 8 / (time.perf_counter() - began))
    return min(rates)


def _collective_probe(rank: int, master: str, port: int, compute_ms: float, rounds: int) -> None:
    """One end of `collective_latency` (run on a machine): gloo over eth0, `rounds` times a
    spell of `compute_ms` of busy CPU, then an all-reduce of 4 KB; rank 0 prints the median."""
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x, took = torch.zeros(1024), []
    for _ in range(rounds):
        until = time.perf_counter() + compute_ms / 1e3
        while time.perf_counter() < until:
            pass
        began = time.perf_counter()
        dist.all_reduce(x)
        took.append(time.perf_counter() - began)
    dist.destroy_process_group()
    if rank == 0:
        print(statistics.median(took))


def collective_latency(a: Machine, b: Machine, compute_ms: float = 20.0, rounds: int = 40, port: int = 29701) -> float:
    """Seconds a small message takes between two busy machines: half the median time of a 4 KB
    gloo all-reduce (a ring of 2 ranks: two message steps) right after `compute_ms` of CPU work
    on both, as a replicated stage's step follows its backward. On a machine whose cores the
    workers keep busy this is mostly waking gloo's threads (milliseconds on a 2-core virtual
    machine), not the wire; a cluster description carries it as the level's latency."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import links; links._collective_probe(%d, {a.address!r}, {port}, {compute_ms}, {rounds})"
    procs = [m.popen([sys.executable, "-c", code % rank], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for rank, m in enumerate((a, b))]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    if any(proc.returncode != 0 for proc in procs):
        raise RuntimeError("links: the all-reduce probe failed")
    return float(outputs[0]) / 2


def _check(bandwidth: str = "100Mbit") -> int:
    why = available()
    if why:
        print(f"links: {why}")
        return 1
    with machines(2, bandwidth) as (a, b):
        rate = throughput(b, a, bandwidth=bandwidth)
        print(f"one TCP stream: {rate / 1e6:.1f} Mbit/s on a {bandwidth} link (start-up included)")
        rate = throughput(b, a, bandwidth=bandwidth, both_ways=True)
        print(f"a stream each way at once: {rate / 1e6:.1f} Mbit/s each")
        print(f"a small message between busy machines: {collective_latency(a, b) * 1e3:.2f} ms")
    print(f"namespaces left: {_namespaces() or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(_check(*sys.argv[1:2]))
