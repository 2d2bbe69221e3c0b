"""Several tensors as one flat tensor without a copy where they allow it: a received bucket's
tensors (`unflatten_bucket`) and a delta push's base (`DeltaBase`) lie back to back in one
storage, and one elementwise pass over the whole costs a fraction of one per tensor."""
from __future__ import annotations

from typing import Sequence

import torch


def back_to_back(values: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The elements of `values` (one dtype) as one flat view when they lie back to back, in order and
    contiguous, in one storage; None otherwise."""
    first = values[0]
    at, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for v in values:
        if not v.is_contiguous() or v.storage_offset() != at or v.untyped_storage().data_ptr() != storage:
            return None
        at += v.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (at - first.storage_offset(),))


def joined(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The elements of `values` (one dtype) as one flat tensor: `back_to_back`'s view, else a copy."""
    view = back_to_back(values)
    return view if view is not None else torch.cat([v.reshape(-1) for v in values])
