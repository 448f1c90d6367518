"""What the forkserver of `pd train`'s workers imports once (`runtime.launcher.forked`), so that
every worker it forks starts with it imported: torch, torch._dynamo (which torch.optim's wrappers
import at a worker's first optimizer step; a forkserver `pd train` started early for its one launch
has `lazy_dynamo`'s stand-in there instead: `preload_model`), sympy's symbolic shapes (what a
stage built from `meta` tensors imports) and the worker's own modules. Nothing here may initialise
CUDA: a forked process cannot use its parent's CUDA context (importing torch does not initialise
it; `torch.cuda.is_initialized()` stays False)."""
import importlib
import os

from . import told

MODULES = ("torch", "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "torch.distributed",
           "torch.distributed.elastic.multiprocessing.errors",
           "pdtool.runtime.worker.entry",  # what every worker runs
           "pdtool.runtime.worker.main", "pdtool.runtime.worker.interpreter", "pdtool.runtime.worker.executor",
           "pdtool.model.build", "pdtool.model.capture", "pdtool.model.program")  # its stage (model.capture.own_stage)

for _name in MODULES:
    importlib.import_module(_name)

_told = os.environ.pop(told.VARIABLE, "")  # the launcher's file of modules (`worker.told`), if it names one
if _told:
    told.import_before_each_fork(_told.partition(":")[2])

BASE_ENV = dict(os.environ)
"""The forkserver's environment (the launcher's at its first launch): a worker's variables that
differ from it are the ones torch's launcher set for that worker (`entry.LaunchState.restore`)."""
