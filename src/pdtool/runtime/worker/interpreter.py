"""The worker's loop: one worker's lowered ops (`schedule.lower`) executed in order.

One of the three interpreters of a schedule, beside the simulator (`simulate._Run`) and the
message-protocol replay of the tests: `Interpreter` has one method per kind of op (`recv`,
`send`, `forward`, `backward`, `weight_backward`, `allreduce`, `tie`, `step`), run by `run`.
Before each op it posts the receives that enter the prefetch window (`comm.Prefetch`). Every F,
B, W and step becomes an event of the worker's report (name, start, end in epoch seconds, each
end taken after the device's queued work), which the trace and the busy time read.
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
from ...schedule.lower import Op, collective_key
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
    saver: object | None
    first: int
    show_progress: bool
    batch_size: int
    norm: Callable[[StageWorker], float] | None = None  # the whole model's gradient norm, where stages step together
    publish: Callable[[dict], None] | None = None  # live metrics: sends what each step adds (`launcher.live`)
    evaluation: Evaluation | None = None  # where the run evaluates through the pipeline (`worker.evaluation`)
    held_out: Callable[[int], tuple] | None = None  # stage 0: held-out minibatch -> (inputs, target) on the device


class Interpreter:
    """The state of one worker's loop: what it received and has yet to send, the minibatch it
    made ahead, the report it fills. `run` executes the ops in order, one method each."""

    def __init__(self, worker: StageWorker, context: Context):
        self.worker, self.context = worker, context
        self.s = s = worker.index
        self.last = s == context.schedule.stages - 1
        self.incoming = {d: incoming_specs(context.specs, s, d) for d in (ACTIVATION, GRADIENT)}
        self.report = WorkerReport(rank=worker.rank, stage=s, replica=worker.replica)
        self.start = time.perf_counter()
        self.sync = synchronizer(context.link.device)
        self.progress = (_TrainProgress(context.first + context.schedule.minibatches, context.batch_size)
                         if context.show_progress and self.last and worker.replica == 0 else None)
        # The input stage makes the minibatch of its next forward before it waits for a gradient: the
        # making overlaps the wait and leaves the path gradient -> backward -> forward -> next stage
        # (bench/train_speed.py model, 3 paired runs of 160 minibatches: 1.1-1.4 ms per minibatch less).
        self.made: dict[int, tuple] = {}
        self.upcoming = _next_forwards(context.ops) if s == 0 and not self.last else None
        self.inbox: dict[tuple[int, int], list] = {}   # (direction, minibatch) -> tensors received
        self.outbox: dict[tuple[int, int], list] = {}  # (direction, minibatch) -> tensors to send
        self.prefetch = Prefetch(context.ops, context.link.window)
        self.step_began = 0.0
        self.sent = (0, 0, set(), set(), 0)  # published so far: events, steps, losses, finished minibatches, evals
        self.at = 0  # index of the op being run
        self.kinds = {"recv": self.recv, "send": self.send, "F": self.forward, "B": self.backward,
                      "W": self.weight_backward, "allreduce": self.allreduce, "tie": self.tie, "step": self.step,
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

    def post(self, recvs: list[Op]) -> None:
        """Post the receives of the recv ops that enter the prefetch window."""
        for ahead in recvs:
            self.context.link.post_recv((ahead.direction, ahead.minibatch), ahead.peer,
                                        self.incoming[ahead.direction], ahead.direction)

    def recv(self, op: Op) -> None:
        """Wait for a message (the input stage first makes the minibatch of its next forward)."""
        upcoming = self.upcoming
        if upcoming is not None and upcoming[self.at] is not None and upcoming[self.at] not in self.made:
            self.made[upcoming[self.at]] = self.context.batch(upcoming[self.at])
        self.inbox[(op.direction, op.minibatch)] = self.context.link.wait_recv((op.direction, op.minibatch))

    def send(self, op: Op) -> None:
        self.context.link.send(self.outbox.pop((op.direction, op.minibatch)), op.peer, op.minibatch, op.direction)

    def forward(self, op: Op) -> None:
        """F: the minibatch's inputs (made, or received with its target), the forward, its outputs
        and the target into the outbox; on the last stage a loss that is not finite ends the run."""
        b, s = op.minibatch, self.s
        if s == 0:
            inputs, target = self.made.pop(b) if b in self.made else self.context.batch(b)
            values = dict(zip(self.worker.stage.inputs, inputs))
        else:
            values, target = self._received(b)
        began = self.clock()
        out = self.worker.forward(b, values, target)
        self.report.events.append((f"{s}F{b}", began, self.clock()))
        if self.last and not math.isfinite(out):
            self.diverged(b, out)
        if not self.last:
            self.outbox[(ACTIVATION, b)] = self._message(out, target)

    def _received(self, b: int) -> tuple[dict, Any]:
        """The previous stage's outputs for minibatch b by name, and the target they came with
        (None where the data has none: a model that computes its own loss from its inputs)."""
        received = self.inbox.pop((ACTIVATION, b))
        outputs = self.context.specs[self.s - 1]
        return ({t.name: x for t, x in zip(outputs, received)},
                received[-1] if len(received) > len(outputs) else None)

    def _message(self, out: dict, target: Any) -> list:
        """What goes on to the next stage: this stage's outputs, then the target if there is one."""
        return [out[t.name] for t in self.context.specs[self.s]] + ([] if target is None else [target])

    def evaluate(self, op: Op) -> None:
        """E: a held-out minibatch through this stage (`worker.evaluation`); the last stage adds up
        the round's loss and accuracy and, after its last minibatch, reports the round."""
        evaluation, s = self.context.evaluation, self.s
        r, i = evaluation.round_of(op.minibatch)
        if s == 0:
            inputs, target = self.context.held_out(i)
            values = dict(zip(self.worker.stage.inputs, inputs))
        else:
            values, target = self._received(op.minibatch)
        began = self.clock()
        out = self.worker.evaluate(values, target)
        self.report.events.append((f"{s}E{i}", began, self.clock()))
        if not self.last:
            self.outbox[(ACTIVATION, op.minibatch)] = self._message(out, target)
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

    def diverged(self, b: int, loss: float) -> None:
        first = self.context.first
        step = (first + b) // minibatches_per_step(self.context.schedule) + 1
        where = f"the loss became {loss} at step {step} (minibatch {first + b}, last stage {self.s})"
        if self.worker.precision == "fp16" and b < minibatches_per_step(self.context.schedule):
            raise LaunchError(f"{where}, the run's first step: the forward overflowed fp16's range (at most 65504; "
                              "loss scaling guards only the gradients), training did not diverge; train with "
                              "--precision bf16 (fp32's range in half the bytes) or fp32")
        raise LaunchError(f"{where}: training diverged; lower --lr, then --resume from the last checkpoint (written "
                          "before this step, it is kept)")

    def backward(self, op: Op) -> None:
        """B: the received output gradients (none on the last stage), the backward, its input
        gradients into the outbox (zeros for an input that got none)."""
        b, s, first = op.minibatch, self.s, self.context.first
        grads = (None if self.last else
                 {t.name: g for t, g in zip(self.incoming[GRADIENT], self.inbox.pop((GRADIENT, b)))})
        began = self.clock()
        input_grads = self.worker.backward(b, grads, op.weights)
        self.report.events.append((f"{s}B{b}", began, self.clock()))
        if self.last:
            self.report.finished[first + b] = self.report.events[-1][2]
            if self.progress is not None:
                self.progress.update(first + b, self.worker.losses.get(b), self.worker.stepper.lr_now())
        if s > 0:
            device = self.context.link.device
            self.outbox[(GRADIENT, b)] = [input_grads.get(t.name, torch.zeros(t.shape, dtype=t.dtype, device=device))
                                          for t in self.context.specs[s - 1] if t.dtype.is_floating_point]

    def weight_backward(self, op: Op) -> None:
        """W: the weight gradients of a minibatch whose B computed only the input gradients."""
        began = self.clock()
        self.worker.weight_backward(op.minibatch)
        self.report.events.append((f"{self.s}W{op.minibatch}", began, self.clock()))

    def allreduce(self, op: Op) -> None:
        """The replicas' gradient mean; the step's event begins here."""
        self.step_began = self.clock()
        self.context.collectives[collective_key(op)](self.worker)

    def tie(self, op: Op) -> None:
        """The sum of the gradients of weights shared with other stages."""
        self.context.collectives[collective_key(op)](self.worker)

    def step(self, op: Op) -> None:  # noqa: ARG002 - every op's method takes its op
        """The optimizer step, then the checkpoint that falls after it (replica 0 saves)."""
        norm = self.context.norm
        self.worker.stepper.finish_step(norm(self.worker) if norm is not None else None)
        self.report.events.append((f"{self.s}U", self.step_began, self.clock()))
        self.report.step_memory.append((self.report.events[-1][2], memory.in_use(self.context.link.device)))
        self.report.step_log.append((self.report.events[-1][2],) + self.worker.stepper.step_log[-1])
        began = self.clock()
        saver = self.context.saver
        if saver is not None and saver.after_step():
            self.report.events.append(("checkpoint", began, self.clock()))  # shows in the trace, counts as busy
        if self.context.publish is not None:
            self.publish(done=False)

    def publish(self, done: bool) -> None:
        """What the report gained since the last call, to the launcher's live metrics."""
        report, first = self.report, self.context.first
        events, steps, losses, finished, evals = self.sent
        fresh = {first + b: loss for b, loss in self.worker.losses.items() if first + b not in losses}
        ended = {b: t for b, t in report.finished.items() if b not in finished}
        self.context.publish({
            "events": [(s, e) for _, s, e in report.events[events:]], "memory": report.step_memory[steps:],
            "log": report.step_log[steps:], "losses": fresh, "finished": ended, "evals": report.evals[evals:],
            "done": done})
        self.sent = (len(report.events), len(report.step_log), losses | set(fresh), finished | set(ended),
                     len(report.evals))

    def finish(self) -> WorkerReport:
        """Wait for the last sends; the losses, busy and wall time into the report."""
        self.context.link.flush()
        if self.context.publish is not None:
            self.publish(done=True)
        if self.progress is not None:
            self.progress.close()
        report, first = self.report, self.context.first
        report.losses = {first + b: loss for b, loss in self.worker.losses.items()}
        report.busy_s = sum(end - began for _, began, end in report.events)
        report.wall_s = time.perf_counter() - self.start
        return report


def _next_forwards(ops) -> list[int | None]:
    """For each op index, the minibatch of the first forward after it (None: no more)."""
    following: list[int | None] = [None] * len(ops)
    nxt = None
    for i in range(len(ops) - 1, -1, -1):
        following[i] = nxt
        if ops[i].kind == "F":
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
