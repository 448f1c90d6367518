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



def make_ties(stages, stage, stage_ranks: list[tuple[int, ...]]) -> dict[tuple[int, ...], Callable]:
    """For each set of sharing stages that this worker's stage belongs to, the function its
    `tie` op runs (`StageWorker` -> None): all-reduce the shared parameters' gradients.

    Creates one process group per set of sharing stages (all their workers), on every rank in
    one order, as torch.distributed requires; call it on every rank."""
    groups = {users: dist.new_group(sorted(r for s in users for r in stage_ranks[s])) for users in sets(stages)}
    mine: dict[tuple[int, ...], list[str]] = {}
    for name, users in sorted(stage.tied.items()):
        mine.setdefault(users, []).append(name)
    replicas = len(stage_ranks[stage.index])
    params = dict(stage.module.named_parameters())

    def tie(users: tuple[int, ...], worker) -> None:  # noqa: ARG001 - the op's signature
        # the parameters of a set in the order of their whole-model names (own names differ between stages)
        for name in sorted(mine[users], key=lambda n: stage.param_names[n]):
            p = params[name]
            grad = (p.grad if p.grad is not None else torch.zeros_like(p)) / replicas
            dist.all_reduce(grad, group=groups[users])
            p.grad = grad

    return {users: (lambda worker, users=users: tie(users, worker)) for users in mine}
