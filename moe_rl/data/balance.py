"""Splitting sequences by token count: packing bins for microbatches, balanced DP shards.

Both are small number-partitioning problems over sequence lengths. Greedy rules
(first-fit decreasing, longest-processing-time first) are within a few percent of
optimal for RL batches, deterministic, and cost microseconds, so no solver is used.
"""
from __future__ import annotations


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity` tokens, with even fills.

    First-fit decreasing finds how many bins are needed; the sequences are then
    spread over that many bins by tokens (`balanced_shards`) when that still fits,
    so micro-batches carry similar work and the common row length (the fullest
    bin) is as short as it can be. Indices inside a bin keep their original order.
    Raises ValueError naming the sequence that cannot fit.
    """
    bins = _first_fit_decreasing(lengths, capacity)
    if not bins:
        return []
    even = balanced_shards(lengths, len(bins))
    if max(sum(lengths[i] for i in b) for b in even) <= capacity:
        return even
    return bins


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    if capacity < 1:
        raise ValueError(f"token budget must be >= 1, got {capacity}")
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        i = too_long[0]
        raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than the budget of {capacity} tokens per "
                         f"microbatch; raise parallel.max_tokens_per_microbatch to at least {max(lengths)}")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


def balanced_shards(lengths: list[int], num_shards: int) -> list[list[int]]:
    """Indices of `lengths` split into `num_shards` shards of near-equal token totals.

    Longest first, each to the shard with the fewest tokens so far (ties: fewer
    sequences, then lower shard). With at least `num_shards` sequences every shard
    gets one. Indices inside a shard keep their original order.
    """
    if num_shards < 1:
        raise ValueError(f"number of shards must be >= 1, got {num_shards}")
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    tokens = [0] * num_shards
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        s = min(range(num_shards), key=lambda k: (tokens[k], len(shards[k]), k))
        shards[s].append(i)
        tokens[s] += lengths[i]
    return [sorted(s) for s in shards]
