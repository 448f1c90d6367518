"""The worker's loop: one worker's lowered ops (`schedule.lower`) executed in order.

One of the three interpreters of a schedule, beside the simulator (`simulate._Run`) and the
message-protocol replay of the tests: `Interpreter` has one method per kind of op (`recv`,
`send`, `forward`, `backward`, `weight_backward`, `allreduce`, `tie`, `reduce`, `step`), run by `run`.
Before each op it posts the receives that enter the prefetch window (`comm.Prefetch`). Every F,
B, W and step becomes an event of the worker's report (name, start, end in epoch seconds, each
end taken after the device's queued work), which the trace and the busy time read.

A worker of several stages (a plan's placement, `schedule.placement`) runs one `StageWorker` a
stage: each op goes to its stage's, and what one of its stages hands the next one of its own
stays in the process (no send or recv op names it). A message's key is (direction, slot), the
slot its minibatch times the chunks a worker holds plus the chunk its boundary belongs to, so
that the messages of several boundaries for one minibatch on one link stay apart.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...errors import LaunchError
from ...schedule import ACTIVATION, GRADIENT, Schedule
from ...schedule.lower import Op, boundary, collective_key
from ..device import synchronizer
from ..run import WorkerReport, minibatches_per_step
from . import memory
from .comm import BoundaryTensor, Link, Prefetch, incoming_specs
from .evaluation import Evaluation, Scores
from .executor import StageWorker


@dataclass(frozen=True, kw_only=True)
class Context:
    """What one worker's loop runs with: its `schedule` and lowered `ops`, every stage's
    boundary `specs` (from the launcher's capture, `model.capture`), `batch` (minibatch -> (inputs, target) on the
    device, minibatches counted from `first`, the run's first), its `collectives` (by
    `collective_key`), its `link` to its neighbours, its checkpoint `saver` (None: none), and
    whether it shows the progress line (`show_progress`, of `batch_size` samples a minibatch), and
    `norm`, which measures the whole model's gradient norm across the stages (`--clip-grad-norm`
    in the modes whose stages step together; None: the worker clips on its own or not at all), and
    `publish`, which sends the launcher what each of its steps adds to the report (live metrics), and
    its `evaluation` (with stage 0's `held_out` minibatches), the rounds of `E` ops among its ops."""

    schedule: Schedule
    ops: tuple[Op, ...]
    specs: list[list[BoundaryTensor]]
    batch: Callable[[int], tuple]
    collectives: dict
    link: Link
    saver: object | None  # one StageWorker's; a worker of several stages: a dict of them by stage
    first: int
    show_progress: bool
    batch_size: int
    norm: Callable[[list[StageWorker]], float] | None = None  # the whole model's gradient norm (its stages')
    publish: Callable[[dict], None] | None = None  # live metrics: sends what each step adds (`launcher.live`)
    evaluation: Evaluation | None = None  # where the run evaluates through the pipeline (`worker.evaluation`)
    held_out: Callable[[int], tuple] | None = None  # stage 0: held-out minibatch -> (inputs, target) on the device


class Interpreter:
    """The state of one worker's loop: what it received and has yet to send, the minibatch it
    made ahead, the report it fills. `run` executes the ops in order, one method each, each on
    the `StageWorker` of its stage (`workers`: one, or one a stage of a worker of several)."""

    def __init__(self, workers: StageWorker | dict[int, StageWorker], context: Context):
        self.workers = workers if isinstance(workers, dict) else {workers.index: workers}
        self.context = context
        first = self.workers[min(self.workers)]
        self.final = context.schedule.stages - 1  # the last stage's index
        self.incoming = {(s, d): incoming_specs(context.specs, s, d) for s in self.workers for d in (ACTIVATION, GRADIENT)}
        self.report = WorkerReport(rank=first.rank, stage=first.index, replica=first.replica)
        self.start = time.perf_counter()
        self.sync = synchronizer(context.link.device)
        self.progress = (_TrainProgress(context.first + context.schedule.minibatches, context.batch_size)
                         if context.show_progress and self.final in self.workers and first.replica == 0 else None)
        schedule = context.schedule
        self.chunks = schedule.stages // schedule.worker_count if schedule.placement else 1
        self.workers_count = schedule.worker_count
        # The input stage makes the minibatch of its next forward while it would wait for a message
        # (not when the message is already here: then the making would only delay what follows): the
        # making fills the wait and leaves the path message -> backward -> forward -> next stage
        # (bench/train_speed.py model, 3 paired runs of 160 minibatches: 1.1-1.4 ms per minibatch less).
        self.made: dict[int, tuple] = {}
        self.upcoming = _next_forwards(context.ops) if 0 in self.workers and schedule.stages > 1 else None
        self.norms: dict[int, float] = {}  # step of stage 0's count -> the whole model's gradient norm
        self.inbox: dict[tuple[int, int], list] = {}   # (direction, minibatch) -> tensors received
        self.outbox: dict[tuple[int, int], list] = {}  # (direction, minibatch) -> tensors to send
        self.prefetch = Prefetch(context.ops, context.link.window)
        self.step_began = 0.0
        self.sent = (0, 0, set(), set(), 0)  # published so far: events, steps, losses, finished minibatches, evals
        self.at = 0  # index of the op being run
        self.kinds = {"recv": self.recv, "send": self.send, "F": self.forward, "B": self.backward,
                      "W": self.weight_backward, "allreduce": self.allreduce, "tie": self.tie, "reduce": self.reduce,
                      "step": self.step,
                      "E": self.evaluate}
        self.scores: Scores | None = None  # the last stage's sums of the evaluation round under way

    def run(self) -> WorkerReport:
        """Execute the ops in order; the report once the last message is sent."""
        for i, op in enumerate(self.context.ops):
            self.at = i
            self.post(self.prefetch.fresh[i])
            self.kinds[op.kind](op)
        return self.finish()

    def clock(self) -> float:
        """Wall time after the device's queued work: events cover the work they name."""
        self.sync()
        return time.time()

    def slot(self, minibatch: int, joins: int) -> int:
        """The key of a message of `minibatch` across the boundary `joins` (below stage joins + 1):
        the minibatch where a worker holds one stage, else also which of its chunks it is."""
        return minibatch * self.chunks + joins // self.workers_count

    def key(self, op: Op) -> tuple[int, int]:
        return op.direction, self.slot(op.minibatch, boundary(op))

    def post(self, recvs: list[Op]) -> None:
        """Post the receives of the recv ops that enter the prefetch window."""
        for ahead in recvs:
            self.context.link.post_recv(self.key(ahead), ahead.peer, self.incoming[(ahead.stage, ahead.direction)],
                                        ahead.direction)

    def recv(self, op: Op) -> None:
        """Wait for a message; where it is not here yet, the input stage first makes the minibatch
        of its next forward."""
        key, upcoming = self.key(op), self.upcoming
        b = upcoming[self.at] if upcoming is not None else None
        if b is not None and b not in self.made and not self.context.link.arrived(key):
            self.made[b] = self.context.batch(b)
        self.inbox[key] = self.context.link.wait_recv(key)

    def send(self, op: Op) -> None:
        key = self.key(op)
        self.context.link.send(self.outbox.pop(key), op.peer, key[1], op.direction)

    def _hand_on(self, direction: int, b: int, joins: int, tensors: list, stage: int) -> None:
        """A message for `stage`: into the inbox where this worker runs that stage too, else the outbox."""
        box = self.inbox if stage in self.workers else self.outbox
        box[(direction, self.slot(b, joins))] = tensors

    def forward(self, op: Op) -> None:
        """F: the minibatch's inputs (made, or received with its target), the forward, its outputs
        and the target on to the next stage; on the last stage a loss that is not finite ends the run."""
        b, s = op.minibatch, op.stage
        worker = self.workers[s]
        if s == 0:
            inputs, target = self.made.pop(b) if b in self.made else self.context.batch(b)
            values = dict(zip(worker.stage.inputs, inputs))
        else:
            values, target = self._received(s, b)
        began = self.clock()
        out = worker.forward(b, values, target)
        self.report.events.append((f"{s}F{b}", began, self.clock()))
        if s == self.final and not math.isfinite(out):
            self.diverged(s, b, out)
        if s != self.final:
            self._hand_on(ACTIVATION, b, s, self._message(s, out, target), s + 1)

    def _received(self, s: int, b: int) -> tuple[dict, Any]:
        """Stage s-1's outputs for minibatch b by name, and the target they came with (None where
        the data has none: a model that computes its own loss from its inputs)."""
        received = self.inbox.pop((ACTIVATION, self.slot(b, s - 1)))
        outputs = self.context.specs[s - 1]
        return ({t.name: x for t, x in zip(outputs, received)},
                received[-1] if len(received) > len(outputs) else None)

    def _message(self, s: int, out: dict, target: Any) -> list:
        """What goes on to the next stage: stage s's outputs, then the target if there is one."""
        return [out[t.name] for t in self.context.specs[s]] + ([] if target is None else [target])

    def evaluate(self, op: Op) -> None:
        """E: a held-out minibatch through this stage (`worker.evaluation`); the last stage adds up
        the round's loss and accuracy and, after its last minibatch, reports the round."""
        evaluation, s = self.context.evaluation, op.stage
        worker = self.workers[s]
        r, i = evaluation.round_of(op.minibatch)
        if s == 0:
            inputs, target = self.context.held_out(i)
            values = dict(zip(worker.stage.inputs, inputs))
        else:
            values, target = self._received(s, op.minibatch)
        began = self.clock()
        out = worker.evaluate(values, target)
        self.report.events.append((f"{s}E{i}", began, self.clock()))
        if s != self.final:
            self._hand_on(ACTIVATION, op.minibatch, s, self._message(s, out, target), s + 1)
            return
        if i == 0:
            self.scores = Scores()
            self.scores.began = began
        self.scores.add(*out)
        if i == evaluation.batches - 1:
            loss, accuracy, samples = self.scores.result()
            step = self.context.first // minibatches_per_step(self.context.schedule) + \
                evaluation.points[r] // minibatches_per_step(self.context.schedule)
            self.report.evals.append((step, loss, accuracy, samples, self.scores.began, self.clock()))
            if self.progress is not None:
                self.progress.evaluated(step, loss, accuracy, samples)

    def diverged(self, s: int, b: int, loss: float) -> None:
        first = self.context.first
        step = (first + b) // minibatches_per_step(self.context.schedule) + 1
        where = f"the loss became {loss} at step {step} (minibatch {first + b}, last stage {s})"
        if self.workers[s].precision == "fp16" and b < minibatches_per_step(self.context.schedule):
            raise LaunchError(f"{where}, the run's first step: the forward overflowed fp16's range (at most 65504; "
                              "loss scaling guards only the gradients), training did not diverge; train with "
                              "--precision bf16 (fp32's range in half the bytes) or fp32")
        raise LaunchError(f"{where}: training diverged; lower --lr, then --resume from the last checkpoint (written "
                          "before this step, it is kept)")

    def backward(self, op: Op) -> None:
        """B: the received output gradients (none on the last stage), the backward, its input
        gradients into the outbox (zeros for an input that got none)."""
        b, s, first = op.minibatch, op.stage, self.context.first
        worker = self.workers[s]
        grads = (None if s == self.final else {t.name: g for t, g in zip(self.incoming[(s, GRADIENT)],
                                                                          self.inbox.pop((GRADIENT, self.slot(b, s))))})
        began = self.clock()
        input_grads = worker.backward(b, grads, op.weights)
        self.report.events.append((f"{s}B{b}", began, self.clock()))
        if s == self.final:
            self.report.finished[first + b] = self.report.events[-1][2]
            if self.progress is not None:
                self.progress.update(first + b, worker.losses.get(b), worker.stepper.lr_now())
        if s > 0:
            device = self.context.link.device
            self._hand_on(GRADIENT, b, s - 1, [input_grads.get(t.name, torch.zeros(t.shape, dtype=t.dtype, device=device))
                                               for t in self.context.specs[s - 1] if t.dtype.is_floating_point], s - 1)

    def weight_backward(self, op: Op) -> None:
        """W: the weight gradients of a minibatch whose B computed only the input gradients."""
        began = self.clock()
        self.workers[op.stage].weight_backward(op.minibatch)
        self.report.events.append((f"{op.stage}W{op.minibatch}", began, self.clock()))

    def allreduce(self, op: Op) -> None:
        """The replicas' gradient mean; the step's event begins here."""
        self.step_began = self.clock()
        self.context.collectives[collective_key(op)](self.workers[op.stage])

    def tie(self, op: Op) -> None:
        """The sum of the gradients of weights shared with other stages."""
        self.context.collectives[collective_key(op)](self.workers[op.stage])

    def reduce(self, op: Op) -> None:
        """`--shard gradients`: the replicas' sum of what the backward left to reduce (an empty
        one: zeros, `worker.gradient_shard`)."""
        reducer = self.workers[op.stage].stepper.reducer
        if reducer is not None:  # a stage without parameters has nothing to reduce (and no replica of it has)
            reducer.flush(real=op.weights)

    def step(self, op: Op) -> None:
        """The optimizer step, then the checkpoint that falls after it (replica 0 saves). The whole
        model's norm (clipping across stages) is measured once a step, over every stage of the worker."""
        worker = self.workers[op.stage]
        norm = self.context.norm
        if norm is not None:
            done = len(worker.stepper.step_log)
            if done not in self.norms:  # all of this worker's stages finished the step's backwards before its first U
                self.norms = {done: norm(list(self.workers.values()))}
            norm = self.norms[done]
        worker.stepper.finish_step(norm)
        self.report.events.append((f"{op.stage}U", self.step_began, self.clock()))
        self.report.step_memory.append((self.report.events[-1][2], memory.in_use(self.context.link.device)))
        self.report.step_log.append((self.report.events[-1][2],) + worker.stepper.step_log[-1])
        began = self.clock()
        saver = self.context.saver
        if isinstance(saver, dict):
            saver = saver.get(op.stage)
        if saver is not None and saver.after_step():
            self.report.events.append(("checkpoint", began, self.clock()))  # shows in the trace, counts as busy
        if self.context.publish is not None:
            self.publish(done=False)

    def publish(self, done: bool) -> None:
        """What the report gained since the last call, to the launcher's live metrics."""
        report, first = self.report, self.context.first
        events, steps, losses, finished, evals = self.sent
        fresh = {first + b: loss for b, loss in self._losses().items() if first + b not in losses}
        ended = {b: t for b, t in report.finished.items() if b not in finished}
        self.context.publish({
            "events": [(s, e) for _, s, e in report.events[events:]], "memory": report.step_memory[steps:],
            "log": report.step_log[steps:], "losses": fresh, "finished": ended, "evals": report.evals[evals:],
            "done": done})
        self.sent = (len(report.events), len(report.step_log), losses | set(fresh), finished | set(ended),
                     len(report.evals))

    def _losses(self) -> dict[int, float]:
        """The losses so far (the last stage's), by the run's minibatch."""
        return self.workers[self.final].losses if self.final in self.workers else {}

    def finish(self) -> WorkerReport:
        """Wait for the last sends; the losses, busy and wall time into the report."""
        self.context.link.flush()
        if self.context.publish is not None:
            self.publish(done=True)
        if self.progress is not None:
            self.progress.close()
        report, first = self.report, self.context.first
        report.losses = {first + b: loss for b, loss in self._losses().items()}
        report.busy_s = sum(end - began for _, began, end in report.events)
        report.wall_s = time.perf_counter() - self.start
        return report


def _next_forwards(ops) -> list[int | None]:
    """For each op index, the minibatch of the first forward of stage 0 after it (None: no more)."""
    following: list[int | None] = [None] * len(ops)
    nxt = None
    for i in range(len(ops) - 1, -1, -1):
        following[i] = nxt
        if ops[i].kind == "F" and ops[i].stage == 0:
            nxt = ops[i].minibatch
    return following


class _TrainProgress:
    """One line on stderr, at most once a second: minibatches done, loss, samples/s."""

    def __init__(self, total: int, batch_size: int):
        self.total, self.batch_size = total, batch_size
        self.began = self.last = time.monotonic()
        self.done = 0
        self.tty = sys.stderr.isatty()

    def update(self, minibatch: int, loss: float | None, lr: float) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= 1.0 or minibatch + 1 == self.total:
            rate = self.done * self.batch_size / max(now - self.began, 1e-9)
            text = f"minibatch {minibatch + 1}/{self.total}  loss {loss:.4f}  lr {lr:.3g}  {rate:.1f} samples/s"
            sys.stderr.write(f"\r\033[K{text}" if self.tty else text + "\n")
            sys.stderr.flush()
            self.last = now

    def evaluated(self, step: int, loss: float, accuracy: float | None, samples: int) -> None:
        """A line of its own for an evaluation round's result."""
        text = (f"step {step}: held-out loss {loss:.4f}" + (f", accuracy {accuracy:.1%}" if accuracy is not None else "")
                + f" ({samples} samples)")
        sys.stderr.write(f"\r\033[K{text}\n" if self.tty else text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
