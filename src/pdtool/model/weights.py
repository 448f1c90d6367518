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

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .. import safefile
from ..errors import ArtifactError
from ..jsonio import write_json

_FLOATING = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
"""safetensors dtypes a floating parameter or buffer may be read from (converted to its own dtype)."""
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
                "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}
"""safetensors' dtype codes -> torch's dtype names."""

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_LINKS = ("copy the files themselves into the folder (hf download --local-dir DIR writes files, not links; a "
          "Hugging Face cache snapshot holds links), or name the .safetensors file itself")
"""How to fix a folder whose weight files are symbolic links (`--init-from` opens none in a folder)."""


def _safe_open(path: str):
    """safetensors' reader of the regular file `path`, opened without following a link
    (`safefile`: the reader opens the very file checked, by its descriptor)."""
    from safetensors import safe_open

    try:
        with safefile.open_regular(path) as file:
            return safe_open(safefile.by_descriptor(file, path), framework="pt", device="cpu")
    except OSError as exc:
        raise ArtifactError(f"{path}: {exc.strerror or exc}; {_LINKS}" if isinstance(exc, safefile.NotRegular) else
                            f"cannot read {path} ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ArtifactError(f"{path}: cannot read it as safetensors ({str(exc).strip().splitlines()[0][:160]}); "
                            "give a .safetensors file or a Hugging Face model folder") from None


