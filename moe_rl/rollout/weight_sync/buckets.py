"""Buckets of HF-named tensors: their metadata, SGLang's flattened layout, and the collection of every
rank's tensors on trainer rank 0, bucket by bucket."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from moe_rl.dist.collectives import all_gather_objects, rank
from moe_rl.dist.devices import compute_device
from moe_rl.rollout.fused_weights import fused_key, pair_fused
from moe_rl.rollout.weight_sync.common import NamedTensors, WeightSyncError, _from_rank0, _global_rank

@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor: HF name, shape, dtype name ("bfloat16"), owner rank."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    owner: int = 0

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, name: str, t: torch.Tensor, owner: int = 0) -> "TensorMeta":
        return cls(name, tuple(int(d) for d in t.shape), dtype_name(t.dtype), owner)


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang resolves with `getattr(torch, name)`: torch.bfloat16 -> "bfloat16"."""
    name = str(dtype).removeprefix("torch.")
    if getattr(torch, name, None) != dtype:
        raise ValueError(f"dtype {dtype} has no torch attribute name")
    return name


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Split tensors, in the given order, into buckets of at most `bucket_bytes` bytes.

    Greedy and deterministic: a tensor joins the current bucket when the bucket stays
    within `bucket_bytes` and the tensor's byte offset in the flattened bucket is a
    multiple of its element size (SGLang's FlattenedTensorBucket requires it);
    otherwise it starts a new bucket. A tensor larger than `bucket_bytes` gets a
    bucket of its own. No bucket is empty. Adjacent tensors that SGLang fuses inside one load
    (`moe_rl.rollout.fused_weights`) join or start a bucket together.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    used = 0
    for unit in _units(metas):
        end, fits = used, True
        for m in unit:
            fits = fits and end % m.itemsize == 0
            end += m.nbytes
        if current and not (fits and end <= bucket_bytes):
            buckets.append(current)
            current, used = [], 0
        current += unit
        used += sum(m.nbytes for m in unit)
    if current:
        buckets.append(current)
    return buckets


def _units(metas: Sequence[TensorMeta]) -> Iterator[list[TensorMeta]]:
    """The tensors one by one, adjacent partners of a fused pair as one unit."""
    unit: list[TensorMeta] = []
    for m in metas:
        key = fused_key(m.name)
        if unit and (key is None or key != fused_key(unit[-1].name)):
            yield unit
            unit = []
        unit.append(m)
    if unit:
        yield unit


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors back to back as one uint8 tensor `[sum of nbytes]` (SGLang's flattened_bucket layout)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten_bucket(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `flatten_bucket`: views into `flat` with each meta's dtype and shape."""
    out, offset = [], 0
    for m in metas:
        piece = flat[offset:offset + m.nbytes].view(getattr(torch, m.dtype)).reshape(m.shape)
        out.append((m.name, piece))
        offset += m.nbytes
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, metas describe {offset}")
    return out


@dataclass
class Bucket:
    """One bucket on rank 0: `metas[i]` describes `tensors[i]`; `index` of `count` buckets."""

    index: int
    count: int
    metas: list[TensorMeta]
    tensors: list[torch.Tensor]

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def pairs(self) -> list[tuple[str, torch.Tensor]]:
        return [(m.name, t) for m, t in zip(self.metas, self.tensors)]


def collect_to_rank0(named_tensors: NamedTensors, bucket_bytes: int, group: Any = None) -> Iterator[Bucket]:
    """Bring every rank's (name, tensor) pairs to rank 0, bucket by bucket (collective).

    Each rank first drains its own iterator (the policy's export iterator runs TP
    gathers inside, so ranks must not interleave other collectives with it), then
    all ranks agree on one bucket plan (rank-major order) and the owners send each
    bucket's tensors to rank 0 point-to-point. The sends and receives of bucket i + 1
    are posted before bucket i is yielded, so its transfer overlaps whatever rank 0 does
    with bucket i (the nccl sync broadcasts it to the servers, the tensor sync copies it).
    Yields (metas, tensors) on rank 0; yields nothing elsewhere, but every rank must
    exhaust the generator. Memory: each rank holds its own share until the end; rank 0
    two buckets more.
    """
    me = rank(group)
    local: list[tuple[str, torch.Tensor]] = pair_fused([(n, t.detach()) for n, t in named_tensors])
    metas_per_rank = all_gather_objects([TensorMeta.of(n, t, me) for n, t in local], group)
    metas = [m for per_rank in metas_per_rank for m in per_rank]
    _check_unique(metas)
    mine = iter(t for _, t in local)
    device = compute_device()  # NCCL groups take no host tensors; gloo takes either
    plan = list(_numbered(plan_buckets(metas, bucket_bytes)))

    def start(k: int) -> Any:
        # Owners post their sends only once rank 0 has posted its receives (it says so on the control
        # group): a send never waits on the default group while rank 0 talks to the servers about
        # the bucket before, however long that takes (NCCL's watchdog would abort the job).
        _from_rank0(k, group)
        return _start_exchange(plan[k][1], mine, me, device, plan[k][0], group)

    pending = start(0) if plan else None
    for index, (_, bucket) in enumerate(plan):
        nxt = start(index + 1) if index + 1 < len(plan) else None
        tensors = _finish_exchange(bucket, pending, me)
        if me == 0:
            yield Bucket(index, len(plan), bucket, tensors)
        pending = nxt


def _check_unique(metas: Sequence[TensorMeta]) -> None:
    seen: dict[str, int] = {}
    for m in metas:
        if m.name in seen:
            raise WeightSyncError(f"tensor {m.name!r} is produced by ranks {seen[m.name]} and {m.owner}; "
                                  "each tensor must come from exactly one rank")
        seen[m.name] = m.owner


def _numbered(buckets: list[list[TensorMeta]]) -> Iterator[tuple[int, list[TensorMeta]]]:
    """(index of the bucket's first tensor in the global order, bucket): p2p tags."""
    start = 0
    for b in buckets:
        yield start, b
        start += len(b)


def _start_exchange(bucket: list[TensorMeta], mine: Iterator[torch.Tensor], me: int, device: torch.device,
                    tag_base: int, group: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """Post one bucket's transfers: owners send their tensors to rank 0 as raw bytes, rank 0 receives.
    Returns the pending works and, on rank 0, the bucket's tensors (or their receive buffers)."""
    dst = _global_rank(group, 0)
    received: list[torch.Tensor] = []
    works = []
    for i, m in enumerate(bucket):
        tag = (tag_base + i) % (1 << 30)
        if m.owner == me:
            t = next(mine)
            if me == 0:
                received.append(t)
            elif m.numel:
                works.append(dist.isend(_as_bytes(t, device), dst=dst, group=group, tag=tag))
        elif me == 0:
            buf = torch.empty(m.nbytes, dtype=torch.uint8, device=device)
            if m.numel:
                works.append(dist.irecv(buf, src=_global_rank(group, m.owner), group=group, tag=tag))
            received.append(buf)
    return works, received


def _finish_exchange(bucket: list[TensorMeta], pending: tuple[list[Any], list[torch.Tensor]] | None,
                     me: int) -> list[torch.Tensor]:
    """Wait for a bucket's transfers; on rank 0 its tensors with their dtypes and shapes."""
    works, received = pending if pending is not None else ([], [])
    for w in works:
        w.wait()
    if me != 0:
        return []
    return [t if m.owner == 0 else t.view(getattr(torch, m.dtype)).reshape(m.shape)
            for m, t in zip(bucket, received)]


def _as_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Raw bytes go over any backend whatever the dtype (gloo has no p2p for some dtypes).
    return t.to(device).contiguous().reshape(-1).view(torch.uint8)
