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
`--init-from`) in the worker. The text is data: decoding runs nothing, a function is looked up
only among the modules the worker already imported (its model's), and an unknown name is one
`LaunchError` line. A graph the encoder cannot write (a higher-order operator with a subgraph)
leaves that stage's program empty: its worker then captures the model itself, on `meta`.
Measured on GPT-2 small (README, "Models bigger than one worker"): the text of all stages is
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


class _Decoder:
    def __init__(self, device: torch.device | None):
        self.device = device
        self.nodes: dict[str, fx.Node] = {}

    def value(self, data):
        if isinstance(data, list):
            return [self.value(v) for v in data]
        if not isinstance(data, dict):
            return data
        (kind, raw), = data.items()
        if kind == "node":
            return self.nodes[raw]
        if kind == "tuple":
            return tuple(self.value(v) for v in raw)
        if kind == "dict":
            return {self.value(k): self.value(v) for k, v in raw}
        if kind == "float":
            return float(raw)
        if kind == "dtype":
            return getattr(torch, raw)
        if kind == "device":
            device = torch.device(raw)
            return self.device if device.type == "meta" and self.device is not None else device
        if kind == "layout":
            return getattr(torch, raw)
        if kind == "memory_format":
            return getattr(torch, raw)
        if kind == "slice":
            return slice(*(self.value(v) for v in raw))
        if kind == "ellipsis":
            return Ellipsis
        raise LaunchError(f"a stage program holds an unknown value kind {kind!r}; please report it")

    def target(self, op: str, data):
        if not isinstance(data, dict):
            return data
        if "op" in data:
            qualified, _, overload = data["op"].rpartition(".")
            namespace, _, name = qualified.partition("::")
            try:
                return getattr(getattr(getattr(torch.ops, namespace), name), overload)
            except (AttributeError, RuntimeError):
                raise LaunchError(f"a stage program calls operator {data['op']}, which this worker's torch lacks; "
                                  "use the same torch version on every machine") from None
        module, _, name = data["fn"].partition(":")
        found = _lookup(module, name)
        if found is None:
            raise LaunchError(f"a stage program calls {data['fn']}, which this worker has not imported (its model "
                              "imports what the launcher's did); use the same model and packages on every machine")
        return found


def decode(text: str, device: torch.device | None = None) -> fx.Graph:
    """The graph `encode` wrote; `meta` devices in it become `device` (the worker's)."""
    decoder = _Decoder(device)
    graph = fx.Graph()
    for op, name, target, args, kwargs in json.loads(text):
        node = graph.create_node(op, decoder.target(op, target), decoder.value(args), decoder.value(kwargs), name=name)
        decoder.nodes[name] = node
    return graph


def attribute_targets(graph: fx.Graph) -> list[str]:
    """The attributes (`get_attr`) and submodules (`call_module`) the graph reads, in order."""
    return list(dict.fromkeys(str(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")))