def _weight_map(folder: Path) -> dict[str, str]:
    """The index's tensor name -> file name, each file a regular file of `folder` itself (no
    path, no link: a folder someone sent you decides nothing outside it); one line when not."""
    where = folder / INDEX
    try:
        text = safefile.read_bytes(where)
    except OSError as exc:
        raise ArtifactError(f"{where}: {exc.strerror or exc}; {_LINKS}") from None
    try:
        weight_map = json.loads(text)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ArtifactError(f"{where}: not a safetensors index (no weight_map); give the folder save_pretrained "
                            "wrote") from None
    if not isinstance(weight_map, dict):
        raise ArtifactError(f"{where}: its weight_map is not an object of tensor name -> file name; give the folder "
                            "save_pretrained wrote")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ArtifactError(f"{where}: its weight_map maps {name} to {file!r}, not to a file name; give the folder "
                                "save_pretrained wrote")
        if file in ("", ".", "..") or os.sep in file or "/" in file or (os.altsep and os.altsep in file):
            raise ArtifactError(f"{where}: names {file!r}, a path outside the folder {folder}; an index names files "
                                "of its own folder only")
    for file in sorted(set(weight_map.values())):
        try:
            with safefile.open_regular(folder / file):
                pass
        except FileNotFoundError:
            raise ArtifactError(f"{where}: names {file}, which is not in {folder}; copy the whole folder") from None
        except OSError as exc:
            raise ArtifactError(f"{folder / file}: {exc.strerror or exc}; an index names regular files of its own "
                                f"folder only: {_LINKS}") from None
    return weight_map


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
        if path.is_file():  # a file the user named: a link to it is theirs to follow
            path = Path(os.path.realpath(path))
        elif os.path.lexists(path / INDEX):
            return cls(str(path), {name: str(path / f) for name, f in _weight_map(path).items()})
        elif os.path.lexists(path / SINGLE):
            path = path / SINGLE  # a file of the folder: opened without following a link
        else:
            raise ArtifactError(f"{path}: no {SINGLE} or {INDEX} there; give a .safetensors file or a Hugging Face "
                                "model folder (save_pretrained writes one)")
        with _safe_open(str(path)) as file:
            return cls(str(path), {name: str(path) for name in file.keys()})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the files' headers (no tensor is read)."""
        return {name: shape for name, (shape, _) in self.headers().items()}

    def headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every tensor's shape and safetensors dtype ("F32", "BF16", "I32", ...), from the files'
        headers (no tensor is read)."""
        found = {}
        for file_path in sorted(set(self.where.values())):
            with _safe_open(file_path) as file:
                for name in file.keys():
                    if self.where.get(name) == file_path:
                        piece = file.get_slice(name)
                        found[name] = (tuple(piece.get_shape()), str(piece.get_dtype()))
        lacking = sorted(set(self.where) - set(found))
        if lacking:
            file = Path(self.where[lacking[0]]).name
            raise ArtifactError(f"{self.path}: its index maps {lacking[0]} to {file}, which does not hold it; the "
                                "folder is damaged or mixes two models: copy it whole again")
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

    def check(self, parameters: Mapping[str, tuple[int, ...]], buffers: Iterable[str] = (),
              dtypes: Mapping[str, str] | None = None) -> None:
        """One `ArtifactError` line unless every parameter is there in its shape and of a dtype it
        can take, and every tensor is a parameter or buffer of the model. `dtypes`: the model's
        torch dtype names of its parameters and buffers (`model.capture.Capture.dtypes`; without
        one, a parameter is taken to be floating point and a buffer is not checked)."""
        headers = self.headers()
        shapes = {name: shape for name, (shape, _) in headers.items()}
        missing = sorted(set(parameters) - set(shapes))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ArtifactError(f"{self.path} has no {missing[0]}{more}, which the model needs; its names must be the "
                                "model's own (named_parameters), as save_pretrained writes them")
        for name, shape in parameters.items():
            if tuple(shapes[name]) != tuple(shape):
                raise ArtifactError(f"{self.path}: {name} has shape {shapes[name]}, the model {tuple(shape)}; it holds "
                                    "another model's weights (another size or config)")
        for name in [*parameters, *sorted(set(buffers) & set(headers) - set(parameters))]:
            model = (dtypes or {}).get(name, "floating point" if name in parameters else None)
            if model is not None and not _converts(headers[name][1], model):
                kind = "parameter" if name in parameters else "buffer"
                raise ArtifactError(f"{self.path}: {name} is {_DTYPE_NAMES.get(headers[name][1], headers[name][1])}, "
                                    f"but the model's {kind} is {model}; give tensors saved from this model (another "
                                    "floating dtype is converted; an integer or bool tensor must be of the model's own "
                                    "dtype)")
        unexpected = sorted(set(shapes) - set(parameters) - set(buffers))
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise ArtifactError(f"{self.path} holds {unexpected[0]}{more}, which the model lacks; it holds another "
                                "model's weights")


def _converts(code: str, model: str) -> bool:
    """Whether a tensor of safetensors dtype `code` may become one of torch dtype `model` ("floating
    point": any floating one): its own dtype, or floating to floating (converted when read)."""
    return _DTYPE_NAMES.get(code) == model or code in _FLOATING and (
        model == "floating point" or model in {_DTYPE_NAMES[c] for c in _FLOATING})


CONFIGS = ("config.json", "generation_config.json")
"""What `export --config-from` copies from a Hugging Face folder, so that `from_pretrained` reads the result."""

_EXPORTED = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|model\.safetensors(\.index\.json)?")
"""The names of an export's files (`export`): what an earlier export left in a folder."""


def earlier_export(output: str | os.PathLike) -> list[str]:
    """The files of an earlier export in folder `output` (its shards and index), sorted."""
    try:
        return sorted(name for name in os.listdir(output) if _EXPORTED.fullmatch(name))
    except (FileNotFoundError, NotADirectoryError):
        return []


def export(checkpoint: str | os.PathLike, output: str | os.PathLike,
           config_from: str | os.PathLike | None = None, force: bool = False) -> tuple[int, int]:
    """Write `checkpoint`'s weights and buffers to `output` as safetensors, one file per stage and
    the index, one stage at a time; (files, bytes). `checkpoint` is a checkpoint folder, or a
    checkpoint root (its newest complete one). `config_from`: a Hugging Face folder whose
    `CONFIGS` are copied beside them. A folder holding an earlier export is refused unless
    `force` (then the earlier export's files the new index does not name are removed).

    Everything is written first into a private folder inside `output` (made by this process, mode
    0700: nobody can plant a link in it), then renamed into place, the index last; a failure (a
    full disk, a read-only folder, Ctrl-C) removes what was written and leaves `output` as it was
    (a folder it made too). With `config_from`, a config file already in `output` counts as an
    earlier export's."""
    import shutil
    import tempfile

    from ..artifacts.checkpoint import MANIFEST, latest_complete, read_manifest

    output = Path(output)
    earlier, configs = _export_checked(checkpoint, output, config_from, force)
    if not (Path(checkpoint) / MANIFEST).exists() and latest_complete(checkpoint) is not None:
        checkpoint = latest_complete(checkpoint)
    manifest = read_manifest(checkpoint)
    stages = sorted(manifest.shards)
    made = not os.path.lexists(output)
    try:
        output.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".export-", dir=output))
    except OSError as exc:
        _remove(output if made else None)
        raise ArtifactError(f"cannot write {output} ({exc.strerror or exc}); give a folder you can write to") from None
    moved: list[str] = []
    try:
        total = _write_stages(checkpoint, manifest, stages, staging)
        for name in configs:
            shutil.copyfile(Path(config_from) / name, staging / name)
        written = sorted(os.listdir(staging), key=lambda name: name == INDEX)  # the index last
        for name in written:
            os.replace(staging / name, output / name)
            moved.append(name)
    except BaseException as exc:  # a full disk, a read-only folder (safetensors raises its own type), Ctrl-C
        shutil.rmtree(staging, ignore_errors=True)
        for name in moved:  # no shard of this export without its index (the index is moved last)
            _remove(output / name)
        _remove(output if made else None)
        if isinstance(exc, ArtifactError) or not isinstance(exc, Exception):
            raise
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ArtifactError(f"cannot write the export into {output} ({reason}); free some space or give another -o "
                            "(nothing of this export was left there)") from None
    staging.rmdir()
    for name in set(earlier) - set(written):  # the earlier export's own shards (--force): the new index names none
        (output / name).unlink(missing_ok=True)
    return len(stages), total


