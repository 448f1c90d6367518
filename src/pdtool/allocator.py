"""Keep freed memory in the process for reuse, on glibc (Linux).

A training step frees and allocates the same large tensors again and again (every
parameter's gradient, every activation). glibc hands blocks above its mmap threshold back to
the kernel when they are freed and trims the heap's free top, so the next step takes them again
page by page: page faults and zeroing on every step. GPU allocators cache freed blocks for this
reason; `keep_freed_memory` makes glibc do the same (mallopt: blocks up to 32 MiB from the
heap, no trimming). Measured on an MLP of 51 MB of parameters, one worker, one thread: 96-98 ms
per minibatch without, 74-84 ms with (`pd train`, 40 steps, 2 runs each). The workers of
`pd train` and `pd profile` call it, so that the profile measures what the workers run.
Elsewhere (another C library) it does nothing.

`PDTOOL_MALLOC=release` in the environment asks for the opposite, for measuring memory: blocks of
1 MiB and more come from mmap and go back to the kernel when freed, so a process's resident set
follows the tensors it holds (at the cost of those page faults). `bench/recompute.py` runs its
workers so.
"""
from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_MAX = 32 * 1024 * 1024   # glibc's largest mmap threshold on 64-bit machines
_NEVER = 2**31 - 1             # trim threshold (an int): keep the heap's free top
_RELEASE = 1024 * 1024         # PDTOOL_MALLOC=release: both thresholds, so that freed blocks go back


def keep_freed_memory() -> bool:
    """Set glibc's thresholds; False where there is no glibc `mallopt`."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on (find_library runs ldconfig)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    release = os.environ.get("PDTOOL_MALLOC") == "release"
    ok = mallopt(_M_MMAP_THRESHOLD, _RELEASE if release else _MMAP_MAX) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, _RELEASE if release else _NEVER) == 1
    return bool(ok)
