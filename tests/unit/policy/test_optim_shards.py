"""`flat_range_boxes`: the regular boxes a data-parallel rank's flat range of a parameter splits into.

Reference: a tensor holding its own flat indices (`arange(n).reshape(shape)`); the boxes' slices,
read in order, must give exactly start..stop-1, and there are at most 2 * ndim - 1 of them.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from moe_rl.policy.optim_shards import flat_range_boxes


def _read(shape: tuple[int, ...], boxes) -> list[int]:
    t = torch.arange(math.prod(shape)).reshape(shape)
    out: list[int] = []
    for offset, size in boxes:
        assert len(offset) == len(size) == len(shape) and all(s > 0 for s in size)
        assert all(0 <= o and o + s <= d for o, s, d in zip(offset, size, shape)), (offset, size, shape)
        out += t[tuple(slice(o, o + s) for o, s in zip(offset, size))].reshape(-1).tolist()
    return out


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 3, 4, 5), (1, 6), (6, 1), (2, 1, 3)])
def test_the_boxes_of_every_flat_range_cover_it_exactly_in_order(shape):
    n = math.prod(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            boxes = flat_range_boxes(shape, start, stop)
            assert _read(shape, boxes) == list(range(start, stop)), (shape, start, stop, boxes)
            assert len(boxes) <= max(1, 2 * len(shape) - 1) or start == stop


def test_a_large_tensor_split_over_ranks_at_random_cuts():
    rng = random.Random(0)
    shape = (8, 6, 10, 4)  # an expert weight's shape on its prepended axis (8 experts)
    n = math.prod(shape)
    cuts = sorted(rng.sample(range(1, n), 5))
    ranges = list(zip([0, *cuts], [*cuts, n]))
    read = [i for a, b in ranges for i in _read(shape, flat_range_boxes(shape, a, b))]
    assert read == list(range(n))
    whole = flat_range_boxes(shape, 0, n)
    assert whole == [((0, 0, 0, 0), shape)]  # a rank owning the whole tensor saves it as one box
