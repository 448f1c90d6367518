"""Models enter pdtool through one string, `pkg.module:factory`.

The factory is called with keyword arguments (from `--model-arg key=value`) and returns
either a `ModelBundle` or a tuple `(module, sample, loss_fn)` where

- `module` is a `torch.nn.Module`;
- `sample` is a pair `(inputs, target)` of one fixed minibatch, or a function
  `batch_size -> (inputs, target)` that makes one (`inputs` is a tensor or a tuple of tensors
  passed as positional arguments);
- `loss_fn(output, target)` returns a scalar tensor.

A spec is imported and called only with the user's consent (`pdtool.consent`): named on the
command line, a file of the experiment folder, or a function its author marked with
`@pdtool.factory`. Every failure (no consent, unimportable module, missing factory, factory
that raises, bad return value) becomes one `ModelError` line that says what to fix.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..consent import consent, import_path
from ..errors import ModelError, PdtoolError
from ..artifacts.profile import ModelRef, TensorSpec

Batch = tuple[Any, Any]


@dataclass
class ModelBundle:
    """What a model factory returns: the module, a batch maker and the loss function.

    `make_batch(batch_size)` returns `(inputs, target)`; `fixed_batch_size` is set when the
    factory gave one fixed sample instead of a function (then only that size is possible).
    """

    module: nn.Module
    make_batch: Callable[[int], Batch]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    fixed_batch_size: int | None = None

    def batch(self, batch_size: int | None, spec: str = "model") -> tuple[int, tuple[torch.Tensor, ...], Any]:
        """Make one minibatch; returns (batch size, positional inputs as a tuple, target)."""
        if batch_size is None:
            batch_size = self.fixed_batch_size or 32
        if self.fixed_batch_size is not None and batch_size != self.fixed_batch_size:
            raise ModelError(
                f"{spec} returns a fixed sample of batch size {self.fixed_batch_size}, so --batch-size "
                f"{batch_size} is impossible; drop --batch-size or make the factory return a function of the batch size"
            )
        made = self.make_batch(batch_size)
        if not (isinstance(made, tuple) and len(made) == 2):
            raise ModelError(f"{spec}: the sample must be a pair (inputs, target), got {type(made).__name__}; fix the factory")
        inputs, target = made
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise ModelError(f"{spec}: the sample inputs must be a tensor or a tuple of tensors; fix the factory")
        return batch_size, inputs, target


def parse_model_args(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Turn `key=value` strings into kwargs; values are JSON literals when they parse, else strings."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ModelError(f"model argument {pair!r} is not KEY=VALUE; write e.g. --model-arg width=16")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return kwargs


def local_origin(spec: str) -> str | None:
    """The file of the experiment folder (the current folder) that `spec` would import first, or
    None when it comes from an installed package (or nowhere). Looked up without importing."""
    try:
        return consent(spec, given=False).origin
    except PdtoolError:
        return None


def resolve_factory(spec: str, error: type[PdtoolError] = ModelError, what: str = "model",
                    example: str = "pdtool.zoo:resnet50", given: bool = False, flag: str = "-m") -> Callable[..., Any]:
    """Import `pkg.module:factory` (the current folder is importable after installed packages),
    once the user consented to it (`pdtool.consent`: `given` on the command line, a file of the
    experiment folder, or marked by its author); nothing is imported otherwise. Every failure is
    one `error` line about the `what` (model, data, ...) named by `spec`; `flag` is the option
    that names one on the command line."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{what} {spec!r} is not of the form pkg.module:factory; write e.g. {example}")
    allowed = consent(spec, given=given, what=what, error=error, flag=flag)
    import_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise error(
            f"{what} {spec!r}: cannot import {exc.name!r}; check the module path, install its package, "
            "or run from the folder that holds it"
        ) from None
    except Exception as exc:  # the user's module failed while importing
        first = (str(exc).strip().splitlines() or [""])[0]
        raise error(f"{what} {spec!r}: importing {module_name} failed with {type(exc).__name__}: {first}") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise error(f"{what} {spec!r}: {module_name} has no attribute {attr!r}; check the factory name")
    if not callable(factory):
        raise error(f"{what} {spec!r}: {attr} is not callable; name a function that builds the {what}")
    allowed.checked_after_import(spec, factory, error, what)
    return factory


def load_model(ref: ModelRef, given: bool = False) -> ModelBundle:
    """Build the model that `ref` describes and check the factory's result. `given`: the user
    named `ref.spec` on the command line (see `pdtool.consent`; a spec read from a file needs
    the experiment folder or its author's mark)."""
    factory = resolve_factory(ref.spec, given=given)
    try:
        result = factory(**ref.kwargs)
    except Exception as exc:
        raise ModelError(
            f"model {ref.spec!r}: the factory raised {type(exc).__name__}: {exc}; check its --model-arg values"
        ) from None
    if isinstance(result, ModelBundle):
        return result
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ModelError(
            f"model {ref.spec!r}: the factory returned {type(result).__name__}; "
            "return a ModelBundle or a tuple (module, sample, loss_fn)"
        )
    module, sample, loss_fn = result
    if not isinstance(module, nn.Module):
        raise ModelError(f"model {ref.spec!r}: the first item the factory returned is not a torch.nn.Module")
    if not callable(loss_fn):
        raise ModelError(f"model {ref.spec!r}: the loss function the factory returned is not callable")
    if callable(sample):
        return ModelBundle(module, sample, loss_fn)
    if not (isinstance(sample, tuple) and len(sample) == 2):
        raise ModelError(f"model {ref.spec!r}: the sample must be a pair (inputs, target) or a function making one")
    first = sample[0][0] if isinstance(sample[0], tuple) else sample[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ModelError(f"model {ref.spec!r}: the sample inputs must be tensors with a batch dimension")
    return ModelBundle(module, lambda _size: sample, loss_fn, fixed_batch_size=first.shape[0])


def file_model(model: dict[str, Any], override: str | None = None) -> ModelBundle:
    """Build the model a plan or checkpoint file names (`model`: its {"spec", "kwargs"}), or the
    spec `override` the user named on the command line instead (`pd train -m`: trusted, called
    with the file's kwargs). The file's own spec needs consent (`pdtool.consent`)."""
    return load_model(ModelRef(override or model["spec"], model.get("kwargs", {})), given=override is not None)


def fingerprint(module: nn.Module) -> str:
    """sha256 over the qualified names and shapes of the module's parameters, in order."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}\n".encode())
    return digest.hexdigest()


def tensor_specs(inputs: tuple[torch.Tensor, ...]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in inputs)
