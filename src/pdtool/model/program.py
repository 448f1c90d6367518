"""Each stage's program as plain data: captured once by the launcher, loaded by the worker that runs it.

`pd train`'s launcher captures the model once (on `meta`, `model.build`), cuts it into the plan's
stages (`model.stages`) and writes what each stage runs as JSON text (`encode`): its graph's nodes
with their targets by name (an aten operator as `aten::add.Tensor`, a Python function as
`module:qualname`) and their arguments (other nodes by name, numbers, dtypes, devices, slices).
A worker decodes only its own stage's program (`decode`) and builds it on its own model, whose
parameters the rule of `model.build` has given values for that stage only, so no worker traces
the model or holds another stage's weights.

Why this format and not torch.export's serialization: a stage of a torch.fx-traced model is a
graph of module calls and Python functions, which torch.export's format does not hold, and an
exported program carries its weights, which here come from the initialization rule (or
`--init-from`) in the worker.

The text is data (it may come from the launcher's capture cache, `runtime.launcher.capture_cache`),
so decoding runs nothing and a program may call exactly these targets (`ALLOWED`; anything else is
one `LaunchError` line, and `check` tells the launcher the same before any worker starts):
- operators (`op`): torch's tensor operators, `torch.ops.aten`, and the custom operators a
  package of the model's own registers (transformers' `torch.ops.transformers`);
- functions (`fn`): the `torch`, `torch.nn.functional`, `torch.fft`, `torch.linalg` and
  `torch.special` functions that compute on tensors (`torch.overrides.get_overridable_functions`:
  not `torch.save`, `torch.load` nor anything that touches files, processes or the network),
  `operator`'s arithmetic, comparison and item operators (`OPERATORS`), `math`'s functions,
  the side-effect-free builtins `BUILTINS` (`getattr` of a public attribute only), and functions
  *defined* in the modules of the consented model (its factory's module and the modules of its
  classes, e.g. `transformers.models.llama.modeling_llama:rotate_half`; a name such a module
  merely imports does not count);
- methods (`call_method`): public methods of `torch.Tensor` and its operator methods (`__add__`);
- attributes (`get_attr`, `call_module`): the model's own tensors and submodules, by names
  without a dunder part.
The names are looked up only among the modules the worker already imported (its model's). A graph the encoder cannot write (a higher-order operator with a subgraph)
leaves that stage's program empty: its worker then captures the model itself, on `meta`.
Measured on GPT-2 small (docs/big-models.md): the text of all stages is
a few hundred KB, and a worker builds its stage from it in well under a second.
"""
from __future__ import annotations

import builtins
import json
import math
import sys
from typing import Any

import torch
from torch import fx

from ..errors import LaunchError


OPERATORS = frozenset({
    "abs", "add", "and_", "contains", "eq", "floordiv", "ge", "getitem", "gt", "index", "inv", "invert", "is_",
    "is_not", "le", "lshift", "lt", "matmul", "mod", "mul", "ne", "neg", "not_", "or_", "pos", "pow", "rshift",
    "setitem", "sub", "truediv", "truth", "xor", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
    "iand", "ior", "ixor", "concat",
})
"""`operator` functions a program may call: arithmetic, comparison and item access (not `call`,
`attrgetter`, `methodcaller` or `delitem`; `setitem` writes into a tensor or a list the graph made)."""

BUILTINS = frozenset({
    "getattr", "len", "int", "float", "bool", "str", "tuple", "list", "dict", "slice", "range", "min", "max", "abs",
    "round", "sum", "pow", "divmod", "all", "any", "isinstance", "enumerate", "zip", "reversed", "sorted",
})
"""Builtins a program may call: side-effect free (`getattr` only of a public attribute: `check_getattr`)."""

TORCH_NAMESPACES = ("torch", "torch.functional", "torch.nn.functional", "torch.fft", "torch.linalg", "torch.special")
"""The torch namespaces whose tensor functions (`torch.overrides.get_overridable_functions`) a program may call."""

_OPERATOR_DUNDERS = frozenset({
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__floordiv__", "__rfloordiv__", "__ifloordiv__", "__mod__",
    "__rmod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__neg__", "__pos__", "__abs__", "__invert__",
    "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rshift__", "__eq__",
    "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__getitem__", "__len__", "__bool__", "__float__", "__int__",
})


class Unwritable(Exception):
    """A graph holds something the program format cannot write."""


def _function_name(target) -> str:
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if module is None and name is not None and getattr(builtins, name, None) is target:
        module = "builtins"
    if not module or not name or "<" in name:
        raise Unwritable(f"function {target!r} has no importable name")
    if _lookup(module, name) is not target:
        raise Unwritable(f"function {module}:{name} is not reachable by its name")
    return f"{module}:{name}"


