"""What the forkserver of `pd train`'s workers imports once (`runtime.launcher.forked`), so that
every worker it forks starts with it imported: torch, torch.distributed, sympy's symbolic shapes
(what a stage built from `meta` tensors imports) and the worker's own modules. torch._dynamo
(2.7 s of a core, which torch.optim's wrappers would import at a worker's first optimizer step)
stands in as `lazy_dynamo` until something needs the real one. Nothing here may initialise CUDA:
a forked process cannot use its parent's CUDA context (importing torch does not initialise it;
`torch.cuda.is_initialized()` stays False)."""
import importlib
import os

MODULES = ("torch", "torch.fx.experimental.symbolic_shapes", "torch.distributed",
           "torch.distributed.elastic.multiprocessing.errors",
           "pdtool.runtime.worker.entry",  # what every worker runs
           "pdtool.runtime.worker.main", "pdtool.runtime.worker.interpreter", "pdtool.runtime.worker.executor",
           "pdtool.model.build", "pdtool.model.capture", "pdtool.model.program")  # its stage (model.capture.own_stage)

from ... import lazy_dynamo  # noqa: E402

lazy_dynamo.install()  # before anything imports torch._dynamo
for _name in MODULES:
    importlib.import_module(_name)

BASE_ENV = dict(os.environ)
"""The forkserver's environment (the launcher's at its first launch): a worker's variables that
differ from it are the ones torch's launcher set for that worker (`entry.LaunchState.restore`)."""
