"""Checkpoints: one shard per stage plus a manifest, keyed by qualified parameter names.

Layout under a checkpoint root:

    root/step-00000120/stage-0.RUN.pt  torch.save of {"tensors": {name: tensor}, "extra": {...}, "run": RUN}
    root/step-00000120/stage-1.RUN.pt
    root/step-00000120/manifest.json   schema, step, run, plan sha256, per-shard file and sha256, meta
                                       (`manifest.Manifest`)
    root/.pdtool.lock                  the run that holds the folder (`runtime.launcher.folder_lock`)

RUN is the id of the run that wrote the shard (12 hex digits; checkpoints of older pdtool
versions have `stage-N.pt` and no run). A manifest completes only shards of its own run, and a
shard whose run is not its manifest's is refused on load.

Tensors are keyed by their qualified names in the full model (`layer3.0.conv1.weight`), so a
checkpoint made under one plan can be resumed under another: merge the shards by name and
hand every stage the names it holds. `extra` holds whatever else a stage saves, e.g. optimizer
state tensors keyed by parameter name; its top-level keys must not repeat across shards.

Every file is written atomically (temporary file in the same folder, then `os.replace`; a shard
streamed into it and hashed while written, `safefile.replaced`), read without following a
symbolic link (`safefile`: a checkpoint folder may be shared), and
the manifest last: a checkpoint is complete only when its manifest exists and every shard's
sha256 matches it. A crash part-way leaves an incomplete folder that `latest_complete` skips,
and a new checkpoint never touches an older one. Shards are read with
`torch.load(..., weights_only=True)`, so loading runs no pickled code.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .. import safefile
from ..errors import ArtifactError
from ..jsonio import read_json, write_json
from .manifest import RUN_ID, RUN_ID_MEANS, Manifest, ShardFile

MANIFEST = "manifest.json"
_FOLDER = re.compile(r"step-(\d{8,})")


def checkpoint_folder(root: str | os.PathLike, step: int) -> Path:
    """The folder of the checkpoint taken after `step` optimizer steps: root/step-<step:08d>."""
    return Path(root) / f"step-{_check_step(step):08d}"


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ArtifactError(f"checkpoint step {step!r} is not a non-negative integer")
    return step


def shard_name(stage: int, run: str | None = None) -> str:
    """The file name of stage `stage`'s shard written by run `run` (`stage-N.RUN.pt`)."""
    return f"stage-{stage}.{run}.pt" if run else f"stage-{stage}.pt"


def _check_run(run: str | None) -> str | None:
    if run is not None and not (isinstance(run, str) and re.fullmatch(RUN_ID, run)):
        raise ArtifactError(f"run id {run!r} is not {RUN_ID_MEANS}")
    return run


def save_shard(folder: str | os.PathLike, stage: int, tensors: dict[str, torch.Tensor],
               extra: dict[str, Any] | None = None, run: str | None = None) -> str:
    """Write stage `stage`'s shard into `folder` atomically; returns the file's sha256 (hex).

    `tensors` maps qualified names to tensors (saved detached, on the CPU); `extra` is any
    weights_only-loadable tree (dicts, lists, tensors, numbers, strings); `run` the id of the
    run writing it (in the file name and the payload). The folder is made
    if needed; a folder that already holds a complete checkpoint is refused, so that a
    complete checkpoint is never damaged.
    """
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise ArtifactError(f"stage {stage!r} is not a non-negative integer")
    folder = Path(folder)
    if (folder / MANIFEST).exists():
        raise ArtifactError(f"{folder} already holds a complete checkpoint; never overwrite one, "
                            "delete the folder first or save under another step")
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ArtifactError(f"shard of stage {stage}: {name!r} must be a qualified name mapped to a tensor")
    payload = {"tensors": {name: _portable(t) for name, t in tensors.items()}, "extra": dict(extra or {})}
    if _check_run(run):
        payload["run"] = run
    folder.mkdir(parents=True, exist_ok=True)
    with safefile.replaced(folder / shard_name(stage, run)) as out:  # streamed and hashed, never held whole
        torch.save(payload, out)
    return out.hexdigest()


