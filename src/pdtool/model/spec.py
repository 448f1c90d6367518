"""Models enter pdtool through one string, `pkg.module:factory`.

The factory is called with keyword arguments (from `--model-arg key=value`) and returns
either a `ModelBundle` or a tuple `(module, sample, loss_fn)` where

- `module` is a `torch.nn.Module`;
- `sample` is a pair `(inputs, target)` of one fixed minibatch, or a function
  `batch_size -> (inputs, target)` that makes one; `inputs` is a tensor or a tuple of tensors
  (positional arguments) or a dict of tensors (keyword arguments: `module(**inputs)`, the
  Hugging Face convention), and a dict alone is a minibatch without a target (its model
  computes its own loss, e.g. from `labels`);
- `loss_fn(output, target)` returns a scalar tensor; None (or leaving it out of a
  `ModelBundle`) takes the model's own loss (`model_loss`: `output.loss`, `output["loss"]`,
  or the output itself when it is a scalar).

Keyword inputs are passed in the order of the sample's keys: the module's class is given a
`forward` of those parameters that calls the original one by keyword (`keyword_call`), so
capture, profile and stages see positional inputs named after the keys, and parameter names
stay the model's own.

A spec is imported and called only with the user's consent (`pdtool.consent`): named on the
command line, a file of the experiment folder, or a function its author marked with
`@pdtool.factory`. Every failure (no consent, unimportable module, missing factory, factory
that raises, bad return value) becomes one `ModelError` line that says what to fix.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import keyword
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..consent import consent, import_path
from ..errors import ModelError, PdtoolError
from ..artifacts.profile import ModelRef, TensorSpec

Batch = tuple[Any, Any]


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The loss a model computed itself (from inputs such as `labels`): `output.loss`,
    `output["loss"]`, or `output` when it is a scalar tensor; the target is not used."""
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ModelError(f"the model returned a {type(output).__name__} without a scalar loss, and the factory gave no "
                         "loss function; pass the labels among its inputs (e.g. labels=...) or return a loss_fn")
    return loss


@dataclass(kw_only=True)
class ModelBundle:
    """What a model factory returns: the module, a batch maker and the loss function.

    `make_batch(batch_size)` returns `(inputs, target)` or, without a target, a dict of
    keyword inputs; `loss_fn` None is the model's own loss (`model_loss`); `fixed_batch_size`
    is set when the factory gave one fixed sample instead of a function (then only that size
    is possible). `keywords`: the names of keyword inputs, in the order they are passed
    (`keyword_call`; set by `load_model`), empty for positional ones.
    """

    module: nn.Module
    make_batch: Callable[[int], Batch]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    fixed_batch_size: int | None = None
    keywords: tuple[str, ...] = ()
    origin: str = ""  # the module of the factory that made it (`load_model`): the model's own functions live there

    def __post_init__(self):
        if self.loss_fn is None:
            self.loss_fn = model_loss

    def batch(self, batch_size: int | None, spec: str = "model") -> tuple[int, tuple[torch.Tensor, ...], Any]:
        """Make one minibatch; returns (batch size, positional inputs as a tuple, target)."""
        if batch_size is None:
            batch_size = self.fixed_batch_size or 32
        if self.fixed_batch_size is not None and batch_size != self.fixed_batch_size:
            raise ModelError(
                f"{spec} returns a fixed sample of batch size {self.fixed_batch_size}, so --batch-size "
                f"{batch_size} is impossible; drop --batch-size or make the factory return a function of the batch size"
            )
        inputs, target = _pair(self.make_batch(batch_size), spec)
        if isinstance(inputs, dict):
            if not self.keywords:  # its maker could not make a sample of one when the model was loaded
                _adopt(self, tuple(inputs), spec)
            inputs = ordered(inputs, self.keywords, f"{spec}: the sample", ModelError)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise ModelError(f"{spec}: the sample inputs must be a tensor, a tuple of tensors or a dict of tensors; "
                             "fix the factory")
        return batch_size, inputs, target


def _pair(made: Any, spec: str) -> tuple[Any, Any]:
    """(inputs, target) of a sample: a pair, or a dict of keyword inputs without a target."""
    if isinstance(made, dict):
        return made, None
    if not (isinstance(made, tuple) and len(made) == 2):
        raise ModelError(f"{spec}: the sample must be a pair (inputs, target) or a dict of keyword inputs, got "
                         f"{type(made).__name__}; fix the factory")
    return made