def _lookup(module: str, name: str):
    """A function by module and qualified name, among the modules already imported."""
    value = sys.modules.get(module)
    if value is None:
        return None
    for part in name.split("."):
        value = getattr(value, part, None)
    return value


def _target(node: fx.Node):
    target = node.target
    if node.op in ("placeholder", "get_attr", "call_module", "call_method", "output"):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return {"op": f"{target._schema.name}.{target._overloadname}"}
    if isinstance(target, torch._ops.HigherOrderOperator):
        raise Unwritable(f"higher-order operator {target.name()}")
    return {"fn": _function_name(target)}


def _value(value) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.Size):
        return {"tuple": [_value(v) for v in value]}
    if isinstance(value, tuple):
        return {"tuple": [_value(v) for v in value]}
    if isinstance(value, list):
        return [_value(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[_value(k), _value(v)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"slice": [_value(value.start), _value(value.stop), _value(value.step)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    raise Unwritable(f"argument {value!r} of type {type(value).__name__}")


def encode(graph: fx.Graph) -> str:
    """`graph` as JSON text; `Unwritable` when it holds what the format cannot write."""
    nodes = [[node.op, node.name, _target(node), _value(tuple(node.args)), _value(dict(node.kwargs))]
             for node in graph.nodes]
    return json.dumps(nodes, separators=(",", ":"))


class Refused(LaunchError):
    """A program names a target it may not call (module docstring); one line."""


class Allowed:
    """What a program may call (module docstring): torch's tensor operators and functions,
    `operator`, `math`, `BUILTINS`, Tensor methods, and the functions defined in `modules` (the
    consented model's: its factory's module and the modules of its classes), whose packages' own
    custom operators count too."""

    def __init__(self, modules=(), resolve: bool = True):
        self.modules = frozenset(m for m in modules if isinstance(m, str) and m)
        self.resolve = resolve  # False: the launcher's `check`, where the model's modules are not imported
        self.namespaces = frozenset({"aten"} | {m.partition(".")[0] for m in self.modules})

    @staticmethod
    def _torch_functions() -> frozenset:
        overridable = torch.overrides.get_overridable_functions()
        return frozenset(id(f) for ns, fns in overridable.items()
                         if getattr(ns, "__name__", None) in TORCH_NAMESPACES for f in fns)

    _TORCH: frozenset | None = None

    def operator(self, name: str):
        """`torch.ops` operator `ns::name.overload`, when allowed and present."""
        qualified, _, overload = name.rpartition(".")
        namespace, _, op = qualified.partition("::")
        if namespace not in self.namespaces:
            raise Refused(f"a stage program calls operator {name}, which is not one of torch's tensor operators "
                          f"({_REFUSED_HOW})")
        if namespace != "aten" and not self.resolve:
            return None
        try:
            found = getattr(getattr(getattr(torch.ops, namespace), op), overload)
        except (AttributeError, RuntimeError):
            raise LaunchError(f"a stage program calls operator {name}, which this worker's torch lacks; "
                              "use the same torch version on every machine") from None
        if not isinstance(found, torch._ops.OpOverload):
            raise Refused(f"a stage program names {name}, which is not an operator ({_REFUSED_HOW})")
        return found

    def function(self, name: str, found):
        """`found` (what `module:qualname` names) when a program may call it, else `Refused`."""
        module, _, qualname = name.partition(":")
        if module in ("_operator", "operator"):
            ok = qualname in OPERATORS
        elif module == "math":
            ok = not qualname.startswith("_") and "." not in qualname and callable(found)
        elif module == "builtins":
            ok = qualname in BUILTINS
        elif module in self.modules:  # defined there, not merely imported (None: not imported, or not there)
            ok = found is None or (getattr(found, "__module__", None) == module and callable(found))
        else:
            if Allowed._TORCH is None:
                Allowed._TORCH = self._torch_functions()
            ok = id(found) in Allowed._TORCH and (module == "torch" or module.startswith("torch."))
        if not ok:
            raise Refused(f"a stage program calls {name}, which a program may not call ({_REFUSED_HOW})")
        return found

    @staticmethod
    def method(name: str) -> str:
        if not isinstance(name, str) or not (name in _OPERATOR_DUNDERS or (not name.startswith("_")
                                                                          and callable(getattr(torch.Tensor, name, None)))):
            raise Refused(f"a stage program calls method {name!r}, which is not a tensor method ({_REFUSED_HOW})")
        return name

    @staticmethod
    def attribute(name: str) -> str:
        if not isinstance(name, str) or not all((part.isidentifier() or part.isdigit()) and not part.startswith("__")
                                                for part in name.split(".")):
            raise Refused(f"a stage program reads attribute {name!r}, which is not a name of the model's own "
                          f"tensors or submodules ({_REFUSED_HOW})")
        return name


_REFUSED_HOW = ("only torch's tensor operations, operator, math, a few builtins and the model's own functions are; "
                "if it came from pd train's capture cache, delete that entry (or set PDTOOL_CACHE_DIR=off) and run again")


class _Decoder:
    def __init__(self, device: torch.device | None, allowed: Allowed):
        self.device = device
        self.allowed = allowed
        self.nodes: dict[str, fx.Node] = {}

    def value(self, data):
        if isinstance(data, list):
            return [self.value(v) for v in data]
        if not isinstance(data, dict):
            return data
        if len(data) != 1:
            raise LaunchError(f"a stage program holds a value {data!r} of no known kind; it is damaged")
        (kind, raw), = data.items()
        if kind == "node":
            if raw not in self.nodes:
                raise LaunchError(f"a stage program uses node {raw!r} before it is defined; it is damaged")
            return self.nodes[raw]
        if kind == "tuple":
            return tuple(self.value(v) for v in raw)
        if kind == "dict":
            return {self.value(k): self.value(v) for k, v in raw}
        if kind == "float":
            return float(raw)
        if kind == "device":
            device = torch.device(raw)
            return self.device if device.type == "meta" and self.device is not None else device
        if kind in _TORCH_VALUES:
            value = getattr(torch, raw, None) if isinstance(raw, str) else None
            if not isinstance(value, _TORCH_VALUES[kind]):
                raise LaunchError(f"a stage program holds {kind} {raw!r}, which torch has not; it is damaged")
            return value
        if kind == "slice":
            return slice(*(self.value(v) for v in raw))
        if kind == "ellipsis":
            return Ellipsis
        raise LaunchError(f"a stage program holds an unknown value kind {kind!r}; please report it")

    def target(self, op: str, data):
        if op in ("call_method",):
            return self.allowed.method(data)
        if op in ("get_attr", "call_module"):
            return self.allowed.attribute(data)
        if op in ("placeholder", "output"):
            return data
        if op != "call_function" or not isinstance(data, dict) or len(data) != 1:
            raise LaunchError(f"a stage program holds a node {op!r} with target {data!r}; it is damaged")
        if "op" in data:
            return self.allowed.operator(str(data["op"]))
        name = data.get("fn")
        if not isinstance(name, str):
            raise LaunchError(f"a stage program holds a target {data!r} of no known kind; it is damaged")
        module, _, qualname = name.partition(":")
        found = _lookup(module, qualname)
        self.allowed.function(name, found)
        if found is None and self.allowed.resolve:
            raise LaunchError(f"a stage program calls {name}, which this worker has not imported (its model "
                              "imports what the launcher's did); use the same model and packages on every machine")
        return found


_TORCH_VALUES = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


def decode(text: str, device: torch.device | None = None, modules=()) -> fx.Graph:
    """The graph `encode` wrote; `meta` devices in it become `device` (the worker's). `modules`:
    the consented model's modules (`Allowed`, `model.capture.model_modules`), whose own functions
    the program may call. A target it may not call is `Refused`, a damaged text one `LaunchError`."""
    graph = fx.Graph()
    _walk(text, _Decoder(device, Allowed(modules)),
          lambda op, name, target, args, kwargs: graph.create_node(op, target, args, kwargs, name=name))
    return graph


def check(text: str, modules=(), resolve: bool = False) -> None:
    """Raise what `decode` would for a target `text` may not call, without building a graph; with
    `resolve` False without looking up the model's own functions and operators either (the
    launcher on a capture cache hit, before the model's modules are imported)."""
    _walk(text, _Decoder(None, Allowed(modules, resolve=resolve)), lambda op, name, target, args, kwargs: name)


def _walk(text: str, decoder: "_Decoder", make) -> None:
    try:
        for op, name, target, args, kwargs in json.loads(text):
            target, args, kwargs = decoder.target(op, target), decoder.value(args), decoder.value(kwargs)
            if target is getattr and not (len(args) == 2 and isinstance(args[1], str) and not args[1].startswith("_")):
                raise Refused(f"a stage program reads attribute {args[1:]!r} with getattr, which is not a public "
                              f"attribute ({_REFUSED_HOW})")
            if not isinstance(name, str) or name in decoder.nodes:
                raise LaunchError(f"a stage program defines node {name!r} twice or without a name; it is damaged")
            decoder.nodes[name] = make(op, name, target, args, kwargs)
    except LaunchError:
        raise
    except (ValueError, TypeError, KeyError, RecursionError, AttributeError, RuntimeError) as exc:
        raise LaunchError(f"a stage program is damaged ({type(exc).__name__}); if it came from pd train's capture "
                          "cache, delete that entry (or set PDTOOL_CACHE_DIR=off) and run again") from None


def attribute_targets(graph: fx.Graph) -> list[str]:
    """The attributes (`get_attr`) and submodules (`call_module`) the graph reads, in order."""
    return list(dict.fromkeys(str(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")))
