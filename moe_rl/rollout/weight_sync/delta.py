"""Delta pushes (`rollout.weight_sync_delta`): after a full push, a source sends only what changed.

Each source keeps the values it last pushed, in the dtype the servers hold (`DeltaBase`), and
compares the new ones bit for bit: an unchanged tensor (an expert that got no tokens, a frozen
layer, and at RL learning rates most bf16 tensors of a step) is not sent at all, which every
SGLang loader takes (a push may carry any subset of a model's tensors). A changed one goes whole,
or, where the servers apply it, as its changed elements (`moe-rl serve`'s SPARSE_FORMAT: int32 flat
indices then the values, when that is smaller); SGLang has no loader for element deltas.

The base is valid only after a push every server took: a failed push, or a server that restarted
(it no longer reports the version pushed last), makes the next push full.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

from moe_rl.rollout.flat import back_to_back
from moe_rl.rollout.weight_sync.buckets import TensorMeta

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ALIGN = 8  # each payload of a sparse bucket starts at a multiple of 8 bytes


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width: equal bits compare equal (NaN, -0.0 included)."""
    return t.contiguous().reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def sparse_nbytes(nnz: int, itemsize: int) -> int:
    """Bytes of one sparse payload: int32 indices then values."""
    return nnz * (4 + itemsize)


def encode(prev: torch.Tensor | None, new: torch.Tensor, sparse: bool) -> tuple[torch.Tensor, int] | None:
    """What to send of `new` against the values last pushed (`prev`): None when nothing changed, else
    (payload, nnz): nnz -1 and the tensor itself when it goes whole, or nnz changed elements and their
    int32 indices + values as one uint8 tensor (only when `sparse` and smaller than the whole)."""
    out, _ = _encode(prev, new, sparse)
    return out


def _encode(prev: torch.Tensor | None, new: torch.Tensor, sparse: bool
            ) -> tuple[tuple[torch.Tensor, int] | None, int]:
    """`encode` and the number of elements whose bits changed (all of them without a comparable base)."""
    if prev is None or prev.shape != new.shape or prev.dtype != new.dtype:
        return (new, -1), new.numel()
    new_bits = _bits(new)
    diff = _bits(prev) != new_bits
    if not sparse:
        nnz = int(diff.sum())
        return (None if nnz == 0 else (new, -1)), nnz
    changed = diff.nonzero().reshape(-1)  # one pass gives both the count and the places
    nnz = changed.numel()
    if nnz == 0:
        return None, 0
    if sparse_nbytes(nnz, new.element_size()) >= new.numel() * new.element_size():
        return (new, -1), nnz
    payload = torch.cat([changed.to(torch.int32).view(torch.uint8), new_bits[changed].view(torch.uint8)])
    return (payload, nnz), nnz


