"""Evaluation through the pipeline itself (`pd train --eval-every N`, `--evaluate`).

At each evaluation point the pipeline is drained (the schedule drains there, as at a periodic
checkpoint: `runtime.run.drain_every`), and the held-out split runs forward through the first
replica of every stage, one minibatch of the training's size at a time (the last partial one
is left out: messages have the captured shapes), on the live weights, in eval mode (no dropout;
batch norm on its running statistics), without gradients. Stage 0 makes the minibatches; each
stage sends its outputs and the target on as a training forward does; the last stage adds up
the loss (the model's loss function, weighted by samples) and the top-1 accuracy (where the
output's last dimension scores the classes of an integer target), and reports them per round.
No process holds more than its stage, and nothing is gathered.

The evaluation ops are added to the worker's lowered ops (`schedule.lower`), so the receives
are posted in order with the training's (`comm.Prefetch`); their messages have keys after every
training minibatch of the run (a round r's minibatch i: `minibatches + r * batches + i`), so
they never meet a training message's. The simulator and the schedule's checks do not see them:
the time an evaluation takes is measured, not predicted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...schedule import ACTIVATION
from ...schedule.lower import Op


@dataclass(frozen=True)
class Evaluation:
    """The run's evaluation points: `points` (minibatches of this run done before each round),
    `batches` (held-out minibatches a round), `minibatches` (the run's training minibatches: the
    rounds' message keys come after them) and `source` (stage 0's held-out minibatches; None on
    other stages)."""

    points: tuple[int, ...]
    batches: int
    minibatches: int
    source: object | None = None

    def round_of(self, key: int) -> tuple[int, int]:
        """(round, held-out minibatch) of an evaluation op's message key."""
        return divmod(key - self.minibatches, self.batches)


def with_evaluations(ops: tuple[Op, ...], mine: Sequence[int], replica: int, first_ranks: Sequence[int],
                     evaluation: Evaluation) -> tuple[Op, ...]:
    """`ops` of the worker running `replica` of the stages `mine` (one, or a worker's chunks in
    order) with each round's evaluation ops before the first op of a minibatch at or after its
    point (or at the end): on the first replica, per held-out minibatch and for each of its stages
    in order, a `recv` from the previous stage's first replica, the `E` and a `send` to the next
    stage's, where that stage is on another worker (between two chunks of one worker the outputs
    are handed over in the process). Other replicas take no part."""
    if replica != 0 or not evaluation.points or not evaluation.batches:
        return ops
    rank = first_ranks[mine[0]]
    last = len(first_ranks) - 1

    def round_ops(r: int) -> list[Op]:
        found = []
        for i in range(evaluation.batches):
            key = evaluation.minibatches + r * evaluation.batches + i
            for stage in mine:
                if stage > 0 and first_ranks[stage - 1] != rank:
                    found.append(Op(kind="recv", stage=stage, minibatch=key, peer=first_ranks[stage - 1],
                                    direction=ACTIVATION))
                found.append(Op(kind="E", stage=stage, minibatch=key))
                if stage < last and first_ranks[stage + 1] != rank:
                    found.append(Op(kind="send", stage=stage, minibatch=key, peer=first_ranks[stage + 1],
                                    direction=ACTIVATION))
        return found

    result: list[Op] = []
    r = 0
    for op in ops:
        while r < len(evaluation.points) and op.minibatch is not None and op.minibatch >= evaluation.points[r]:
            result += round_ops(r)
            r += 1
        result.append(op)
    while r < len(evaluation.points):
        result += round_ops(r)
        r += 1
    return tuple(result)


class Scores:
    """The last stage's sums over one round: loss x samples, correct predictions, predictions, samples."""

    def __init__(self):
        self.loss = 0.0
        self.correct = self.predictions = self.samples = 0
        self.began: float | None = None

    def add(self, loss: float, correct: int | None, predictions: int, samples: int) -> None:
        self.loss += loss * samples
        self.samples += samples
        if correct is not None:
            self.correct += correct
            self.predictions += predictions

    def result(self) -> tuple[float, float | None, int]:
        """(mean loss, accuracy or None, samples)."""
        accuracy = self.correct / self.predictions if self.predictions else None
        return self.loss / max(self.samples, 1), accuracy, self.samples
