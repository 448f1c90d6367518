"""pdtool: PipeDream pipeline-parallel training for current PyTorch.

Three phases, each a `pd` sub-command: `profile` (layer graph with costs), `plan`
(PipeDream's partitioning optimizer) and `train` (torch.distributed workers).

`@pdtool.factory` marks a model (or dataset) factory that plan and profile files may name
(`pdtool.consent`); a factory may return a `pdtool.ModelBundle` (`pdtool.model.spec`, imported
on first use: `import pdtool` needs no torch).
"""
from importlib import metadata as _metadata

from .consent import factory

__all__ = ["ModelBundle", "factory"]


def __getattr__(name: str):
    if name == "ModelBundle":
        from .model.spec import ModelBundle

        return ModelBundle
    raise AttributeError(f"module 'pdtool' has no attribute {name!r}")

try:
    __version__ = _metadata.version("pdtool")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
