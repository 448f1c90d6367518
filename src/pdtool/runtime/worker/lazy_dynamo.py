"""torch._dynamo in a worker, imported only if the worker compiles something.

Importing torch._dynamo takes about 2.7 s of a core on this machine (half the start-up of a small
`pd train`: its workers' forkserver imported it so that no worker would import it at its first
optimizer step). A worker compiles nothing, and eager torch reaches dynamo for two things only:
torch.optim's `step` wrapper calls `torch._dynamo.graph_break()` (a no-op outside a compilation)
and `torch._disable_dynamo` asks `torch._dynamo.disable(fn)` for a version of `fn` that dynamo will
not trace (`fn` itself where nothing is traced). `install()` puts a module in dynamo's place that
answers those two, and imports the real torch._dynamo the first time anything else is asked of
it, which from then on serves every caller (`torch._dynamo` is looked up on each use).

What that can miss: a function `torch._disable_dynamo` wrapped before a later real import stays
traceable by a `torch.compile` that the worker's own code (a user's optimizer factory) then runs;
pdtool's workers never compile.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

NAME = "torch._dynamo"


def _graph_break() -> None:
    """torch._dynamo.graph_break outside a compilation: nothing."""


def _disable(fn=None, recursive: bool = True, *, reason=None, wrapping: bool = True):
    """torch._dynamo.disable where nothing is traced: the function itself (or a decorator that
    returns it)."""
    return fn if fn is not None else (lambda f: f)


class _TraceRules(types.SimpleNamespace):
    """torch._dynamo.trace_rules before dynamo is imported: `init_process_group` clears its caches
    (there are none yet); anything else imports the real one."""

    @staticmethod
    def clear_lru_cache() -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(_real().trace_rules, name)


class _Standin(types.ModuleType):
    EAGER = {"graph_break": _graph_break, "disable": _disable, "is_compiling": lambda: False,
             "trace_rules": _TraceRules()}

    def __getattr__(self, name: str):
        if name.startswith("__") and name != "__path__":  # __path__: importing a submodule (a real use)
            raise AttributeError(name)
        if name in self.EAGER and sys.modules.get(NAME) is self:
            return self.EAGER[name]
        return getattr(_real(), name)


def _real() -> types.ModuleType:
    """The real torch._dynamo, imported in place of the stand-in."""
    import torch

    module = sys.modules.get(NAME)
    if isinstance(module, _Standin):
        del sys.modules[NAME]
        if torch.__dict__.get("_dynamo") is module:
            del torch._dynamo
        module = importlib.import_module(NAME)  # also sets torch._dynamo
    return module


def install() -> None:
    """Put the stand-in where `import torch._dynamo` finds it, unless dynamo is imported already."""
    import torch

    if NAME in sys.modules:
        return
    standin = _Standin(NAME, __doc__)
    standin.__spec__ = importlib.machinery.PathFinder.find_spec(NAME, torch.__path__)  # found, not run
    standin.__file__ = standin.__spec__.origin  # inspect.getmodule asks every module for it
    sys.modules[NAME] = standin
    torch._dynamo = standin
