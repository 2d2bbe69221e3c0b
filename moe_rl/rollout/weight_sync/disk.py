"""`DiskSync` (rollout.weight_sync=disk): the trainer writes a HF checkpoint (safetensors) into
`root/vNNNNNN.tmp`, renames it to `root/vNNNNNN` once every rank finished, then rank 0 asks the
engine to load it (`/update_weights_from_disk`). Works with every engine and across nodes (a shared
filesystem); old versions are deleted."""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from moe_rl.dist.collectives import rank
from moe_rl.rollout.weight_sync.common import (ExportFn, WeightsArg, WeightSyncError, _all_errors, _describe,
                                               _engine_name, _export_fn, _from_rank0)

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^v(\d+)$")


def version_dir(root: str | Path, version: int) -> Path:
    """`root/v000042` for version 42."""
    return Path(root) / f"v{int(version):06d}"


def list_versions(root: str | Path) -> list[tuple[int, Path]]:
    """Committed version directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name))]
    return sorted(found)


def _remove_dir(path: Path) -> None:
    """Delete a directory so that no half-deleted `vN` is ever visible: rename first, then delete."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.deleting.{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class DiskSync:
    """Versioned HF checkpoints under `root`, loaded by the engine from disk.

    `root` must be visible to all trainer ranks and to the servers. The newest
    `keep_last` versions are kept, and always the one the engine serves.
    """

    def __init__(self, root: str | Path, keep_last: int = 2, group: Any = None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = int(keep_last)
        self.group = group
        self.served: Path | None = None  # the version dir the engine loaded last

    def close(self) -> None:
        """Nothing to leave (only the nccl sync holds a process group with the servers)."""

    def sync(self, version: int, export_fn: WeightsArg, engine: Any) -> Path:
        """Export, commit and load version `version` (collective; `engine` is used on rank 0 only).

        Returns the committed directory. Raises WeightSyncError on every rank when the
        export fails on any rank (then no `vN` directory exists and the served one is
        untouched) or when the engine refuses the weights (then `vN` stays for
        inspection and the previously served directory is kept).
        """
        if int(version) < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        final = version_dir(self.root, version)
        tmp = final.with_name(final.name + ".tmp")
        self._raise_from_rank0(self._prepare(final, tmp) if rank(self.group) == 0 else None)
        self._export(version, _export_fn(export_fn), tmp)
        error = None
        if rank(self.group) == 0:
            error = self._commit_and_load(version, tmp, final, engine)
        self._raise_from_rank0(error)
        self.served = final
        return final

    def _prepare(self, final: Path, tmp: Path) -> str | None:
        """Rank 0: clear leftovers of an earlier attempt at this version."""
        if self.served is not None and final == self.served:
            return f"version dir {final} is the one the engine serves; sync a new version number"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in (tmp, final):  # an earlier crash or a refused load of the same version
                if stale.exists():
                    shutil.rmtree(stale)
        except OSError as e:
            return f"cannot prepare {tmp}: {_describe(e)}"
        return None

    def _export(self, version: int, export_fn: ExportFn, tmp: Path) -> None:
        error = None
        try:
            export_fn(tmp)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"rank {rank(self.group)}: {_describe(e)}"
            log.exception("weight export of version %d failed", version)
        errors = _all_errors(error, self.group)  # also the barrier before the rename
        if errors:
            if rank(self.group) == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise WeightSyncError(f"export of weight version {version} into {tmp} failed ({'; '.join(errors)}); "
                                  f"the engine keeps serving {self.served or 'its current weights'}")

    def _commit_and_load(self, version: int, tmp: Path, final: Path, engine: Any) -> str | None:
        """Rank 0: check the export, rename it into place, make the engine load it, clean up."""
        problem = _checkpoint_problem(tmp)
        if problem:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"export of weight version {version} into {tmp} is incomplete: {problem}"
        os.replace(tmp, final)  # atomic: readers see no vN or a complete vN
        if engine is not None:
            try:
                load = getattr(engine, "update_weights_from_disk", None) or engine.update_weights
                load(str(final), str(version))
            except Exception as e:  # noqa: BLE001 - reported on every rank
                kept = self.served or "its previous weights"
                return (f"engine {_engine_name(engine)} refused weight version {version} from {final}: "
                        f"{_describe(e)}; it keeps serving {kept}")
        self.served = final
        self.cleanup()
        return None

    def _raise_from_rank0(self, error: str | None) -> None:
        """Raise rank 0's error (if any) on every rank."""
        error = _from_rank0(error, self.group)
        if error:
            raise WeightSyncError(error)

    def cleanup(self) -> list[Path]:
        """Rank 0: delete versions beyond the newest `keep_last` (never the served one) and stale .tmp dirs."""
        if rank(self.group) != 0:
            return []
        versions = list_versions(self.root)
        keep = {p for _, p in versions[-self.keep_last:]} | ({self.served} if self.served else set())
        removed = [p for _, p in versions if p not in keep]
        removed += [p for p in self.root.glob("v*.tmp") if p.is_dir()]
        for p in removed:
            _remove_dir(p)
        return removed


def _checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a loadable HF checkpoint, or None."""
    if not path.is_dir():
        return "the export wrote no directory"
    if not (path / "config.json").is_file():
        return "config.json is missing"
    if not any(path.glob("*.safetensors")):
        return "no .safetensors file"
    return None