def _portable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached on the CPU, copied when it is a view (so the file holds it alone)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def write_manifest(folder: str | os.PathLike, step: int, plan_sha256: str, shards: dict[int, str],
                   meta: dict[str, Any] | None = None, run: str | None = None) -> None:
    """Complete the checkpoint in `folder`: write its manifest (canonical JSON, atomically).

    Call it last, once every stage's shard is written; `shards` maps stage to the sha256
    that `save_shard` returned. `meta` is free JSON data (e.g. the plan's schedule mode, the
    number of samples seen). `run`: the run whose shards (`shard_name(s, run)`) it completes.
    Shards are checked to exist; their hashes are checked on load.
    """
    folder = Path(folder)
    _check_step(step)
    if (folder / MANIFEST).exists():
        raise ArtifactError(f"{folder} already holds a complete checkpoint; never overwrite one, "
                            "delete the folder first or save under another step")
    if not isinstance(plan_sha256, str):
        raise ArtifactError(f"plan sha256 {plan_sha256!r} is not a string; pass the plan file's hex digest")
    if not shards:
        raise ArtifactError(f"{folder}: a checkpoint needs at least one shard")
    _check_run(run)
    missing = [s for s in sorted(shards) if not (folder / shard_name(s, run)).is_file()]
    if missing:
        raise ArtifactError(f"{folder}: no shard for stage(s) {missing}; save every stage's shard before the manifest")
    manifest = Manifest(step=step, plan_sha256=plan_sha256,
                        shards={s: ShardFile(shard_name(s, run), shards[s]) for s in sorted(shards)}, meta=meta or {},
                        run=run)
    write_json(folder / MANIFEST, manifest.to_json())


def complete_checkpoint(folder: str | os.PathLike, stages: int, plan_sha256: str, meta: dict[str, Any],
                        run: str | None) -> None:
    """Write the manifest of `folder` once run `run` wrote the shards of all `stages` stages:
    their sha256 from the files, the step from the folder's name; then drop the temporary files
    of interrupted writes. `ArtifactError` when a shard is missing or the folder is complete."""
    folder = Path(folder)
    match = _FOLDER.fullmatch(folder.name)
    if match is None:
        raise ArtifactError(f"{folder}: not a checkpoint folder (step-<8 digits>)")
    hashes = {}
    for s in range(stages):  # read in blocks: the launcher never holds a shard
        path = folder / shard_name(s, run)
        try:
            hashes[s] = safefile.sha256(path)
        except FileNotFoundError:
            raise ArtifactError(f"{folder}: no shard {path.name}; save every stage's shard first") from None
        except safefile.NotRegular as exc:
            raise ArtifactError(f"{exc.strerror}; checkpoints hold regular files only, remove it") from None
    write_manifest(folder, int(match.group(1)), plan_sha256, hashes, meta, run)
    remove_temporaries(folder)


def has_shards(folder: str | os.PathLike, stages: int, run: str | None) -> bool:
    """Whether run `run` wrote the shard of every one of `stages` stages into `folder`."""
    return all((Path(folder) / shard_name(s, run)).is_file() for s in range(stages))


