"""What another runtime can cut: a plan's stages as the module names (or Megatron layer kinds) it reads.

torchtitan and torch.distributed.pipelining build a stage from a copy of the model with the
modules of other stages removed, so they cut between **units**: a top-level child of the model
(`tok_embeddings`, `norm`, `output`), or an entry of a top-level container (`layers.4` of an
`nn.ModuleDict` or `nn.ModuleList`, known from the profile's `classes`, or a numbered name where
the profile does not record classes). A model whose top level is itself a sequence of numbered
modules (an `nn.Sequential`) has no such names: refused. Megatron-Core cuts between the kinds
of its layout string: `E` (everything before the first transformer layer), `t` (one block of the
model's repeated blocks: the container with the most numbered entries, `layers.4`,
`model.layers.4`, `decoder.layers.4`) and `L` (everything after the last).

A stage that holds part of a unit is a cut the target cannot make: refused in one line that
says which unit and how to profile so that the planner cannot cut it (`pd profile --depth N`
makes every module at that depth one layer). A layer at the model's root that is no module (an
operation of the root's forward, such as an `add`) belongs to no unit: the target runs its own
forward's code between the modules it keeps.

Pure: no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..artifacts.plan import Plan, compact_ranges
from ..artifacts.profile import Profile
from ..errors import PlanError

CONTAINERS = ("ModuleDict", "ModuleList")
"""Module classes whose entries torchtitan's stage builder keeps or deletes one by one (an
`nn.Sequential` it keeps or removes whole: its forward would call a removed entry)."""


@dataclass(frozen=True)
class Unit:
    """A piece of the model a target keeps or removes whole: its name and the layers in it."""

    name: str
    layers: tuple[int, ...]


def module_unit(name: str, kind: str, classes: dict[str, str]) -> str | None:
    """The unit (module name) torchtitan keeps or removes for a layer of this qualified name; None
    for an operation of the model's root forward (no dot in its name, and no module's kind)."""
    parts = name.split(".")
    if len(parts) == 1:
        return name if kind[:1].isupper() else None
    container = classes.get(parts[0])
    if container in CONTAINERS or (container is None and parts[1].isdigit()):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def module_units(profile: Profile) -> list[Unit]:
    """The profile's units for torchtitan and torch.distributed.pipelining, in data-flow order; a
    name that is no module's qualified name (letters, digits, _ and dots) is one line."""
    found: dict[str, list[int]] = {}
    for layer in profile.layers:
        unit = module_unit(layer.name, layer.kind, profile.classes)
        if unit is not None and not re.fullmatch(r"[A-Za-z0-9_.]+", unit):
            raise PlanError(f"layer {layer.id} of the profile is named {layer.name[:60]!r}, which is no module's "
                            "qualified name (letters, digits, _ and dots): profile the model again with pd profile")
        if unit is not None:
            found.setdefault(unit, []).append(layer.id)
    return [Unit(name, tuple(ids)) for name, ids in found.items()]


def stage_modules(plan: Plan, profile: Profile, target: str) -> list[list[str]]:
    """Each stage's module names in data-flow order (stages in the plan's order: a multi-chunk plan
    lists its chunks in model order, as torchtitan's `module_fqns_per_model_part` does)."""
    units = module_units(profile)
    numbered = [unit.name for unit in units if unit.name.split(".")[0].isdigit()]
    if numbered:
        raise PlanError(f"the profiled model's top level is a sequence of numbered modules ({numbered[0]}, ...: an "
                        f"nn.Sequential), whose forward calls every one: {target} builds a stage by removing the "
                        "modules of other stages from a model whose forward skips them; write the model with named "
                        "top-level modules and a forward that skips a removed one (as pdtool.zoo:llama)")
    return _per_stage(plan, profile, units, target)


def _per_stage(plan: Plan, profile: Profile, units: list[Unit], target: str) -> list[list[str]]:
    owner = {layer: index for index, stage in enumerate(plan.stages) for layer in stage.layers}
    names: list[list[str]] = [[] for _ in plan.stages]
    for unit in units:
        stages = sorted({owner[layer] for layer in unit.layers})
        if len(stages) > 1:
            inside = [profile.layers[layer].name for layer in unit.layers if owner[layer] == stages[1]][0]
            deeper = [name for name in (profile.layers[layer].name for layer in unit.layers)
                      if any(part.isdigit() for part in name.split(".")[_depth(unit.name):-1])]
            if deeper:
                block = _block(deeper[0])[0]
                raise PlanError(f"stages {stages[0]} and {stages[1]} of the plan cut {unit.name}, whose numbered blocks "
                                f"({block}, ...) lie deeper than {target} cuts (a top-level module, or an entry of a "
                                f"top-level container such as layers.4): profile the model class {target} runs, e.g. "
                                "pdtool.zoo:llama (written as torchtitan writes Llama), or export --to megatron")
            raise PlanError(f"stages {stages[0]} and {stages[1]} of the plan cut {unit.name} (stage {stages[1]} begins "
                            f"with {inside}), a module {target} keeps or removes whole: profile with --depth "
                            f"{_depth(unit.name)} (every module {_depth(unit.name)} levels deep one layer) and plan "
                            "again, so that no stage holds part of it")
        names[stages[0]].append(unit.name)
    order = {unit.name: index for index, unit in enumerate(units)}
    for index, stage_names in enumerate(names):
        positions = [order[name] for name in stage_names]
        if positions and positions != list(range(positions[0], positions[0] + len(positions))):
            missing = next(units[p].name for p in range(positions[0], positions[-1]) if p not in positions)
            raise PlanError(f"stage {index} of the plan holds {stage_names[0]} and {stage_names[-1]} but not "
                            f"{missing} between them: a {target} stage runs a contiguous range of the model's modules; "
                            "plan with --straight (stages of consecutive layers)")
    empty = [index for index, stage_names in enumerate(names) if not stage_names]
    if empty:
        raise PlanError(f"stage {empty[0]} of the plan holds no module, only operations of the model's root forward "
                        f"({profile.layers[plan.stages[empty[0]].layers[0]].name}): {target} cannot run such a stage; "
                        "plan with fewer stages")
    return names


