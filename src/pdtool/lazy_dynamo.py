"""torch._dynamo in `pd` and the workers, imported only if something needs it.

Importing torch._dynamo takes about 2.7 s of a core on this machine: half the start-up of a small
`pd train` (its workers' forkserver imported it, or every worker would at its first optimizer step)
and of a small `pd profile` (which times an optimizer step). Eager torch asks dynamo for little:
torch.optim's `step` wrapper calls `graph_break()` (a no-op outside a compilation),
`torch._disable_dynamo` asks `disable(fn)` for a version of `fn` that dynamo will not trace (`fn`
itself while nothing can trace), `init_process_group` clears `trace_rules`' caches (there are none
yet). `install()` puts a module in dynamo's place that answers those, and imports the real
torch._dynamo the first time anything else is asked of it (an attribute, `from torch._dynamo
import X`, a submodule; torch.export does), which from then on serves every caller
(`torch._dynamo` is looked up on each use). A function `disable`d before that calls the real
`disable(fn)` from then on. `torch._dynamo.config` (dynamo's settings: a file of its own, which
torch's fake tensors read when they are made) is the real one, loaded when first read, without
the rest of dynamo.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

NAME = "torch._dynamo"
CONFIG = NAME + ".config"


def _graph_break(msg: str = "") -> None:
    """torch._dynamo.graph_break outside a compilation: nothing."""


def _disable(fn=None, recursive: bool = True, *, reason=None, wrapping: bool = True):
    """torch._dynamo.disable before dynamo is imported: `fn` as it is while nothing can trace it,
    the real `disable(fn)` from the first call after the real dynamo was imported."""
    if fn is None:
        return functools.partial(_disable, recursive=recursive, reason=reason, wrapping=wrapping)
    disabled = None

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        nonlocal disabled
        if installed():
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = _real().disable(fn, recursive, reason=reason, wrapping=False)
        return disabled(*args, **kwargs)

    return eager


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
    module = sys.modules.get(NAME)
    if isinstance(module, _Standin):
        del sys.modules[NAME]
        torch = sys.modules.get("torch")
        if torch is not None and torch.__dict__.get("_dynamo") is module:
            del torch._dynamo
        module = importlib.import_module(NAME)  # also sets torch._dynamo
    return module


class _Imported(importlib.abc.Loader):
    """The loader of a submodule the real torch._dynamo imported in the middle of an import of it."""

    def __init__(self, module: types.ModuleType):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    """`import torch._dynamo.exc` with the stand-in in place: Python reads the parent's `__path__`,
    which imports the real package, and with it the submodule; Python would then run the
    submodule's file a second time (two copies of its classes). This finder, first on the meta
    path, hands Python the submodule the real package imported instead."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        module = sys.modules.get(name) if name.startswith(NAME + ".") else None
        return None if module is None else importlib.machinery.ModuleSpec(name, _Imported(module))


def installed() -> bool:
    """Whether torch._dynamo is the stand-in in this process."""
    return isinstance(sys.modules.get(NAME), _Standin)


def install() -> None:
    """Put the stand-in where `import torch._dynamo` (and `torch._dynamo`, through torch's lazy
    modules) finds it, unless dynamo is imported already. Imports nothing: a command that never
    imports torch pays nothing for it."""
    if NAME in sys.modules:
        return
    torch = importlib.util.find_spec("torch")  # found, not run
    spec = torch and importlib.machinery.PathFinder.find_spec(NAME, torch.submodule_search_locations)
    if spec is None:  # no torch here
        return
    standin = _Standin(NAME, __doc__)
    standin.__spec__, standin.__file__ = spec, spec.origin  # inspect.getmodule asks every module for __file__
    config = importlib.machinery.PathFinder.find_spec(CONFIG, spec.submodule_search_locations)
    if config is not None:  # dynamo's settings, which torch's fake tensors read: its own file, run when first read
        config.loader = importlib.util.LazyLoader(config.loader)
        standin.config = importlib.util.module_from_spec(config)
        config.loader.exec_module(standin.config)
        sys.modules[CONFIG] = standin.config  # the real package imports this one, if it comes
    sys.meta_path.insert(0, _Finder())
    sys.modules[NAME] = standin
    if "torch" in sys.modules:
        sys.modules["torch"]._dynamo = standin
