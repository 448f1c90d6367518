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
- `zbv`: Zero Bubble's ZB-V (Qi et al., ICLR'24, section 6; torch's ScheduleZBVZeroBubble), on the
  V placement (worker r holds stages r and 2p - 1 - r), every backward split into B (input
  gradients) and W (weight gradients): 2(p - r) - 1 forwards of the first chunk, r pairs of one
  forward of each chunk, p - r rounds of the second chunk's F, B, W; then, while microbatches
  remain, F, B, W of the first chunk and F, B, W of the second; the cool-down runs the Bs first
  and the remaining Ws last, where they fill the drain. Laid out for max(m, 2p - 1) microbatches,
  then the ones beyond m dropped (as torch does); about zero bubble when F, B and W take equal
  time, at 1F1B's activation memory.
- `dualpipev`: DeepSeek-V3's DualPipe cut in half (DualPipeV; torch's ScheduleDualPipeV, after
  deepseek-ai/DualPipe), on the V placement: warm-up forwards of both chunks, then pairs of a
  forward of one chunk with the whole backward of the other (DualPipe overlaps the two on a GPU,
  one computing while the other communicates; a CPU worker runs them one after the other), and a
  cool-down in which some backwards are split (B now, W later, filling the drain). m must be at
  least the number of stages, 2p.

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


def zbv(workers: int, chunks: int, group: int, worker: int) -> tuple[Item, ...]:
    """Worker `worker`'s ZB-V order for one batch of `group` microbatches (see the module's text);
    `chunks` is 2 (the V placement)."""
    p, r, m = workers, worker, group
    n = max(2 * p - 1, m)
    first, second = r, 2 * p - 1 - r
    count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}
    order: list[Item] = []

    def run(kind: str, chunk: int, counter: str | None = None) -> None:
        key = counter or f"{kind}{chunk}"
        order.append((kind, first if chunk == 0 else second, count[key]))
        if counter is None or kind != "W":
            count[key] += 1

    for _ in range(2 * (p - r) - 1):
        run("F", 0)
    for _ in range(r):
        run("F", 1)
        run("F", 0)
    for _ in range(p - r):
        run("F", 1)
        order.append(("B", second, count["B1"]))
        order.append(("W", second, count["B1"]))
        count["B1"] += 1
    while count["F1"] < count["F0"] or count["F0"] < n:
        if count["F0"] < n:
            run("F", 0)
        order += [("B", first, count["B0"]), ("W", first, count["B0"])]
        count["B0"] += 1
        run("F", 1)
        order += [("B", second, count["B1"]), ("W", second, count["B1"])]
        count["B1"] += 1
    w0, w1 = count["B0"], count["B1"]
    for _ in range(r):
        run("B", 0)
        run("B", 1)
    for _ in range(p - r):
        run("B", 0)
        order.append(("W", first, w0))
        w0 += 1
    order += [("W", second, b) for b in range(w1, count["B1"])]
    order += [("W", first, b) for b in range(w0, count["B0"])]
    return tuple(item for item in order if item[2] < m)


def dualpipev(workers: int, chunks: int, group: int, worker: int) -> tuple[Item, ...]:
    """Worker `worker`'s DualPipeV order for one batch of `group` >= 2p microbatches (see the
    module's text); a backward followed later by a W of its microbatch computes the input
    gradients only."""
    p, r, m = workers, worker, group
    first, second = r, 2 * p - 1 - r
    done: dict[tuple[str, int], int] = {}
    pending: list[tuple[int, int]] = []  # (stage, microbatch) of split backwards whose W is to come
    order: list[Item] = []

    def run(kind: str, stage: int, split: bool = False) -> None:
        b = done.get((kind, stage), 0)
        done[(kind, stage)] = b + 1
        order.append((kind, stage, b))
        if split:
            pending.append((stage, b))

    def weights() -> None:
        if pending:
            order.append(("W",) + pending.pop(0))

    for _ in range((p - r - 1) * 2):
        run("F", first)
    for _ in range(r + 1):
        run("F", first)
        run("F", second)
    for _ in range(p - r - 1):
        run("B", second, split=True)
        weights()
        run("F", second)
    for _ in range(m - 2 * p + r + 1):  # a forward of one chunk beside the backward of the other, both ways
        run("F", first)
        run("B", second)
        run("F", second)
        run("B", first)
    for _ in range(p - r - 1):
        run("B", second)
        run("F", second)
        run("B", first)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        run("B", second, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        run("B", first, split)
    for _ in range(p - r - 1):
        weights()
        run("B", first, split)
    for _ in range(r + 1):
        weights()
    return tuple(order)


ORDERS = {"interleaved": interleaved, "zbv": zbv, "dualpipev": dualpipev}
"""Mode name -> its order function, for the modes whose rows have a placement (`Mode.placement`)."""


@functools.lru_cache(maxsize=256)
def depths(mode: str, workers: int, chunks: int, group: int) -> dict[int, int]:
    """Per stage: the most microbatches it holds in flight (forward done, last backward part not:
    the W where the order has one) in `mode`'s order for one batch of `group`."""
    found: dict[int, int] = {}
    for worker in range(workers):
        order = ORDERS[mode](workers, chunks, group, worker)
        split = {(stage, b) for kind, stage, b in order if kind == "W"}
        held: dict[int, int] = {}
        for kind, stage, b in order:
            ends = kind == "W" or (kind == "B" and (stage, b) not in split)
            held[stage] = held.get(stage, 0) + (1 if kind == "F" else -1 if ends else 0)
            found[stage] = max(found.get(stage, 0), held[stage])
    return found
