"""Checkpoints of a run in `checkpoints/step_N/`, written atomically (a `.tmp` directory renamed
once all ranks are done) with each file's size and SHA-256 in `meta.json`
(`moe_rl.train.integrity`), so a crash leaves nothing half-saved and damage is named on resume.
The launchers read `latest_checkpoint` from here.

A checkpoint holds each megatron model of the recipe (`recipe.models()`: the policy, the critic)
as a megatron distributed checkpoint in its own directory (`policy/`, `critic/`;
moe_rl/policy/dist_ckpt.py), which any layout and world size loads, and every rank's other
state (data order, rewards, weight version, drift probe, RNG) in `rank_RRRRR.pt`. A run resumed
under another world size takes rank 0's (the data order is the run's, not a rank's) and draws
its drift probe set again. Checkpoints of the per-rank format before (`meta.json` without
`format`) hold the models in the rank files and resume with the world size that wrote them."""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.config import RunConfig
from moe_rl.dist.collectives import agree, all_gather_objects, barrier, world_size
from moe_rl.train.integrity import check_file, file_record, read_meta
from moe_rl.train.model_shape import model_shape

CHECKPOINTS = "checkpoints"
SHARDED = "sharded"  # meta.json "format": the models are megatron distributed checkpoints


class Checkpoints:
    """The run's checkpoint writer: `save(step)` writes `step_N.tmp/` on every rank; `finish` hashes
    its files into `meta.json` and renames it to `step_N/` once all ranks are done.

    A crash while writing leaves only a `.tmp` directory, which resume ignores. `meta.json`
    records every file's size and SHA-256 (`moe_rl.train.integrity`), so damage is found on resume.

    `async_save` (train.async_save): the models' files are written by forked writers
    (moe_rl/policy/dist_ckpt.py: AsyncSaves) while the next steps train; once every rank's
    writers are done, `poll()` at a step's start has each rank hash its share of the files in a
    thread (hashlib and file reads release the GIL, so the step trains meanwhile), and a later
    `poll()` that finds every rank's hashes done writes `meta.json` and renames the checkpoint;
    `wait()` blocks for all of it (the next save, the end of the run). Until then the checkpoint
    is a `.tmp` directory. Every method is collective: all ranks call them at the same points.
    """

    def __init__(self, recipe: Any, out: Path, keep_last: int, async_save: bool = False) -> None:
        self.recipe, self.root, self.keep_last, self.async_save = recipe, out / CHECKPOINTS, keep_last, async_save
        self.writing: tuple[Path, Path, int] | None = None  # (tmp, final, step) of the checkpoint in flight
        self._saves: Any = None
        self._hashing: Future | None = None  # this rank's share of the in-flight checkpoint's records
        self._hasher: ThreadPoolExecutor | None = None
        self.blocked_s = 0.0  # seconds the last save held the step (its collective part, its wait)
        self._model: dict[str, Any] | None = None  # the model's shape keys meta.json records, read once

    def save(self, step: int) -> Path:
        start = time.perf_counter()
        self.wait()
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.recipe.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        requests = [model.save_sharded(tmp / name, async_save=self.async_save)  # collective; any layout loads it
                    for name, model in self.recipe.models().items()]
        state = self.recipe.state_dict() | {"step": step, "rng": _rng_state()}
        torch.save(state, tmp / f"rank_{self.recipe.rank:05d}.pt")
        if self.async_save:
            if self._saves is None:
                from moe_rl.policy.dist_ckpt import AsyncSaves

                self._saves = AsyncSaves()
            for request in requests:
                self._saves.schedule(request)
            self.writing = (tmp, final, step)
        else:
            self._finish(tmp, final, step)
        self.blocked_s = time.perf_counter() - start
        return final

    @property
    def hashing(self) -> bool:
        """The checkpoint in flight is written, and its files are being hashed (or wait to be finished)."""
        return self._hashing is not None

    def poll(self) -> None:
        """Move the checkpoint in flight on without waiting: once every rank's writers are done,
        start hashing this rank's share of its files; once every rank's hashes are done, finish it."""
        if self.writing is None:
            return
        if self._hashing is None:
            if self._saves.done(blocking=False):
                if self._hasher is None:
                    self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")
                self._hashing = self._hasher.submit(_records, self.writing[0], self.recipe.rank, world_size())
        elif not agree(not self._hashing.done()):  # no rank is still hashing
            self._finish(*self.writing)

    def wait(self) -> None:
        """Finish the checkpoint in flight, waiting for its writers and its hashes."""
        if self.writing is not None:
            if self._hashing is None:
                self._saves.done(blocking=True)
            self._finish(*self.writing)

    def close(self) -> None:
        """The run ends abnormally: stop writers still running (their checkpoint stays `.tmp`). Local."""
        if self._saves is not None:
            self._saves.close()
        if self._hasher is not None:
            self._hasher.shutdown(wait=False, cancel_futures=True)

    def _finish(self, tmp: Path, final: Path, step: int) -> None:
        hashing, self.writing, self._hashing = self._hashing, None, None
        barrier()
        mine = hashing.result() if hashing is not None else _records(tmp, self.recipe.rank, world_size())
        records = all_gather_objects(mine)  # the files hashed in parallel, each rank its share
        if self.recipe.rank == 0:
            if self._model is None:
                self._model = model_shape(self.recipe.cfg)
            meta = {"step": step, "world_size": world_size(), "format": SHARDED, "layout": layout_name(self.recipe.cfg),
                    "model": self._model, "files": {k: v for part in records for k, v in part.items()}}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            done = sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
            for old in done[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()


def save_checkpoint(recipe: Any, out: Path, step: int, keep_last: int) -> Path:
    """One synchronous checkpoint of step `step` (`Checkpoints.save`, finished before it returns)."""
    return Checkpoints(recipe, out, keep_last).save(step)


def layout_name(cfg: RunConfig) -> str:
    """The trainer layout a checkpoint was written under, e.g. "tp1 pp1 vpp- ep2 etp1 x2 ranks"."""
    p = cfg.parallel
    return f"tp{p.tp} pp{p.pp} vpp{p.vpp or '-'} ep{p.ep} etp{p.etp} x{world_size()} ranks"


def _records(ckpt: Path, rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of this rank's share of the checkpoint's files (every `world`-th, by name)."""
    files = sorted(str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file())
    return {name: file_record(ckpt / name) for name in files[rank::world]}


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
        problem = _check_share(path, meta, rank)
    problems = [p for p in all_gather_objects(problem or "") if p]
    return "; ".join(dict.fromkeys(problems))


def _check_share(path: Path, meta: dict[str, Any], rank: int) -> str | None:
    """This rank's share of the checks: its own rank file in the per-rank format; in the sharded
    format every `world`-th recorded file (this run's world), so that all of them are checked."""
    if meta.get("format") != SHARDED:
        return check_file(path, f"rank_{rank:05d}.pt", meta) if rank < meta["world_size"] else None
    names = sorted(meta.get("files", {}))
    return next((p for p in (check_file(path, n, meta) for n in names[rank::world_size()]) if p), None)


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
    sharded = meta.get("format") == SHARDED
    same = meta["world_size"] == world_size() and meta.get("layout", layout_name(cfg)) == layout_name(cfg)
    if not sharded and not same:
        raise RuntimeError(f"{path} is in the per-rank format of earlier versions, written by {meta['world_size']} "
                           f"ranks; this run has {world_size()}: resume it once with train.world_size="
                           f"{meta['world_size']} and its layout, and the checkpoints after it reshard")
    file = path / f"rank_{recipe.rank if same else 0:05d}.pt"
    try:
        state = torch.load(file, weights_only=False)
    except Exception as e:  # a file that matches its record but will not load: say which
        raise RuntimeError(f"cannot load {file}: {type(e).__name__}: {e}") from e
    for name, model in recipe.models().items():
        if not ((path / name).is_dir() if sharded else state.get(name) is not None):
            raise RuntimeError(f"{path} holds no {name}: it was saved by a run without one")
        model.load_sharded(path / name) if sharded else model.load_state_dict(state[name])
    if not same:  # the probe set is a data-parallel rank's own samples: drawn again
        state["drift_state"] = {}
        log.info("resuming a checkpoint of %s under %s: the models reshard", meta.get("layout"), layout_name(cfg))
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
