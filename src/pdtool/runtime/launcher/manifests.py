"""The launcher's completion of checkpoints while the workers write their shards: a manifest
is written once every stage's shard of a step is there, so a checkpoint becomes complete
atomically, and a crash leaves it incomplete, never corrupt."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

from ...artifacts.checkpoint import MANIFEST, complete_checkpoint, has_shards
from ...errors import PdtoolError


class ManifestWriter(threading.Thread):
    """Writes the manifest of every checkpoint folder whose shards are all written. The first
    error (a full disk) stops it and is kept in `error`; the workers meet the same disk."""

    def __init__(self, root: Path, stages: int, plan_hash: str, meta: dict, run: str | None):
        super().__init__(daemon=True)
        self.root, self.stages, self.plan_hash, self.meta, self.run_id = root, stages, plan_hash, meta, run
        self.done = threading.Event()
        self.error: PdtoolError | None = None
        self.before = {path.name for path in root.glob("step-*")}  # never completes a folder it did not see made

    def run(self) -> None:
        while not self.done.wait(0.2) and self._completed():
            pass

    def stop(self) -> None:
        """With the workers gone: complete what can be; on a full disk, keep the newest checkpoint
        that fits (this run's unfinished folders make room for it), and the error. Once."""
        if self.done.is_set():
            return
        self.done.set()
        self.join()
        self.error = None
        if not self._completed():
            self._make_room()

    def _make_room(self) -> None:
        unfinished = list(self._unfinished())[::-1]  # newest first
        for folder in unfinished:  # shards missing: they can never complete now
            if not self._has_shards(folder):
                shutil.rmtree(folder, ignore_errors=True)
        for folder in unfinished:  # one that cannot be completed makes room for the next older one
            if folder.exists():
                try:
                    self._complete_one(folder)
                    return
                except PdtoolError:
                    shutil.rmtree(folder, ignore_errors=True)

    def _unfinished(self):
        """This run's checkpoint folders without a manifest, oldest first."""
        for folder in sorted(self.root.glob("step-*")):
            if folder.name not in self.before and not folder.is_symlink() and not (folder / MANIFEST).exists():
                yield folder

    def _has_shards(self, folder: Path) -> bool:
        return has_shards(folder, self.stages, self.run_id)

    def _completed(self) -> bool:
        """complete(), keeping its first error; whether it succeeded."""
        if self.error is not None:
            return False
        try:
            self.complete()
        except PdtoolError as exc:
            self.error = exc
        return self.error is None

    def complete(self) -> None:
        for folder in self._unfinished():
            if self._has_shards(folder):
                self._complete_one(folder)

    def _complete_one(self, folder: Path) -> None:
        complete_checkpoint(folder, self.stages, self.plan_hash, self.meta, self.run_id)
