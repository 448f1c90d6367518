"""Tied weights: one parameter used by several stages (an embedding and an output head).

Every worker of those stages holds its own copy (`Stage.tied`). In `2bw`, `flush` and `gpipe`
every stage steps once per batch of m microbatches, so before each step the workers of the
sharing stages all-reduce the copies' gradients: each adds its stage's mean gradient divided
by its stage's replicas, and every copy gets the sum of the uses' gradients, as autograd gives
it in one process (Megatron-LM ties its embeddings the same way). The copies start equal (same
seed) and take equal steps, so they stay equal; in `2bw` both sharing stages run batch t on
their version t-1, so the summed gradient is the whole model's at that version. `pipedream`
and `vsync` are refused (by `pd plan`, and by `pd train` for a `--mode` override): they step
each stage after different minibatches, so the copies would drift apart.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..ties import sets



def make_ties(stages, mine, stage_ranks: list[tuple[int, ...]]) -> dict[tuple[int, ...], Callable]:
    """For each set of sharing stages that this worker's stages (`mine`: one, or a worker's
    chunks) belong to, the function its `tie` op runs (`StageWorker` -> None): every copy of a
    shared parameter gets the sum of the copies' gradients, each divided by its stage's replicas:
    this worker's copies added here, then all-reduced over the workers of the set (a worker
    holding every sharing stage, as worker 0 of a V placement holds the first and the last, adds
    them in the process).

    Creates one process group per set of sharing stages (all their workers), on every rank in
    one order, as torch.distributed requires; call it on every rank."""
    groups = {}
    for users in sets(stages):
        ranks = sorted({r for s in users for r in stage_ranks[s]})
        groups[users] = (dist.new_group(ranks), len(ranks))
    copies: dict[tuple[int, ...], dict[str, list]] = {}  # users -> whole-model name -> [(parameter, replicas)]
    for stage in mine:
        params = dict(stage.module.named_parameters())
        replicas = len(stage_ranks[stage.index])
        for name, users in stage.tied.items():
            copies.setdefault(users, {}).setdefault(stage.param_names[name], []).append((params[name], replicas))

    def tie(users: tuple[int, ...]) -> None:
        group, size = groups[users]
        for _, held in sorted(copies[users].items()):  # one order on every rank: the whole-model names
            total = sum((p.grad if p.grad is not None else torch.zeros_like(p)) / replicas for p, replicas in held)
            if size > 1:
                dist.all_reduce(total, group=group)
            for p, _ in held:
                p.grad = total.clone() if len(held) > 1 else total

    return {users: (lambda worker, users=users: tie(users)) for users in copies}
