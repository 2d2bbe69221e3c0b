"""Checkpoints of a run: every rank's state in `checkpoints/step_N/`, written atomically (a
`.tmp` directory renamed once all ranks are done) with each file's size and SHA-256 in
`meta.json` (`moe_rl.train.integrity`), so a crash leaves nothing half-saved and damage is named on
resume. The launchers read `latest_checkpoint` from here."""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.config import RunConfig
from moe_rl.dist.collectives import all_gather_objects, barrier, world_size
from moe_rl.train.integrity import check_file, file_record, read_meta

CHECKPOINTS = "checkpoints"


def save_checkpoint(recipe: Any, out: Path, step: int, keep_last: int) -> Path:
    """Every rank writes its state (`recipe.state_dict()`, with the step and the RNG states) into
    `step_N.tmp/`; rank 0 renames it to `step_N/` once all are done.

    A crash while writing leaves only a `.tmp` directory, which resume ignores. `meta.json`
    records every file's size and SHA-256 (`moe_rl.train.integrity`), so damage is found on resume.
    """
    root = out / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if recipe.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    state = recipe.state_dict() | {"step": step, "rng": _rng_state()}
    mine = f"rank_{recipe.rank:05d}.pt"
    torch.save(state, tmp / mine)
    records = all_gather_objects((mine, file_record(tmp / mine)))  # each rank hashes its own file
    if recipe.rank == 0:
        meta = {"step": step, "world_size": world_size(), "files": dict(records)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def latest_checkpoint(out: Path) -> Path | None:
    """The newest finished checkpoint (its meta.json written), intact or not."""
    done = _finished(out)
    return done[-1] if done else None


def _finished(out: Path) -> list[Path]:
    """The checkpoints whose meta.json was written (a finished save), oldest first."""
    return sorted(p for p in (out / CHECKPOINTS).glob("step_*") if (p / "meta.json").is_file())


def intact_checkpoint(out: Path, rank: int, log: Any) -> Path | None:
    """The newest finished checkpoint whose files all match their records (collective: every
    rank checks its own file and they agree); damaged ones are named and skipped."""
    for path in reversed(_finished(out)):
        problem = _agreed_problem(path, rank)
        if not problem:
            return path
        log.warning("skipping damaged checkpoint %s: %s", path, problem)
    return None


def _agreed_problem(path: Path, rank: int) -> str:
    """What is wrong with checkpoint `path` as any rank sees it ("" when every rank finds it intact)."""
    meta, problem = read_meta(path)
    if meta is not None:
        problem = check_file(path, f"rank_{rank:05d}.pt", meta)
    problems = [p for p in all_gather_objects(problem or "") if p]
    return "; ".join(dict.fromkeys(problems))


def resume(recipe: Any, cfg: RunConfig, out: Path, log: Any) -> int:
    """Load the checkpoint `train.resume` names (or with "auto" the newest intact one, skipping
    damaged ones with a warning that names the file) into `recipe` (`load_state_dict`); returns
    its step (0 if none)."""
    if not cfg.train.resume:
        return 0
    path = intact_checkpoint(out, recipe.rank, log) if cfg.train.resume == "auto" else Path(cfg.train.resume)
    if path is None:
        log.info("no intact checkpoint in %s: starting from step 1", out / CHECKPOINTS)
        return 0
    problem = _agreed_problem(path, recipe.rank)
    if problem:
        raise RuntimeError(f"cannot resume from {path}: {problem}")
    meta = read_meta(path)[0]
    if meta["world_size"] != world_size():
        raise RuntimeError(f"{path} was written by {meta['world_size']} ranks; this run has {world_size()} "
                           f"(resume with the same layout)")
    file = path / f"rank_{recipe.rank:05d}.pt"
    try:
        state = torch.load(file, weights_only=False)
    except Exception as e:  # a file that matches its record but will not load: say which
        raise RuntimeError(f"cannot load {file}: {type(e).__name__}: {e}") from e
    recipe.load_state_dict(state, path)
    _set_rng_state(state["rng"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
