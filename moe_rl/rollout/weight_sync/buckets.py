"""Buckets of HF-named tensors: their metadata, SGLang's flattened layout, a rank's own tensors cut into
buckets as they are produced (`local_buckets`), and the colocated sync's collection of every rank's
buckets on trainer rank 0, one message per bucket (`collect_to_rank0`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from moe_rl.dist.collectives import all_gather_objects, rank
from moe_rl.dist.devices import compute_device
from moe_rl.rollout.fused_weights import fused_key, partner
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
    sizes = [m.nbytes for m in metas]
    if sum(sizes) != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, metas describe {sum(sizes)}")
    return [(m.name, piece.view(getattr(torch, m.dtype)).view(m.shape)) for m, piece in zip(metas, flat.split(sizes))]


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


def check_unique(metas: Sequence[TensorMeta]) -> None:
    """Each tensor comes from exactly one rank."""
    seen: dict[str, int] = {}
    for m in metas:
        if m.name in seen:
            raise WeightSyncError(f"tensor {m.name!r} is produced by ranks {seen[m.name]} and {m.owner}; "
                                  "each tensor must come from exactly one rank")
        seen[m.name] = m.owner


def paired_lazily(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs` as they come, except that the first tensor of a fused pair waits for its partner and
    leaves with it (`pair_fused` for a stream: it holds at most one layer's attention tensor)."""
    held: dict[str, tuple[str, torch.Tensor]] = {}
    for name, t in pairs:
        key = fused_key(name)
        if key is None:
            yield name, t
        elif key in held:
            yield held.pop(key)
            yield name, t
        else:
            held[key] = (name, t)
    yield from held.values()  # a lone half: the receiver names it


def local_buckets(pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, owner: int = 0
                  ) -> Iterator[list[tuple[TensorMeta, torch.Tensor]]]:
    """This rank's tensors cut into buckets as they are produced (the rules of `plan_buckets`: at most
    `bucket_bytes`, each offset a multiple of the element size, a fused pair in one bucket), so a rank
    holds one bucket while it fills it, never its whole share."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    current: list[tuple[TensorMeta, torch.Tensor]] = []
    used = 0
    unit: list[tuple[TensorMeta, torch.Tensor]] = []
    for name, t in paired_lazily(pairs):
        unit.append((TensorMeta.of(name, t, owner), t))
        if fused_key(name) is not None and len(unit) == 1 and partner(name) is not None:
            continue  # wait for the partner: the pair is one unit
        end, fits = used, True
        for m, _ in unit:
            fits = fits and end % m.itemsize == 0
            end += m.nbytes
        if current and not (fits and end <= bucket_bytes):
            yield current
            current, used = [], 0
        current += unit
        used += sum(m.nbytes for m, _ in unit)
        unit = []
    current += unit
    if current:
        yield current


def collect_to_rank0(named_tensors: NamedTensors, bucket_bytes: int, group: Any = None) -> Iterator[Bucket]:
    """Bring every rank's (name, tensor) pairs to rank 0, one message per bucket (collective).

    Each rank first drains its own iterator (the policy's export iterator runs TP gathers
    inside, and rank 0 waits on the others here, so the two must not interleave) and cuts it
    into its own buckets; the ranks agree on the list of (owner, bucket), and each owner sends
    each of its buckets as one flattened message. The transfer of bucket i + 1 is posted before
    bucket i is yielded, so it overlaps what rank 0 does with bucket i. Yields on rank 0 only,
    but every rank must exhaust the generator. Memory: each rank holds its own share; rank 0
    two received buckets more.
    """
    me = rank(group)
    local = list(local_buckets(((n, t.detach()) for n, t in named_tensors), bucket_bytes, me))
    per_rank = all_gather_objects([[m for m, _ in b] for b in local], group)
    check_unique([m for buckets in per_rank for b in buckets for m in b])
    plan = [(owner, k, b) for owner, buckets in enumerate(per_rank) for k, b in enumerate(buckets)]
    device = compute_device()  # NCCL groups take no host tensors; gloo takes either

    def start(i: int) -> tuple[Any, Any]:
        # Owners post their send only once rank 0 has posted its receive (it says so on the control
        # group): a send never waits on the default group while rank 0 loads the bucket before.
        _from_rank0(i, group)
        owner, k, metas = plan[i]
        if owner == me:
            flat = flatten_bucket([t.to(device) for _, t in local[k]])
            if me == 0:
                return None, flat
            local[k] = []  # sent: the flattened copy is all this rank still holds of it
            return dist.isend(flat, dst=_global_rank(group, 0), group=group, tag=i % (1 << 30)), flat
        if me == 0:
            buf = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device=device)
            return dist.irecv(buf, src=_global_rank(group, owner), group=group, tag=i % (1 << 30)), buf
        return None, None

    pending = start(0) if plan else None
    for i, (_, _, metas) in enumerate(plan):
        nxt = start(i + 1) if i + 1 < len(plan) else None
        work, flat = pending
        if work is not None:
            work.wait()
        if me == 0:
            yield Bucket(i, len(plan), list(metas), [t for _, t in unflatten_bucket(flat, metas)])
        pending = nxt
