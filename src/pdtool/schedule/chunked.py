"""The orders of the modes that put several stages (chunks) on each worker.

Each function gives one worker's forwards and backwards for one batch of m microbatches
(they all drain the pipeline before every step), as (kind, stage, microbatch-within-the-batch)
triples; `generator` shifts the microbatches and puts the steps in.

- `interleaved`: Megatron-LM's interleaved 1F1B (Narayanan et al. SC'21, section 2.2; torch's
  ScheduleInterleaved1F1B), on the LOOPED placement with v chunks per worker. Worker r runs the
  virtual microbatches k = 0 .. v*m - 1 in the order of Megatron's schedule: forward k is chunk
  (k mod pv) div p of microbatch (k div pv) * p + k mod p, backward k the same with the chunks
  counted from the last; 2(p - r - 1) + (v - 1)p forwards of warm-up (all of them when m = p,
  as Megatron does), then one forward and one backward, then the remaining backwards. m must be
  a multiple of p (Megatron's rule: microbatches go through the chunks in rounds of p).

Pure standard library.
"""
from __future__ import annotations

import functools

Item = tuple[str, int, int]  # (kind "F" or "B", stage, microbatch within the batch)


def interleaved(workers: int, chunks: int, group: int, worker: int) -> tuple[Item, ...]:
    """Worker `worker`'s order for one batch of `group` microbatches (see the module's text)."""
    p, v, m = workers, chunks, group
    total = m * v
    warm = total if m == p else min(2 * (p - worker - 1) + (v - 1) * p, total)

    def item(kind: str, k: int) -> Item:
        chunk = (k % (p * v)) // p
        if kind == "B":
            chunk = v - 1 - chunk
        return kind, chunk * p + worker, (k // (p * v)) * p + k % p

    order = [item("F", k) for k in range(warm)]
    for i in range(total - warm):
        order += [item("F", warm + i), item("B", i)]
    order += [item("B", k) for k in range(total - warm, total)]
    return tuple(order)


ORDERS = {"interleaved": interleaved}
"""Mode name -> its order function, for the modes whose rows have a placement (`Mode.placement`)."""


@functools.lru_cache(maxsize=256)
def depths(mode: str, workers: int, chunks: int, group: int) -> dict[int, int]:
    """Per stage: the most microbatches it holds in flight (forward done, last backward part not)
    in `mode`'s order for one batch of `group`."""
    found: dict[int, int] = {}
    for worker in range(workers):
        held: dict[int, int] = {}
        for kind, stage, _ in ORDERS[mode](workers, chunks, group, worker):
            held[stage] = held.get(stage, 0) + (1 if kind == "F" else -1)
            found[stage] = max(found.get(stage, 0), held[stage])
    return found