def flatten_sparse(payloads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The payloads back to back as one uint8 tensor, each starting at a multiple of 8 bytes."""
    parts = []
    for p in payloads:
        raw = p.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        if raw.numel() % _ALIGN:
            parts.append(torch.zeros(_ALIGN - raw.numel() % _ALIGN, dtype=torch.uint8, device=raw.device))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def sparse_bucket_nbytes(metas: Sequence[TensorMeta], nnz: Sequence[int]) -> int:
    """The size of `flatten_sparse` of a bucket the metas (full shapes) and nnz describe."""
    total = 0
    for m, k in zip(metas, nnz):
        raw = m.nbytes if k < 0 else sparse_nbytes(k, m.itemsize)
        total += -(-raw // _ALIGN) * _ALIGN
    return total


def unflatten_sparse(flat: torch.Tensor, metas: Sequence[TensorMeta], nnz: Sequence[int]
                     ) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """Inverse of `flatten_sparse`: (name, values, flat int64 indices or None for a whole tensor)."""
    if len(metas) != len(nnz):
        raise ValueError(f"{len(metas)} tensors but {len(nnz)} nnz entries")
    out, offset = [], 0
    for m, k in zip(metas, nnz):
        dtype = getattr(torch, m.dtype)
        raw = m.nbytes if k < 0 else sparse_nbytes(k, m.itemsize)
        piece = flat[offset:offset + raw].clone()  # aligned storage of its own
        if k < 0:
            out.append((m.name, piece.view(dtype).reshape(m.shape), None))
        else:
            idx = piece[:4 * k].view(torch.int32).to(torch.int64)
            if k and (int(idx.min()) < 0 or int(idx.max()) >= m.numel):
                raise ValueError(f"{m.name}: delta indices outside its {m.numel} elements")
            out.append((m.name, piece[4 * k:].view(dtype), idx))
        offset += -(-raw // _ALIGN) * _ALIGN
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, the tensors and nnz describe {offset}")
    return out


class DeltaBase:
    """The values one source last pushed, per tensor; valid only after a push every server took."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.valid = False
        self.last_changed = 0  # elements changed in the tensor `encode` saw last

    def encode(self, name: str, new: torch.Tensor, sparse: bool) -> tuple[torch.Tensor, int] | None:
        """`encode` against this base (whole when the base is not valid), recording `new` as pushed:
        a push that fails invalidates the whole base, so recording before the servers took it is safe."""
        (out, self.last_changed), = self.encode_many([(name, new, sparse)])
        return out

    def encode_many(self, items: Sequence[tuple[str, torch.Tensor, bool]]
                    ) -> list[tuple[tuple[torch.Tensor, int] | None, int]]:
        """`encode` of each `(name, new, sparse)`, and its changed elements, in a few passes over all of
        them: per tensor, a compare, a count and a nonzero cost ~0.1 ms each in dispatch alone, which a
        push of thousands of expert tensors per rank pays on every step. The new values become the base
        as one flat buffer (each name a view into it), so the next push compares against it in place."""
        out: list[tuple[tuple[torch.Tensor, int] | None, int]] = [(None, 0)] * len(items)
        by_width: dict[int, list[int]] = {}
        for i, (_, t, _) in enumerate(items):
            by_width.setdefault(t.element_size(), []).append(i)
        for at in by_width.values():
            news = [items[i][1].detach() for i in at]
            prevs = [self.values.get(items[i][0]) if self.valid else None for i in at]
            same = [p is not None and p.shape == t.shape and p.dtype == t.dtype for p, t in zip(prevs, news)]
            flat = torch.cat([_bits(t) for t in news])  # the new base, and the side compared
            sizes = [t.numel() for t in news]
            starts = torch.tensor([0, *sizes], device=flat.device).cumsum(0)
            counts, places, local = [0] * len(at), None, None
            if any(same):
                base = back_to_back([_bits(p) for p in prevs]) if all(same) else None
                if base is None:  # a tensor without a base compares with itself: no change found there
                    base = torch.cat([_bits(p) if ok else _bits(t) for p, t, ok in zip(prevs, news, same)])
                places = (base != flat).nonzero().reshape(-1)
                owner = torch.searchsorted(starts[1:], places, right=True)
                counts = torch.bincount(owner, minlength=len(at)).tolist()
                local = (places - starts[owner]).to(torch.int32)
            ends = [0, *itertools.accumulate(counts)]  # where each tensor's changes start in `places`
            for j, i in enumerate(at):
                name, new, sparse = items[i]
                if not same[j]:
                    out[i] = ((new, -1), new.numel())
                elif counts[j] == 0:
                    out[i] = (None, 0)
                elif not sparse or sparse_nbytes(counts[j], new.element_size()) >= new.numel() * new.element_size():
                    out[i] = ((new, -1), counts[j])
                else:
                    lo, hi = ends[j], ends[j + 1]
                    payload = torch.cat([local[lo:hi].view(torch.uint8), flat[places[lo:hi]].view(torch.uint8)])
                    out[i] = ((payload, counts[j]), counts[j])
            offset = 0
            for j, i in enumerate(at):
                t = news[j]
                self.values[items[i][0]] = flat[offset:offset + sizes[j]].view(t.dtype).view(t.shape)
                offset += sizes[j]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.values.values())
