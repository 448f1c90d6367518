"""Weights in safetensors files: read per stage (`pd train --init-from`), written per stage (`pd export`).

`--init-from PATH` names a `.safetensors` file or a Hugging Face model folder (`model.safetensors`,
or shards listed by `model.safetensors.index.json`). Tensors are named as the model names its
parameters and buffers (the plan's whole-model names; a tied parameter by its first name, as
`save_pretrained` writes it). The launcher reads only the files' headers to check, before any
worker starts, that every parameter of the plan is there in its shape and that nothing in them is
foreign to the model (one line each); a worker reads only its own stage's tensors (safetensors
reads a tensor without the rest of its file).

`export` writes a checkpoint (`artifacts.checkpoint`) as a Hugging Face-style folder: one
`model-0000k-of-0000n.safetensors` per stage shard and `model.safetensors.index.json`, reading and
writing one stage at a time, so no process holds the whole model.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from ..errors import ArtifactError
from ..jsonio import write_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _safe_open(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ArtifactError(f"{path}: cannot read it as safetensors ({str(exc).strip().splitlines()[0][:160]}); "
                            "give a .safetensors file or a Hugging Face model folder") from None


@dataclass(frozen=True)
class WeightFiles:
    """Tensor name -> the safetensors file that holds it."""

    path: str
    where: dict[str, str]

    @classmethod
    def open(cls, path: str | os.PathLike) -> "WeightFiles":
        """The files at `path` (a file, or a folder with `model.safetensors` or its index);
        `ArtifactError` with what to fix when there are none."""
        path = Path(path)
        if path.is_file():
            with _safe_open(str(path)) as file:
                return cls(str(path), {name: str(path) for name in file.keys()})
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise ArtifactError(f"{path / INDEX}: not a safetensors index (no weight_map)") from None
            missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
            if missing:
                raise ArtifactError(f"{path / INDEX}: names {missing[0]}, which is not in {path}; copy the whole folder")
            return cls(str(path), {name: str(path / f) for name, f in weight_map.items()})
        if (path / SINGLE).is_file():
            return cls.open(path / SINGLE)
        raise ArtifactError(f"{path}: no {SINGLE} or {INDEX} there; give a .safetensors file or a Hugging Face model "
                            "folder (save_pretrained writes one)")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the files' headers (no tensor is read)."""
        found = {}
        for file_path in sorted(set(self.where.values())):
            with _safe_open(file_path) as file:
                for name in file.keys():
                    if self.where.get(name) == file_path:
                        found[name] = tuple(file.get_slice(name).get_shape())
        return found

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors `names` that the files hold (each file opened once, only these read)."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name in self.where:
                by_file.setdefault(self.where[name], []).append(name)
        found = {}
        for file_path, wanted in by_file.items():
            with _safe_open(file_path) as file:
                for name in wanted:
                    found[name] = file.get_tensor(name)
        return found

    def check(self, parameters: Mapping[str, tuple[int, ...]], buffers: Iterable[str] = ()) -> None:
        """One `ArtifactError` line unless every parameter is there in its shape and every tensor
        is a parameter or buffer of the model."""
        shapes = self.shapes()
        missing = sorted(set(parameters) - set(shapes))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ArtifactError(f"{self.path} has no {missing[0]}{more}, which the model needs; its names must be the "
                                "model's own (named_parameters), as save_pretrained writes them")
        for name, shape in parameters.items():
            if tuple(shapes[name]) != tuple(shape):
                raise ArtifactError(f"{self.path}: {name} has shape {shapes[name]}, the model {tuple(shape)}; it holds "
                                    "another model's weights (another size or config)")
        unexpected = sorted(set(shapes) - set(parameters) - set(buffers))
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise ArtifactError(f"{self.path} holds {unexpected[0]}{more}, which the model lacks; it holds another "
                                "model's weights")


CONFIGS = ("config.json", "generation_config.json")
"""What `export --config-from` copies from a Hugging Face folder, so that `from_pretrained` reads the result."""


def export(checkpoint: str | os.PathLike, output: str | os.PathLike,
           config_from: str | os.PathLike | None = None) -> tuple[int, int]:
    """Write `checkpoint`'s weights and buffers to `output` as safetensors, one file per stage and
    the index, one stage at a time; (files, bytes). `checkpoint` is a checkpoint folder, or a
    checkpoint root (its newest complete one). `config_from`: a Hugging Face folder whose
    `CONFIGS` are copied beside them."""
    import shutil

    from safetensors.torch import save_file

    from ..artifacts.checkpoint import MANIFEST, latest_complete, read_manifest, shard_tensors

    for folder, what in ((checkpoint, "checkpoint"), (config_from, "--config-from")):
        if folder is not None and not Path(folder).is_dir():
            raise ArtifactError(f"{folder}: no such folder; give a {what} folder")
    if not (Path(checkpoint) / MANIFEST).exists() and latest_complete(checkpoint) is not None:
        checkpoint = latest_complete(checkpoint)
    manifest = read_manifest(checkpoint)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    stages = sorted(manifest.shards)
    weight_map, total = {}, 0
    for k, stage in enumerate(stages, 1):
        name = f"model-{k:05d}-of-{len(stages):05d}.safetensors"
        tensors = {n: t.contiguous().clone() for n, t in shard_tensors(checkpoint, manifest, stage).items()}
        tmp = output / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, output / name)
        weight_map.update({n: name for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    write_json(output / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    for name in CONFIGS if config_from is not None else ():
        if (Path(config_from) / name).is_file():
            shutil.copyfile(Path(config_from) / name, output / name)
    return len(stages), total
