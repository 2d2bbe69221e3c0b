"""SGLang's memory regions as `moe-rl serve` keeps them: what /release_memory_occupation gave up.

SGLang frees GPU memory (weights, KV cache, CUDA graphs) between the rollouts of a colocated run.
The local engine has nothing to give back on CPU, but it keeps SGLang 0.5.23's state and loses
what SGLang loses, so a caller that gets the protocol wrong fails here as it would on a GPU:

- without `--enable-memory-saver` SGLang's release frees nothing (its memory saver is a no-op
  adapter), which a colocated trainer finds out as an out-of-memory error: refused here;
- with it, a released weights region is paused, and on resume mapped again without its content
  (kept only with `--enable-weights-cpu-backup`; managers/scheduler_components/weight_updater.py,
  model_runner_components/load_model_utils.py): here the parameters become noise at release, so
  sampling after a release with no weight load in between gives garbage;
- while a region is released, generating or loading weights is refused (`MemoryReleasedError`);
- releasing a released tag again is a no-op; resuming one that is not released raises, as
  SGLang's scheduler does (it removes each tag from its released set).
"""
from __future__ import annotations

from typing import Sequence

import torch

from moe_rl.rollout.engine import RolloutError

# SGLang's memory regions (GPU_MEMORY_ALL_TYPES, sglang/srt/constants.py): what
# /release_memory_occupation frees when it is given no tags.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class MemoryReleasedError(RolloutError):
    """The engine's memory is released (`release_memory_occupation`): it cannot generate or load weights."""


class MemoryRegions:
    """The released tags of one engine, and what a release does to its model's weights."""

    def __init__(self, memory_saver: bool = False, weights_cpu_backup: bool = False) -> None:
        self.memory_saver = bool(memory_saver)  # SGLang's --enable-memory-saver: release frees memory
        self.weights_cpu_backup = bool(weights_cpu_backup)  # --enable-weights-cpu-backup: weights survive it
        self._released: set[str] = set()
        self._losses = 0

    @property
    def released(self) -> list[str]:
        """The memory tags currently released, in SGLang's order ([] when resident)."""
        return [t for t in MEMORY_TAGS if t in self._released]

    def release(self, tags: Sequence[str] | None, model: torch.nn.Module) -> None:
        """Release `tags` (None or []: all); refused (ValueError) for an unknown tag and without the memory
        saver. Releasing "weights" without the CPU backup loses `model`'s weights."""
        wanted = tags_of(tags, "release_memory_occupation")
        if not self.memory_saver:
            raise ValueError("release_memory_occupation: the server was started without --enable-memory-saver, "
                             "so SGLang would free no memory (a colocated trainer would run out of it); start "
                             "it with --enable-memory-saver")
        if "weights" in wanted and "weights" not in self._released and not self.weights_cpu_backup:
            self._lose(model)
        self._released.update(wanted)

    def resume(self, tags: Sequence[str] | None) -> None:
        """Take back `tags` (None or []: all); a tag that is not released is refused and nothing changes."""
        wanted = tags_of(tags, "resume_memory_occupation")
        missing = [t for t in wanted if t not in self._released]
        if missing:
            raise ValueError(f"resume_memory_occupation: memory {missing} is not released (released: "
                             f"{self.released}); resume only what /release_memory_occupation released")
        self._released.difference_update(wanted)

    def check_resident(self, op: str, needs: Sequence[str]) -> None:
        gone = [t for t in needs if t in self._released]
        if gone:
            raise MemoryReleasedError(f"{op} refused: the engine's memory {gone} is released; call "
                                      f"/resume_memory_occupation (resume_memory_occupation()) first")

    def _lose(self, model: torch.nn.Module) -> None:
        """What a paused weights region holds after resume: not the weights (here: noise)."""
        self._losses += 1  # a generator of its own: the engine's sampling seeds stay as they were
        noise = torch.Generator(device="cpu").manual_seed(self._losses)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=noise, dtype=torch.float32).to(p.dtype))


def tags_of(tags: Sequence[str] | None, op: str) -> list[str]:
    """The tags a release or resume names (None or []: all of MEMORY_TAGS), each checked."""
    if tags is None or len(tags) == 0:
        return list(MEMORY_TAGS)
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"{op}: tags must be a list of strings from {list(MEMORY_TAGS)}, got {tags!r}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"{op}: unknown memory tags {unknown}; SGLang's tags are {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))
