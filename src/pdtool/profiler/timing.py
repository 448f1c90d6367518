"""Clocks and summary statistics for the profiler.

Times are taken with `time.perf_counter` after a device synchronisation on CUDA, so that a
measured interval covers the kernels launched inside it. Summaries are the median and the
interquartile range (the spread), both in milliseconds.
"""
from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..precision import autocast, message_dtype


class Clock:
    """Reads wall time in seconds, synchronising the device first when it is a GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None
        self._fixed: tuple[float, float] | None = None

    def __call__(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    def fixed(self) -> tuple[float, float]:
        """(forward, backward) seconds that timing a layer on its own costs beyond the layer's
        work: the clock's reads and a backward started by itself (the autograd engine's start, the
        gradient of ones it begins from). A whole step pays them once, a profile once per layer,
        so the per-layer times are taken without them (`fx_measure.time_layer`): measured once, on
        an empty layer (one multiplication of a 4-element tensor), the median of `FIXED_ROUNDS`."""
        if self._fixed is None:
            leaf = torch.ones(4, device=self.device, requires_grad=True)
            forward, backward = [], []
            for _ in range(FIXED_ROUNDS):
                start = self()
                out = leaf * 1.0
                middle = self()
                backward_from(out)
                end = self()
                forward.append(middle - start)
                backward.append(end - middle)
            self._fixed = (statistics.median(forward), statistics.median(backward))
        return self._fixed


FIXED_ROUNDS = 50


def summarize(seconds: list[float]) -> tuple[float, float]:
    """(median, interquartile range) of `seconds`, both in milliseconds."""
    ms = sorted(s * 1000.0 for s in seconds)
    if len(ms) < 2:
        return (ms[0] if ms else 0.0), 0.0
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    return statistics.median(ms), q3 - q1


EXTRA_ROUNDS = 3       # a noisy layer (`artifacts.profile.noisy`) is measured again up to this many times
MIN_EXTRA = 5          # repeats of each extra round, at least


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a nested structure of tuples, lists and dicts."""
    leaves, _ = tree_flatten(value)
    return (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


_MESSAGE_PRECISION = "fp32"  # what floating messages travel in while `computing_in` a mixed precision


@contextlib.contextmanager
def computing_in(device: torch.device, precision: str) -> Iterator[None]:
    """Time the work inside as the workers run it in `precision` (`pdtool.precision`): under
    autocast, with `nbytes` counting floating tensors in the compute dtype (messages travel so)."""
    global _MESSAGE_PRECISION
    saved, _MESSAGE_PRECISION = _MESSAGE_PRECISION, precision
    try:
        with autocast(device, precision):
            yield
    finally:
        _MESSAGE_PRECISION = saved


def nbytes(value: Any) -> int:
    """Bytes of all tensors inside `value` (the whole minibatch), floating ones in the dtype they
    travel in between stages (`computing_in`)."""
    return sum(t.numel() * message_dtype(t.dtype, _MESSAGE_PRECISION).itemsize for t in tensors_in(value))


def backward_from(output: Any, seeds: dict[int, torch.Tensor] | None = None) -> None:
    """Back-propagate a gradient of ones from every differentiable tensor in `output`: `seeds` by
    position among `tensors_in(output)` (`seeds_for`), made before the clock started, or made here."""
    pairs = roots_and_seeds(output, seeds)
    if pairs:
        torch.autograd.backward([root for root, _ in pairs], [seed for _, seed in pairs])


def seeds_for(output: Any) -> dict[int, torch.Tensor]:
    """Gradients of ones for the floating tensors of `output` (a layer's output as a forward gave
    it), by position: a stage's backward receives its output's gradient, and autograd makes the
    gradients of its inner layers' outputs in their consumers' backwards, so a layer timed alone
    must not pay for making its own (0.2 ms for 2 MB here: a tenth of a small conv layer)."""
    return {q: torch.ones_like(t) for q, t in enumerate(tensors_in(output)) if t.is_floating_point()}


def roots_and_seeds(output: Any, seeds: dict[int, torch.Tensor] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The differentiable tensors of `output` with their gradients of ones (from `seeds` where one
    of the same shape and dtype is there)."""
    pairs = []
    for q, t in enumerate(tensors_in(output)):
        if t.requires_grad:
            seed = (seeds or {}).get(q)
            pairs.append((t, seed if seed is not None and seed.shape == t.shape and seed.dtype == t.dtype
                          else torch.ones_like(t)))
    return pairs


def step_samples(module: nn.Module, inputs: tuple[torch.Tensor, ...], target: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor], *, repeats: int, warmup: int,
                 clock: Clock) -> list[float]:
    """Seconds of `repeats` whole training steps (forward, loss and backward) after `warmup`; the
    last step's gradients stay, for `measure_update`."""
    samples = []
    for round_ in range(warmup + repeats):
        module.zero_grad(set_to_none=True)
        start = clock()
        loss_fn(module(*inputs), target).backward()
        end = clock()
        if round_ >= warmup:
            samples.append(end - start)
    return samples


def measure_update(module: nn.Module, inputs: tuple[torch.Tensor, ...], target: Any,
                   loss_fn: Callable[[Any, Any], torch.Tensor], *, repeats: int, warmup: int, clock: Clock) -> float:
    """Median ms of one optimizer step (SGD with momentum) over all of `module`'s parameters.

    The weights are restored afterwards, so profiling leaves the model as it found it.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    if all(p.grad is None for p in params):  # step_samples leaves its last gradients: no extra step
        module.zero_grad(set_to_none=True)
        loss_fn(module(*inputs), target).backward()
    ms = time_sgd_steps(params, repeats=repeats, warmup=warmup, clock=clock)
    with torch.no_grad():
        for p, value in zip(params, saved):
            p.copy_(value)
    module.zero_grad(set_to_none=True)
    return ms


def time_sgd_steps(params: list[torch.Tensor], *, repeats: int, warmup: int, clock: Clock) -> float:
    """Median ms of an SGD step with momentum over `params` (with their gradients); it changes them."""
    optimizer = torch.optim.SGD(params, lr=1e-6, momentum=0.9)
    samples = []
    for round_ in range(warmup + repeats):
        start = clock()
        optimizer.step()
        end = clock()
        if round_ >= warmup:
            samples.append(end - start)
    return summarize(samples)[0]


REDUCE_SAMPLE_BYTES = 64 * 2 ** 20  # measure_reduce times at most this many bytes of gradients


def _parameter_sample(module: nn.Module) -> tuple[list[torch.Tensor], int, int]:
    """(`module`'s first parameters, flattened, up to `REDUCE_SAMPLE_BYTES`; their bytes; all its
    parameters' bytes). A parameter waiting on `meta` (a model profiled layer by layer) is stood
    for by a tensor of ones, only within the sample."""
    params = [p.detach() for p in module.parameters() if p.requires_grad]
    sample, taken = [], 0
    for p in params:
        if taken >= REDUCE_SAMPLE_BYTES:
            break
        sample.append((torch.ones(p.shape, dtype=p.dtype) if p.device.type == "meta" else p).reshape(-1))
        taken += p.numel() * p.element_size()
    return sample, taken, sum(p.numel() * p.element_size() for p in params)


def measure_reduce(module: nn.Module, *, repeats: int, warmup: int, clock: Clock) -> float:
    """Median ms of a worker's own work in one all-reduce of all of `module`'s gradients, as the
    runtime does it: flatten them into one buffer, add a peer's buffer, divide by the count.

    Passes over memory, linear in the bytes: a large model is timed on its first parameters up
    to `REDUCE_SAMPLE_BYTES` and the time scaled to all of them. The parameters stand in for
    their gradients (same shapes, nothing computed)."""
    sample, taken, total = _parameter_sample(module)
    if not total:
        return 0.0
    flat = torch.empty(sum(p.numel() for p in sample), dtype=sample[0].dtype, device=sample[0].device)
    peer = torch.ones_like(flat)
    samples = []
    for round_ in range(warmup + repeats):
        start = clock()
        torch.cat(sample, out=flat)
        flat.add_(peer)
        flat.div_(2.0)
        end = clock()
        if round_ >= warmup:
            samples.append(end - start)
    return summarize(samples)[0] * total / taken


def measure_copy(module: nn.Module, *, repeats: int, warmup: int, clock: Clock) -> float:
    """Median ms per MiB of copying `module`'s parameters as a worker keeps a weight version
    (weight stashing: a `clone` of each, the last version's memory freed before the next), timed
    on its first parameters up to `REDUCE_SAMPLE_BYTES`; 0 for a module without parameters."""
    sample, taken, _ = _parameter_sample(module)
    if not taken:
        return 0.0
    samples = []
    for round_ in range(warmup + repeats):
        start = clock()
        copies = [p.clone() for p in sample]
        end = clock()
        del copies
        if round_ >= warmup:
            samples.append(end - start)
    return summarize(samples)[0] / (taken / 2 ** 20)


MESSAGE_SAMPLE_BYTES = 16 * 2 ** 20  # measure_message sends this many bytes per repeat
_MESSAGE_CHUNK = 2 ** 20


def measure_message(*, repeats: int, warmup: int, cpu_clock: Callable[[], float] = time.process_time,
                    total: int = MESSAGE_SAMPLE_BYTES) -> float:
    """Median CPU ms that one MiB of a message costs each of its two ends on this host: the
    sender's write into a TCP socket and the receiver's read out of it, as gloo moves a pipeline's
    activations and gradients between two processes (measured over loopback, between two threads
    of this process; the process's CPU time covers both threads and the kernel's work for them,
    halved for one end). The workers pay it beside their compute wherever they have no core to
    spare; the simulator charges it to the sender and to the receiver of every message."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        sender = socket.create_connection(server.getsockname()[:2])
        receiver, _ = server.accept()
    finally:
        server.close()
    chunk = bytes(_MESSAGE_CHUNK)
    into = memoryview(bytearray(_MESSAGE_CHUNK))

    def drain() -> None:
        got = 0
        while got < total:
            n = receiver.recv_into(into)
            if not n:
                return
            got += n

    samples = []
    with sender, receiver:
        for round_ in range(warmup + repeats):
            reader = threading.Thread(target=drain)
            start = cpu_clock()
            reader.start()
            for _ in range(total // _MESSAGE_CHUNK):
                sender.sendall(chunk)
            reader.join()
            end = cpu_clock()
            if round_ >= warmup:
                samples.append((end - start) / 2 / (total / 2 ** 20))
    return summarize(samples)[0]


def measure_data(make: Callable[[], Any], *, repeats: int, warmup: int, clock: Clock) -> float:
    """Median ms of making one minibatch with `make`."""
    samples = []
    for round_ in range(warmup + repeats):
        start = clock()
        make()
        end = clock()
        if round_ >= warmup:
            samples.append(end - start)
    return summarize(samples)[0]