def _export_checked(checkpoint, output: Path, config_from, force: bool) -> tuple[list[str], list[str]]:
    """`export`'s refusals before it writes anything: folders that are not there, an earlier
    export in `output` without `force`. (The earlier export's files, the config files to copy.)"""
    for folder, what in ((checkpoint, "checkpoint"), (config_from, "--config-from")):
        if folder is not None and not Path(folder).is_dir():
            raise ArtifactError(f"{folder}: no such folder; give a {what} folder")
    earlier = earlier_export(output)
    configs = [name for name in CONFIGS if config_from is not None and (Path(config_from) / name).is_file()]
    kept = earlier + [name for name in configs if os.path.lexists(output / name)]
    if kept and not force:
        raise ArtifactError(f"{output} already holds an export ({', '.join(kept[:2])}"
                            f"{' ...' if len(kept) > 2 else ''}), which pd export does not overwrite; give another "
                            "-o, or --force to replace it")
    return earlier, configs


def _write_stages(checkpoint, manifest, stages: list, staging: Path) -> int:
    """Each stage's shard as one safetensors file in `staging`, one stage in memory at a time, and
    the index naming every tensor's file; the bytes written."""
    from safetensors.torch import save_file

    from ..artifacts.checkpoint import shard_tensors

    weight_map, total = {}, 0
    for k, stage in enumerate(stages, 1):
        name = f"model-{k:05d}-of-{len(stages):05d}.safetensors"
        tensors = {n: t.contiguous().clone() for n, t in shard_tensors(checkpoint, manifest, stage).items()}
        save_file(tensors, str(staging / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    write_json(staging / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return total


def _remove(path: Path | None) -> None:
    """Remove the file `path`, or the folder `path` if it is empty; nothing when it cannot (or None)."""
    if path is not None:
        with contextlib.suppress(OSError):
            path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
