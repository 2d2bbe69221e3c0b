"""Deterministic, resumable prompt order, sharded over data-parallel ranks.

Every rank computes the same global order from the seed alone, so ranks need
no communication to agree on a step's prompts:

    epoch e:  order_e = seeded permutation of 0 .. N-1 (a new one each epoch)
    step s:   global batch = order_e[s*B : (s+1)*B]     (B = batch_size)
    rank r:   its contiguous slice of B / dp_size indices

An epoch has N // B steps; the last N % B prompts of each permutation are
left out (a different few each epoch, since the order is reshuffled), so every
step's global batch holds B distinct prompts. The global order does not
depend on dp_size, so a run may resume with another number of DP ranks.
"""
from __future__ import annotations

import random
from typing import Any, Iterator, Sequence, TypeVar

__all__ = ["PromptSampler", "seeded_shuffle"]

T = TypeVar("T")


class PromptSampler:
    """Yields this rank's prompt indices for each RL step, forever (epoch after epoch).

    `batch_size` is the global number of prompts per step (`data.prompts_per_step`);
    each of the `dp_size` ranks gets `batch_size // dp_size` of them.
    `state_dict()` / `load_state_dict()` carry (epoch, position) so a resumed
    run continues with exactly the batches it would have seen.
    """

    def __init__(self, dataset_len: int, batch_size: int, seed: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, shuffle: bool = True):
        _check_sizes(dataset_len, batch_size, dp_rank, dp_size)
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # steps already taken in this epoch
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) cache

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.batch_size

    @property
    def per_rank(self) -> int:
        return self.batch_size // self.dp_size

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of all indices used in `epoch` (identity without shuffle)."""
        if self._order is None or self._order[0] != epoch:
            order = range(self.dataset_len)
            key = f"moe_rl.sampler:{self.seed}:{epoch}"
            self._order = (epoch, seeded_shuffle(order, key) if self.shuffle else list(order))
        return self._order[1]

    def global_batch(self, epoch: int, step: int) -> list[int]:
        """All ranks' indices of step `step` (0-based, within the epoch) of `epoch`."""
        start = step * self.batch_size
        return self.epoch_order(epoch)[start:start + self.batch_size]

    def next_batch(self) -> list[int]:
        """This rank's indices for the next step; advances the position."""
        batch = self.global_batch(self.epoch, self.position)
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        lo = self.dp_rank * self.per_rank
        return batch[lo:lo + self.per_rank]

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler stands, plus what must match on resume."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "dataset_len": self.dataset_len, "batch_size": self.batch_size,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; refuse one saved with a different data order.

        A changed seed, dataset size, batch size or shuffle flag would silently
        give other batches than the interrupted run, so it is an error.
        """
        for key in ("seed", "dataset_len", "batch_size", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state was saved with {key}={state[key]!r} but this run has "
                                 f"{key}={getattr(self, key)!r}; the resumed data order would differ")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ValueError(f"sampler state has epoch={epoch}, position={position}; "
                             f"expected epoch >= 0 and 0 <= position < {self.steps_per_epoch}")
        self.epoch, self.position = epoch, position


def _check_sizes(dataset_len: int, batch_size: int, dp_rank: int, dp_size: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}) with dp_size >= 1")
    if batch_size < 1 or batch_size % dp_size:
        raise ValueError(f"batch_size (prompts per step) = {batch_size} must be a positive multiple "
                         f"of the data-parallel size {dp_size}, so each rank gets the same number")
    if dataset_len < batch_size:
        raise ValueError(f"the dataset has {dataset_len} prompts, fewer than one step's "
                         f"batch_size={batch_size}; lower data.prompts_per_step")


def seeded_shuffle(items: Sequence[T], key: str) -> list[T]:
    """A copy of `items` in an order fixed by the string `key`.

    Fisher-Yates on `random.Random.random()` with a string seed, because Python
    guarantees both stay the same across versions (`random.shuffle` does not):
    a resumed run sees the same order even after an interpreter upgrade.
    """
    rng = random.Random(key)
    out = list(items)
    for i in range(len(out) - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        out[i], out[j] = out[j], out[i]
    return out