def complete_run(root: str | os.PathLike, run: str, stages: int, plan_sha256: str,
                 meta: dict[str, Any]) -> list[Path]:
    """Complete the checkpoints that run `run` (of `stages` stages) left with every shard written
    but no manifest (it was killed between its last shard and the manifest); returns them."""
    done = []
    for _, folder in sorted(_step_folders(Path(root))):
        if folder.is_symlink() or (folder / MANIFEST).exists() or not has_shards(folder, stages, run):
            continue
        try:
            complete_checkpoint(folder, stages, plan_sha256, meta, run)
        except (ArtifactError, OSError):
            continue  # left as it is: --resume skips it with its reason
        done.append(folder)
    return done


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """The manifest of the checkpoint in `folder`, checked for schema and fields (not hashes)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if folder.is_symlink() or path.is_symlink():
        raise ArtifactError(f"{path if path.is_symlink() else folder}: a symbolic link, not a checkpoint pdtool wrote; "
                            "checkpoints hold regular files and folders only")
    if not path.is_file():
        raise ArtifactError(f"{folder}: no {MANIFEST}, so the checkpoint is incomplete; use an older one")
    # schema, fields, run id, stage numbers, shard file names; opened without following a link
    return Manifest.from_json(read_json(path, follow_links=False), str(path))


def _read_shard(folder: Path, stage: int, entry: ShardFile):
    """Stage `stage`'s shard opened (never through a link) once its sha256 matches the manifest's
    (read in blocks: the shard is never in memory whole); the caller closes it."""
    path = folder / entry.file
    try:
        file = safefile.open_regular(path)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: shard of stage {stage} is missing; the checkpoint is incomplete") from None
    except safefile.NotRegular as exc:
        raise ArtifactError(f"{exc.strerror}; checkpoints hold regular files only") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read the shard ({exc}); check the file and its permissions") from None
    try:
        digest = safefile.sha256_of(file)
    except OSError as exc:
        file.close()
        raise ArtifactError(f"{path}: cannot read the shard ({exc}); check the file and its permissions") from None
    if digest != entry.sha256:
        file.close()
        raise ArtifactError(f"{path}: sha256 differs from the manifest's, the shard is corrupt; use an older checkpoint")
    return file


def verify_checkpoint(folder: str | os.PathLike) -> Manifest:
    """The manifest of `folder` once every shard's sha256 is checked; ArtifactError if not complete."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for stage, entry in manifest.shards.items():
        _read_shard(folder, stage, entry).close()
    return manifest


def load_checkpoint(folder: str | os.PathLike) -> tuple[Manifest, dict[str, torch.Tensor], dict[str, Any]]:
    """(manifest, tensors of all shards merged by qualified name, extras merged) of `folder`.

    Every shard's sha256 is checked against the manifest and the shard is loaded with
    `weights_only=True`, on the CPU, memory-mapped: the tensors take memory only where they are
    used, so a worker resuming its stage holds that stage, not the whole model. A name in two
    shards is an error.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    tensors: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    owner: dict[tuple[str, str], int] = {}
    for stage in sorted(manifest.shards):
        payload = _load_shard(folder, manifest, stage)
        for kind, merged in (("tensors", tensors), ("extra", extras)):
            for name, value in payload[kind].items():
                if (kind, name) in owner:
                    raise ArtifactError(f"{folder}: {kind} entry {name!r} is in the shards of stages "
                                        f"{owner[kind, name]} and {stage}; each name belongs to one stage")
                owner[kind, name] = stage
                merged[name] = value
    return manifest, tensors, extras


def _load_shard(folder: Path, manifest: Manifest, stage: int) -> dict:
    """Stage `stage`'s shard of the checkpoint in `folder`, checked, memory-mapped."""
    path = folder / manifest.shards[stage].file
    try:  # mapped, not read: a tensor takes memory only once it is used (a worker copies its stage's)
        with _read_shard(folder, stage, manifest.shards[stage]) as file:  # the file that was hashed
            payload = torch.load(safefile.by_descriptor(file, path), map_location="cpu", weights_only=True, mmap=True)
    except ArtifactError:
        raise
    except Exception as exc:
        raise ArtifactError(f"{path}: cannot load the shard ({type(exc).__name__}: {_first_line(exc)})") from None
    if not (isinstance(payload, dict) and isinstance(payload.get("tensors"), dict)
            and isinstance(payload.get("extra"), dict)):
        raise ArtifactError(f"{path}: not a pdtool shard (no 'tensors' and 'extra'); it was not written by save_shard")
    if payload.get("run") != manifest.run:
        raise ArtifactError(f"{path}: written by run {payload.get('run')}, but the manifest completes run "
                            f"{manifest.run}; the checkpoint mixes two runs, use another one")
    return payload


