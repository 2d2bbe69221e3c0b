"""A route: the expert ids a token's router chose, `[..., layers, top_k]`, stored in the smallest
integer type that holds every id. One rule for every stored route (the engine's, the recorded
ones, the drift measurement's), so a route moves between them without a cast that could wrap an id.

- `route_dtype(E)`: uint8 up to 256 experts, int16 up to 32768, int32 beyond (never truncating).
- `route_np_dtype(E)`: the same type as numpy names it (the engine's rows are numpy arrays).
- `record_dtype(E)`: the recording buffer's, one id more (id + 1, 0 = this rank saw no route).
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["record_dtype", "route_dtype", "route_np_dtype"]


def route_dtype(num_experts: int) -> torch.dtype:
    """Smallest torch dtype holding ids 0 .. num_experts - 1: uint8 <= 256, int16 <= 32768, else int32.

    Ids are never truncated: 257 experts get int16. ValueError for fewer than 1 expert or more than int32.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    for dt in (torch.uint8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dt).max:
            return dt
    raise ValueError(f"num_experts={num_experts} does not fit in int32")


def route_np_dtype(num_experts: int) -> np.dtype:
    """`route_dtype` as numpy names it."""
    return np.dtype(str(route_dtype(num_experts)).removeprefix("torch."))


def record_dtype(num_experts: int) -> torch.dtype:
    """The recording buffer's type: expert id + 1 (0 = not seen on this rank), so `route_dtype` of one id
    more (uint8 up to 255 experts, int16 for DeepSeek-V3's 256 and Kimi-K2's 384)."""
    return route_dtype(num_experts + 1)
