"""pdtool: PipeDream pipeline-parallel training for current PyTorch.

Three phases, each a `pd` sub-command: `profile` (layer graph with costs), `plan`
(PipeDream's partitioning optimizer) and `train` (torch.distributed workers).

`@pdtool.factory` marks a model (or dataset) factory that plan and profile files may name
(`pdtool.consent`).
"""
from importlib import metadata as _metadata

from .consent import factory

__all__ = ["factory"]

try:
    __version__ = _metadata.version("pdtool")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