def shard_tensors(folder: str | os.PathLike, manifest: Manifest, stage: int) -> dict[str, torch.Tensor]:
    """The weights and buffers of stage `stage`'s shard alone (checked, memory-mapped)."""
    return _load_shard(Path(folder), manifest, stage)["tensors"]


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step-<n> folder under root, newest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _FOLDER.fullmatch(path.name)
        if match and (path.is_dir() or path.is_symlink()):  # a link is listed, and then refused as one
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def set_aside_after(root: str | os.PathLike, step: int) -> list[tuple[Path, Path]]:
    """Rename every checkpoint folder of a step after `step` (incomplete, corrupt, or from a run
    that went further) to `step-N.set-aside[-K]`, so that a run resuming from `step` writes only
    into folders it creates; returns (old, new) pairs. Nothing but the temporary files of
    interrupted writes is deleted."""
    moved = []
    for found, path in _step_folders(Path(root)):
        if found <= step:
            continue
        target = path.with_name(f"{path.name}.set-aside")
        k = 2
        while os.path.lexists(target):
            target = path.with_name(f"{path.name}.set-aside-{k}")
            k += 1
        path.rename(target)
        if not target.is_symlink():
            remove_temporaries(target)  # what a crashed write left behind
        moved.append((path, target))
    return moved


def remove_temporaries(folder: str | os.PathLike) -> None:
    """Delete the temporary files of interrupted atomic writes (`.NAME.*.tmp`) in `folder`."""
    for path in Path(folder).glob(".*.tmp"):
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)


def existing_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the checkpoint folders under `root` (complete or not), newest first."""
    return [step for step, _ in _step_folders(Path(root))]


def latest_complete(root: str | os.PathLike, warn: Callable[[str], None] | None = None,
                    needs: Mapping[str, tuple[int, ...]] | set[str] | None = None) -> Path | None:
    """The newest good checkpoint folder under `root`, or None if there is none.

    One rule for every flaw: a folder that is incomplete, corrupt (a hash), unloadable (a shard
    `weights_only` refuses), a symbolic link, that lacks a parameter in `needs` (e.g. a manifest
    missing a stage) or holds it in another shape (when `needs` maps names to shapes: another
    model's checkpoint) is skipped, and `warn` gets one line for it saying why. With `needs`,
    shards are loaded to check them; without, hashes are checked.
    """
    for step, folder in _step_folders(Path(root)):
        try:
            if needs is None:
                manifest = verify_checkpoint(folder)
            else:
                manifest, tensors, _ = load_checkpoint(folder)
                _check_needs(folder, tensors, needs)
            if manifest.step != step:
                raise ArtifactError(f"{folder / MANIFEST}: says step {manifest.step}, the folder step {step}")
        except ArtifactError as exc:
            if warn is not None:
                warn(f"skipping checkpoint {folder}: {exc}")
            continue
        return folder
    return None


def _check_needs(folder: Path, tensors: dict[str, torch.Tensor], needs: Mapping[str, tuple[int, ...]] | set[str]) -> None:
    missing = sorted(set(needs) - set(tensors))
    if missing:
        raise ArtifactError(f"{folder}: has no {missing[0]}" + (f" (and {len(missing) - 1} more)"
                            if len(missing) > 1 else "") + ", which the model needs (a shard missing "
                            "from its manifest, or another model's checkpoint)")
    if isinstance(needs, Mapping):
        for name, shape in needs.items():
            if tuple(tensors[name].shape) != tuple(shape):
                raise ArtifactError(f"{folder}: {name} has shape {tuple(tensors[name].shape)}, the model "
                                    f"{tuple(shape)} (another model's checkpoint)")
