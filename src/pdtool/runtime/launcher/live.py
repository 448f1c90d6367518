"""Live metrics: `--metrics` rows (and `--tensorboard` scalars) written while the run goes on.

After each of its optimizer steps a worker publishes, in the job's store, what its report gained
since the last time (`Interpreter.publish`: its events, step records, the losses and finish times
of its minibatches), under `pdtool/live/<rank>/<n>` (`peers.publisher`). `LiveMetrics`, a thread of the launcher
that holds the store, collects them twice a second into reports like the workers' own and
appends every row of `views.metrics.metric_rows` whose step every worker has got past, flushed
at once: `tail -f m.csv` and a plot work during the run, and a run that fails keeps the rows of
the steps it finished. At the end `pd train` writes the whole file again from the final reports
(the same rows). Across machines it runs where the store is (node rank 0); under torchrun or
srun, and with `--rdzv-endpoint`, the file is written at the end only.
"""
from __future__ import annotations

import json
import os
import threading

from ...artifacts.plan import Plan
from ...errors import PdtoolError
from ...views.metrics import header, metric_rows, write_settings
from ..peers import LIVE_KEY as KEY
from ...schedule import Run
from ..run import RunConfig, WorkerReport, eval_steps, recorded_settings

POLL_S = 0.5


class LiveMetrics(threading.Thread):
    """The launcher's thread that writes the rows of a running job (see the module docstring)."""

    def __init__(self, store, plan: Plan, config: RunConfig, run: Run, warn=lambda message: None):
        super().__init__(name="pdtool-live-metrics", daemon=True)
        self.warn = warn  # told once per output that cannot be written (a full disk): training goes on
        self.store, self.config = store, config
        places = {r: (s, st.ranks.index(r)) for s, st in enumerate(plan.stages) for r in st.ranks}
        from ..run import TrainResult  # what metric_rows reads, filled as the records arrive

        self.result = TrainResult(plan=plan,
                                  reports={r: WorkerReport(rank=r, stage=s, replica=i) for r, (s, i) in places.items()},
                                  wall_s=0.0, first_step=config.first_step, steps=config.steps, per_step=run.per_step,
                                  eval_steps=eval_steps(config, run.per_step))
        self.next = dict.fromkeys(places, 0)
        self.known = dict.fromkeys(places, 0.0)
        self.rows = 0
        self.halt = threading.Event()
        self.file = None
        self.board = None
        if config.metrics:
            self._writing("--metrics", config.metrics, lambda: self._open(header(sorted(places)),
                                                                          recorded_settings(config, run)))
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writing("--tensorboard", config.tensorboard, lambda: setattr(self, "board",
                                                                               SummaryWriter(config.tensorboard)))

    def _open(self, first: str, settings: dict) -> None:
        write_settings(self.config.metrics, settings)
        self.file = open(self.config.metrics, "w", encoding="utf-8")  # noqa: SIM115 - held for the run's length
        self.file.write(first + "\n")
        self.file.flush()

    def _writing(self, option: str, path: str, write) -> bool:
        """Run `write`; on an OSError (a full disk, a folder gone read-only) warn once and stop
        writing that output for the rest of the run (training goes on; the end of the run says
        what was not written). Whether it was written."""
        try:
            write()
            return True
        except (OSError, PdtoolError) as exc:  # PdtoolError: an atomic write's one line (a full disk)
            self.warn(f"{option} {path}: cannot write it ({getattr(exc, 'strerror', None) or exc}); training goes on, and its rows are "
                      "written again at the end of the run if they can be")
            if option == "--metrics" and self.file is not None:
                try:
                    self.file.close()
                except OSError:
                    pass
            setattr(self, "file" if option == "--metrics" else "board", None)
            return False

    def run(self) -> None:
        while not self.halt.wait(POLL_S):
            self.poll()

    def stop(self) -> None:
        """Collect what is left, write its rows, close the file (the job ended, or failed)."""
        self.halt.set()
        if self.is_alive():
            self.join()
        try:
            self.poll()
        finally:
            if self.file is not None:
                self._writing("--metrics", self.config.metrics, self.file.close)
            if self.board is not None:
                self._writing("--tensorboard", self.config.tensorboard, self.board.close)

    def poll(self) -> None:
        try:
            for rank in self.next:
                while self.store.check([KEY.format(rank=rank, n=self.next[rank])]):
                    key = KEY.format(rank=rank, n=self.next[rank])
                    self._add(rank, json.loads(self.store.get(key)))
                    self.store.delete_key(key)
                    self.next[rank] += 1
        except Exception:  # noqa: BLE001 - the store went away with the job: the final write has everything
            return
        for row, values in metric_rows(self.result, self.rows, self.known):
            self.rows += 1
            if self.file is not None:
                self._writing("--metrics", self.config.metrics, lambda: self._row(row))
            if self.board is not None:
                self._writing("--tensorboard", self.config.tensorboard, lambda: self._scalars(values))

    def _row(self, row: str) -> None:
        self.file.write(row + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def _scalars(self, values: dict) -> None:
        for name in ("loss", "lr", "grad_norm", "samples_per_s"):
            if values[name] is not None:
                self.board.add_scalar(f"train/{name}", values[name], values["step"])
        for name in ("eval_loss", "eval_accuracy"):
            if values.get(name) is not None:
                self.board.add_scalar(f"eval/{name[5:]}", values[name], values["step"])
        self.board.flush()

    def _add(self, rank: int, record: dict) -> None:
        report = self.result.reports[rank]
        report.events.extend(("", s, e) for s, e in record["events"])
        report.step_memory.extend(tuple(m) for m in record["memory"])
        report.step_log.extend(tuple(entry) for entry in record["log"])
        report.losses.update({int(b): loss for b, loss in record["losses"].items()})
        report.finished.update({int(b): t for b, t in record["finished"].items()})
        report.evals.extend(tuple(entry) for entry in record.get("evals", ()))
        ends = [e for _, e in record["events"]] + [entry[0] for entry in record["log"]]
        self.known[rank] = float("inf") if record["done"] else max([self.known[rank]] + ends)
