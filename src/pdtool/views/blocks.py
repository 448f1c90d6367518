"""A stage's layers grouped by the model's own hierarchy, for the picture of a partition.

A plan of a 163-layer Llama drawn layer by layer is a tangle; what people look for in it is
which blocks each stage holds. `stage_groups` folds each stage's layers into at most
`MAX_GROUPS` groups:

1. a layer belongs to the **block** its qualified name points into: the prefix up to its first
   numeric part (`model.layers.4.self_attn.q_proj` -> `model.layers.4`, a child of the
   container `model.layers`); a layer with no numeric part is a block of its own
   (`model.embed_tokens`, `lm_head`);
2. consecutive layers of one block are one **instance** of it (a stage cut inside a block holds
   part of it: "model.layers.4 (part)");
3. consecutive whole instances of one container with consecutive indices and the same layers
   (relative names and kinds) are one **run**: "model.layers.4-7: 4 x LlamaDecoderLayer", the
   class from the profile's `classes` (profiles without it say "blocks");
4. while a stage has more than `MAX_GROUPS` groups, the two neighbours with the fewest layers
   together merge ("0 … 5: 6 layers").

Pure: no graphviz, no torch (`views.render` draws the groups).
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_GROUPS = 12
"""Most groups (nodes) drawn for one stage."""


@dataclass(frozen=True)
class Group:
    """Consecutive layers of one stage drawn as one node: `name` says where they are in the
    model (`model.layers.4-7`), `what` what they are (`4 x LlamaDecoderLayer`)."""

    layers: tuple[int, ...]
    name: str
    what: str

    @property
    def label(self) -> str:
        return f"{self.name}: {self.what}"


@dataclass(frozen=True, kw_only=True)
class _Instance:
    key: str                      # the block's qualified name (or the layer's own, outside any block)
    container: str | None         # the module holding numbered blocks (None: a layer of its own)
    index: int | None             # the block's number in its container
    layers: tuple[int, ...]
    signature: tuple[tuple[str, str], ...]  # (name relative to the block, kind) of each layer
    whole: bool                   # the instance holds every layer of its block


def block_of(name: str) -> tuple[str, str | None, int | None]:
    """(block, container, index) of a layer's qualified name (module docstring, rule 1)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1]), ".".join(parts[:i]), int(part)
    return name, None, None


def stage_groups(stage_layers: tuple[int, ...], names: list[str], kinds: list[str], classes: dict[str, str],
                 block_sizes: dict[str, int], max_groups: int = MAX_GROUPS) -> list[Group]:
    """The groups of one stage's layers (ids into `names` and `kinds`, in the stage's order);
    `classes` the profile's module classes; `block_sizes` the layer count of every block in the
    whole model (`block_sizes`)."""
    instances = _instances(stage_layers, names, kinds, block_sizes)
    groups = [_run_group(run, classes) for run in _runs(instances)]
    while len(groups) > max_groups:
        i = min(range(len(groups) - 1), key=lambda k: (len(groups[k].layers) + len(groups[k + 1].layers), k))
        groups[i:i + 2] = [_merged(groups[i], groups[i + 1], names)]
    return groups


def block_sizes(names: list[str]) -> dict[str, int]:
    """Layers per block (`block_of`) over the whole model."""
    sizes: dict[str, int] = {}
    for name in names:
        key = block_of(name)[0]
        sizes[key] = sizes.get(key, 0) + 1
    return sizes


def _instances(stage_layers, names, kinds, sizes) -> list[_Instance]:
    found: list[list[int]] = []
    keys: list[str] = []
    for layer in stage_layers:
        key = block_of(names[layer])[0]
        if keys and keys[-1] == key:
            found[-1].append(layer)
        else:
            found.append([layer])
            keys.append(key)
    instances = []
    for key, layers in zip(keys, found):
        _, container, index = block_of(names[layers[0]])
        signature = tuple((names[i][len(key):].lstrip("."), kinds[i]) for i in layers)
        instances.append(
            _Instance(key=key, container=container, index=index, layers=tuple(layers), signature=signature,
                      whole=len(layers) == sizes.get(key))
        )
    return instances


def _runs(instances: list[_Instance]) -> list[list[_Instance]]:
    runs: list[list[_Instance]] = []
    for item in instances:
        last = runs[-1][-1] if runs else None
        if (last is not None and item.container is not None and item.whole and last.whole
                and item.container == last.container and item.index == last.index + 1
                and item.signature == last.signature):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _run_group(run: list[_Instance], classes: dict[str, str]) -> Group:
    first, last = run[0], run[-1]
    layers = tuple(i for item in run for i in item.layers)
    if first.container is None:  # a layer outside any numbered block
        return Group(layers, first.key, first.signature[0][1])
    kind = classes.get(first.key, "block")
    if len(run) > 1:
        prefix = f"{first.container}." if first.container else ""
        return Group(layers, f"{prefix}{first.index}-{last.index}", f"{len(run)} x {kind}")
    if first.whole:
        return Group(layers, first.key, kind)
    ends = [_tail(first.signature[0][0]), _tail(first.signature[-1][0])]
    return Group(layers, f"{first.key} (part)", f"{kind}: {ends[0]}" + (f" … {ends[1]}" if len(layers) > 1 else ""))


def _tail(name: str, chars: int = 24) -> str:
    """The last part of a dotted name, at most `chars` long (its end kept)."""
    last = name.rsplit(".", 1)[-1]
    return last if len(last) <= chars else "…" + last[-(chars - 1):]


def _merged(a: Group, b: Group, names: list[str]) -> Group:
    layers = a.layers + b.layers
    return Group(layers, f"{names[layers[0]]} … {names[layers[-1]]}", f"{len(layers)} layers")