def _depth(name: str) -> int:
    return name.count(".") + 1


# ----- Megatron-Core -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MegatronStage:
    """A stage in Megatron's layout words: whether it holds the embedding, its transformer layers
    (their indices), whether it holds the loss (final norm and output layer)."""

    embedding: bool
    blocks: tuple[int, ...]
    loss: bool

    def layout(self) -> str:
        """This stage in the layout string: `E`, `t*k`, `L`, separated by cosmetic commas."""
        words = (["E"] if self.embedding else []) + (_times("t", len(self.blocks)) if self.blocks else []) \
            + (["L"] if self.loss else [])
        return ",".join(words)


def _block(name: str) -> tuple[str, str | None, int | None]:
    """(block, container, index) of a layer's name: the prefix up to its first numbered part
    (`model.layers.4.mlp.up_proj` and `model.layers.4` -> `model.layers.4`, `model.layers`, 4)."""
    parts = name.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.isdigit():
            return ".".join(parts[:i + 1]), ".".join(parts[:i]), int(part)
    return name, None, None


def _times(symbol: str, count: int) -> list[str]:
    return [symbol if count == 1 else f"{symbol}*{count}"]


def megatron_stages(plan: Plan, profile: Profile) -> tuple[list[MegatronStage], str]:
    """The plan's stages as Megatron layout stages, and the name of the blocks' container."""
    keys = [_block(layer.name) for layer in profile.layers]
    counts: dict[str, set[int]] = {}
    for _, container, index in keys:
        if container is not None:
            counts.setdefault(container, set()).add(index)
    if not counts:
        raise PlanError("the profiled model has no repeated blocks (no module with numbered entries such as "
                        "layers.0): Megatron-Core's layout places transformer layers; export it --to pipelining")
    decoder = max(counts, key=lambda name: (len(counts[name]), -min(i for i, k in enumerate(keys) if k[1] == name)))
    owner = {layer: index for index, stage in enumerate(plan.stages) for layer in stage.layers}
    first = min(i for i, k in enumerate(keys) if k[1] == decoder)
    last = max(i for i, k in enumerate(keys) if k[1] == decoder)
    others = sorted({k[1] for k in keys if k[1] not in (None, decoder)})
    if others:
        raise PlanError(f"the profiled model has numbered blocks in {others[0]} besides the transformer layers of "
                        f"{decoder}: Megatron-Core's layout holds one stack of transformer layers between the "
                        "embedding and the loss; export it --to torchtitan or --to pipelining")
    strays = [profile.layers[i].name for i in range(first, last + 1) if keys[i][1] != decoder]
    if strays:
        raise PlanError(f"layer {strays[0]} lies between the transformer layers of {decoder} but is none of them: "
                        "Megatron-Core's layout holds only the embedding, transformer layers and the loss; export it "
                        "--to torchtitan or --to pipelining")
    pieces = [("E", "the embedding", range(0, first)), ("L", "the final norm and output layer",
                                                        range(last + 1, len(keys)))]
    blocks: dict[int, list[int]] = {}
    for i in range(first, last + 1):
        blocks.setdefault(keys[i][2], []).append(i)
    for symbol, what, layers in pieces + [("t", f"{decoder}.{b}", ids) for b, ids in blocks.items()]:
        stages = sorted({owner[i] for i in layers})
        if len(stages) > 1:
            fix = (f"profile with --depth {_depth(decoder) + 1} (every block one layer) and plan again" if symbol == "t"
                   else "plan again with that part on one stage")
            raise PlanError(f"stages {stages[0]} and {stages[1]} of the plan cut {what} ({symbol} in Megatron's layout), "
                            f"which Megatron-Core keeps on one stage: {fix}")
    numbers = sorted(blocks)
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise PlanError(f"the blocks of {decoder} are numbered {compact_ranges(numbers)}, not consecutively: Megatron's "
                        "layout counts transformer layers in order; export it --to pipelining")
    stages = []
    for index, stage in enumerate(plan.stages):
        mine = set(stage.layers)
        stages.append(MegatronStage(
            embedding=any(i in mine for i in pieces[0][2]),
            blocks=tuple(b - numbers[0] for b in numbers if blocks[b][0] in mine),
            loss=any(i in mine for i in pieces[1][2])))
    return stages, decoder