def ordered(inputs: dict, keywords: tuple[str, ...], what: str, error: type[PdtoolError]) -> tuple:
    """Keyword inputs as the positional tuple the model takes (`keywords`' order); `error` one
    line when their names differ from the model's sample's."""
    if not keywords:
        raise error(f"{what} is a dict of keyword inputs but the model's sample passes positional ones; give "
                    "(input, target) pairs, or make the factory's sample a dict too")
    if set(inputs) != set(keywords):
        missing, extra = sorted(set(keywords) - set(inputs)), sorted(set(inputs) - set(keywords))
        raise error(f"{what} has keyword inputs {sorted(inputs)}, the model's sample {list(keywords)}"
                    f"{f' (missing {missing})' if missing else ''}{f' (not taken: {extra})' if extra else ''}; "
                    "give the same names")
    return tuple(inputs[name] for name in keywords)


def keyword_call(module: nn.Module, names: tuple[str, ...]) -> None:
    """Make `module` take `names` as positional inputs: its class becomes a subclass (same name,
    same module) whose `forward(self, *names)` calls the original `forward` with them by
    keyword. Tracers (torch.fx, torch.export) then see one parameter per name; the module, its
    parameters and their names are unchanged."""
    base = type(module)
    code = (f"def forward(self, {', '.join(names)}):\n"
            f"    return _forward(self, {', '.join(f'{n}={n}' for n in names)})\n")
    namespace: dict[str, Any] = {}
    exec(code, {"_forward": base.forward}, namespace)  # noqa: S102 - names are checked identifiers
    namespace["forward"].__doc__ = base.forward.__doc__
    module.__class__ = type(base.__name__, (base,), {"forward": namespace["forward"], "__module__": base.__module__,
                                                     "__qualname__": base.__qualname__, "keyword_inputs": names})


def _keyword_inputs(bundle: ModelBundle, spec: str) -> ModelBundle:
    """A bundle whose sample passes keyword inputs gets `keyword_call` and its `keywords`, found
    on a sample of one (or the fixed sample). A batch maker that cannot make one is asked again
    by `ModelBundle.batch` at the real size (`_adopt` there)."""
    try:
        with torch.random.fork_rng(devices=[]):
            made = bundle.make_batch(bundle.fixed_batch_size or 1)
    except Exception:  # noqa: BLE001 - e.g. a maker that needs an even batch: the real size decides
        return bundle
    inputs, _ = _pair(made, f"model {spec!r}")
    if isinstance(inputs, dict):
        _adopt(bundle, tuple(inputs), spec)
    return bundle


def _adopt(bundle: ModelBundle, names: tuple, spec: str) -> None:
    bad = [n for n in names if not (isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n))]
    if bad or not names:
        raise ModelError(f"model {spec!r}: the sample's keyword inputs {bad or names} are not names a forward can "
                         "take; use identifiers such as input_ids")
    keyword_call(bundle.module, names)
    bundle.keywords = names


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
    bundle = _load_model(ref, given)
    bundle.origin = ref.spec.partition(":")[0]  # the module consent allowed
    return bundle


def _load_model(ref: ModelRef, given: bool) -> ModelBundle:
    factory = resolve_factory(ref.spec, given=given)
    try:
        result = factory(**ref.kwargs)
    except Exception as exc:
        raise ModelError(
            f"model {ref.spec!r}: the factory raised {type(exc).__name__}: {exc}; check its --model-arg values"
        ) from None
    if isinstance(result, ModelBundle):
        return _keyword_inputs(result, ref.spec)
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ModelError(
            f"model {ref.spec!r}: the factory returned {type(result).__name__}; "
            "return a ModelBundle or a tuple (module, sample, loss_fn)"
        )
    module, sample, loss_fn = result
    if not isinstance(module, nn.Module):
        raise ModelError(f"model {ref.spec!r}: the first item the factory returned is not a torch.nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise ModelError(f"model {ref.spec!r}: the loss function the factory returned is not callable")
    if callable(sample):
        return _keyword_inputs(ModelBundle(module=module, make_batch=sample, loss_fn=loss_fn), ref.spec)
    if not (isinstance(sample, dict) or (isinstance(sample, tuple) and len(sample) == 2)):
        raise ModelError(f"model {ref.spec!r}: the sample must be a pair (inputs, target), a dict of keyword inputs "
                         "or a function making one")
    inputs = _pair(sample, ref.spec)[0]
    first = (next(iter(inputs.values()), None) if isinstance(inputs, dict) else
             inputs[0] if isinstance(inputs, tuple) else inputs)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ModelError(f"model {ref.spec!r}: the sample inputs must be tensors with a batch dimension")
    return _keyword_inputs(
        ModelBundle(module=module, make_batch=lambda _size: sample, loss_fn=loss_fn, fixed_batch_size=first.shape[0]),
        ref.spec,
    )


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
