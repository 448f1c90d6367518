"""The network of a multi-machine job: which interface the workers talk on, and a check, before
any worker starts, that every machine reaches every other one there.

gloo advertises the address that the machine's host name resolves to unless GLOO_SOCKET_IFNAME
names an interface; on many machines (Debian's 127.0.1.1) that is loopback, and a peer on
another machine then waits out gloo's connect timeout. So every launcher picks the interface
that routes to the rendezvous host (or the one the user names) and sets it for gloo and NCCL
alike; then the launchers meet in the rendezvous store and each opens a TCP connection to every
other machine's address on that interface: one that cannot be reached fails within seconds,
with one line that names both machines.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import time

from ...errors import LaunchError

PROBE_TIMEOUT_S = 5.0
"""Seconds one machine tries to open a connection to another one's probe before it gives up."""
_SIOCGIFADDR = 0x8915


def resolve(host: str) -> str:
    """The IPv4 address of `host` (a name or an address)."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(f"cannot resolve the rendezvous host {host!r} ({exc}); give its address") from None


def address_of(interface: str) -> str | None:
    """The IPv4 address of the network interface `interface`, or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> dict[str, str]:
    """Interface name -> IPv4 address, for the interfaces of this machine that have one."""
    found = {}
    for _, name in socket.if_nameindex():
        address = address_of(name)
        if address is not None:
            found[name] = address
    return found


def route_to(address: str) -> str:
    """The local address this machine sends from to reach `address` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))
        except OSError as exc:
            raise LaunchError(f"this machine has no route to the rendezvous host {address} ({exc.strerror}); "
                              "check the address and the network") from None
        return sock.getsockname()[0]


def pick_interface(rendezvous_host: str, named: str | None) -> tuple[str, str]:
    """(interface, its address) for the job's traffic: `named` (--iface) when given, else the
    interface that routes to the rendezvous host."""
    known = interfaces()
    if named is not None:
        if named not in known:
            raise LaunchError(f"--iface {named}: no such interface with an IPv4 address on this machine; use one of "
                              f"{', '.join(f'{n} ({a})' for n, a in sorted(known.items()))}")
        return named, known[named]
    local = route_to(resolve(rendezvous_host))
    for name, address in known.items():
        if address == local:
            return name, address
    if ipaddress.ip_address(local).is_loopback:
        return "lo", local
    raise LaunchError(f"cannot tell which interface owns {local}, the address that routes to {rendezvous_host}; "
                      "name it with --iface")


def check_reachable(store, nnodes: int, node_rank: int, address: str, interface: str, timeout_s: float,
                    talk=lambda message: None) -> None:
    """Meet the other machines' launchers in `store`, then connect to each one's address: every
    machine reaches every other one on the job's interfaces, or every launcher raises one line.
    Waits up to `timeout_s` for machines that have not started yet; the rest takes seconds."""
    listener = socket.create_server((address, 0), backlog=max(nnodes, 8))
    others = [n for n in range(nnodes) if n != node_rank]
    try:
        store.set(f"pdtool/probe/{node_rank}", f"{address} {listener.getsockname()[1]} {interface}")
        talk(f"waiting for the other {len(others)} machine(s) at the rendezvous (up to {timeout_s:g} s); this one "
             f"talks on {interface} ({address})")
        _wait(store, [f"pdtool/probe/{n}" for n in others], timeout_s, "join")
        problem = next(filter(None, (_probe(store, n, node_rank, address, interface) for n in others)), "")
        store.set(f"pdtool/probed/{node_rank}", problem or "ok")
        # every machine keeps its probe open until every verdict is in (probes take seconds)
        _wait(store, [f"pdtool/probed/{n}" for n in others], len(others) * PROBE_TIMEOUT_S + 10, "check its links")
        verdicts = {n: store.get(f"pdtool/probed/{n}").decode() for n in others}
        store.set(f"pdtool/verdicts/{node_rank}", "read")
        if node_rank == 0 and (problem or any(v != "ok" for v in verdicts.values())):
            _wait(store, [f"pdtool/verdicts/{n}" for n in others], 10, "read the verdicts")  # the store is ours
    except LaunchError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store's connection broke (its host ended)
        raise LaunchError(f"lost the rendezvous while checking the links ({str(exc).splitlines()[0][:120]}); "
                          "see the error of node rank 0") from None
    finally:
        listener.close()
    if problem:
        raise LaunchError(problem)
    for n, verdict in verdicts.items():
        if verdict != "ok":
            raise LaunchError(f"machine {n} reports: {verdict}")


def _probe(store, n: int, node_rank: int, address: str, interface: str) -> str:
    """"" when this machine can open a connection to machine n's probe, else the line that says why not."""
    host, port, their = store.get(f"pdtool/probe/{n}").decode().split()
    began = time.monotonic()
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return (f"machine {node_rank} ({address} on {interface}) cannot reach machine {n} at {host} (its {their}): "
                f"{exc.strerror or exc} after {time.monotonic() - began:.1f} s; every machine must reach the others' "
                "addresses: name the interface on the shared network with --iface")
    return ""


def _wait(store, keys: list[str], timeout_s: float, what: str) -> None:
    from datetime import timedelta

    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises a plain RuntimeError/DistStoreError on timeout
        try:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
        except Exception:  # noqa: BLE001 - the store itself is gone
            missing = []
        raise LaunchError(f"machine(s) {', '.join(missing) or '?'} did not {what} within {timeout_s:g} s "
                          f"({str(exc).splitlines()[0][:120]}); start pd train on every machine with the same "
                          "--nnodes, --master-addr and --master-port") from None
