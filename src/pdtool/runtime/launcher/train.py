"""`pd train` on the launching side, whoever started the processes: pd train's own launcher
(`job.prepare`: every check before any worker starts, then `session.run`), or torchrun or srun
(`external.train`: this process is one worker, rank 0 does the launcher's part)."""
from __future__ import annotations

from ...artifacts.plan import Plan
from ..run import RunConfig
from .cluster_env import Place
from ..run import Nodes


def train(plan: Plan, config: RunConfig, *, where: Place | None, nodes: Nodes, epochs: int | None = None,
          resume: bool = False, restarts: int = 0, verbose: bool = False, warn=lambda message: None,
          say=lambda message: None, talk=lambda message: None):
    """Train `plan` as `config` says; (`session.TrainResult`, `job.Job`) where this process reports
    (pd train's own launcher, or rank 0 of an external launcher's job), else None. `where`: the
    external launcher's placement of this process (None: pd train starts the workers itself, on
    `nodes`). `warn`, `say` and `talk` hear warnings, notes and what the run is doing."""
    if where is not None:
        from . import external

        return external.train(where, plan, config, epochs=epochs, resume=resume, iface=nodes.interface,
                              verbose=verbose, warn=warn, say=say, talk=talk)
    from . import forked

    local = nodes.nproc_per_node or len(plan.used_ranks) // nodes.nnodes
    forked.start_early(config.device, local)  # first: it imports torch and forks the forkserver before anything of the run exists
    from . import session
    from .job import prepare

    job = prepare(plan, config, epochs=epochs, nnodes=nodes.nnodes, nproc_per_node=nodes.nproc_per_node, warn=warn,
                  imports=lambda modules: forked.warm(config.device, local, modules))
    if job.checked.cached:  # said with the run's first news (an error before it stays the one line)
        talk = _first_saying(talk, f"the model's capture and checks come from {job.checked.cached} (this plan, model "
                                   "and data ran before; PDTOOL_CACHE_DIR=off checks and captures again)")
    result = session.run(job.config, nodes, verbose=verbose, resume=resume, warn=warn, needs=job.checked.parameters,
                         say=say, talk=talk, restarts=restarts, job=job)
    return result, job


def _first_saying(talk, note: str):
    """`talk` that says `note` before the first message it passes on."""
    pending = [note]

    def said(message: str) -> None:
        while pending:
            talk(pending.pop())
        talk(message)
    return said
