"""Checkpoint integrity: each file's size and SHA-256, written with the checkpoint, verified on resume.

A checkpoint directory `step_N/` holds one `rank_RRRRR.pt` per trainer rank and `meta.json`
(`{"step", "world_size", "files": {name: {"bytes", "sha256"}}}`), written last. A file that was
truncated, zero-filled or deleted afterwards no longer matches its record, and resume says
which file and how, instead of loading garbage (a zeroed page of Adam state loads silently)
or failing with an error that names no file. Checkpoints written before records existed
have no `files` entry: only their presence is checked.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

META = "meta.json"
_CHUNK = 1 << 20


def file_record(path: Path) -> dict[str, Any]:
    """`{"bytes", "sha256"}` of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def not_a_checkpoint(path: Path) -> str | None:
    """Why `path` is not a finished checkpoint directory, in words a user can act on; None if it is."""
    if not path.exists():
        near = sorted(p.name for p in path.parent.glob("step_*")) if path.parent.is_dir() else []
        return (f"{path} does not exist" + (f" (its folder holds {', '.join(near[-3:])})" if near else ""))
    if not path.is_dir():
        return f"{path} is a file, not a checkpoint directory (checkpoints/step_N)"
    if not (path / META).is_file():
        return (f"{path} is not a finished checkpoint (no {META}: a save that was interrupted, or not a "
                "checkpoints/step_N directory)")
    return None


def read_meta(ckpt: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(meta, None), or (None, what is wrong with `meta.json`)."""
    path = ckpt / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"{path} is missing (the checkpoint was not finished)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{path} is unreadable or not JSON ({e})"
    if not isinstance(meta, dict) or not {"step", "world_size"} <= set(meta):
        return None, f"{path} lacks step / world_size"
    return meta, None


def check_file(ckpt: Path, name: str, meta: dict[str, Any]) -> str | None:
    """What is wrong with file `name` of checkpoint `ckpt` (None when it matches its record)."""
    path = ckpt / name
    if not path.is_file():
        return f"{path} is missing"
    want = meta.get("files", {}).get(name)
    if want is None:
        return None if "files" not in meta else f"{path} has no record in {ckpt / META}"
    got = file_record(path)
    if got["bytes"] != want["bytes"]:
        return f"{path} has {got['bytes']} bytes, {want['bytes']} were written (truncated or overwritten)"
    if got["sha256"] != want["sha256"]:
        return f"{path} does not match the SHA-256 written with it (its contents changed)"
    return None
