"""Weight sync, trainer -> rollout engines, after each policy update.

Three ways, chosen by `rollout.weight_sync` (`make_weight_sync`):

- `DiskSync` (disk): the trainer writes a HF checkpoint (safetensors) into
  `root/vNNNNNN.tmp`, renames it to `root/vNNNNNN` once every rank finished, then
  rank 0 asks the engine to load it (`/update_weights_from_disk`). Works with every
  engine and across nodes (shared filesystem); old versions are deleted.
- `TensorSync` (tensor): the HF-named tensors are sent to rank 0, which copies
  them into a `LocalEngine` living in its own process. No files.
- `NcclSync` (nccl): rank 0 joins a process group with the SGLang servers
  (`/init_weights_update_group`) and broadcasts the tensors bucket by bucket while
  each server receives them (`/update_weights_from_distributed`). GPU only.

Every `sync` is collective: all trainer ranks call it, in the same order, and all
of them raise the same `WeightSyncError` when any part failed, so no rank is left
waiting in a collective the others skipped.

The policy side supplies the weights; this module never imports megatron (only
`moe_rl/policy/` does). A weights source is either
- an `export_fn(out_dir)` (collective) that writes a HF checkpoint, for DiskSync;
- an iterable of `(hf_name, tensor)` pairs, each tensor yielded by exactly one rank
  (as `moe_rl.policy.convert.iter_hf_tensors` does), for TensorSync / NcclSync;
- or an object with `export(out_dir)` and `named_tensors()` methods (see
  `MegatronWeights`), usable with all three.

SGLang payloads (sglang 0.5.23, sglang/srt/managers/io_struct.py):
`InitWeightsUpdateGroupReqInput{master_address, master_port, rank_offset,
world_size, group_name, backend}`; server i's TP rank r joins as
`rank_offset + r`, the trainer is rank 0.
`UpdateWeightsFromDistributedReqInput{names, dtypes, shapes, group_name,
flush_cache, abort_all_requests, weight_version, load_format}`; dtypes are torch
attribute names (`getattr(torch, dtype)`: "bfloat16"). With
`load_format="flattened_bucket"` one uint8 tensor holding the bucket's tensors
back to back is broadcast from rank 0, and each tensor's byte offset must be a
multiple of its element size (sglang/srt/weight_sync/tensor_bucket.py
`FlattenedTensorBucket.empty`); with `load_format=None` each tensor is broadcast
on its own, in `names` order. Since 0.5.23 the updates run inside
`/begin_weight_update` ... `/end_weight_update`; servers without those
endpoints (404) are updated without them.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, Union, runtime_checkable

import torch
import torch.distributed as dist

from moe_rl.collectives import all_errors, all_gather_objects, broadcast_object
from moe_rl.devices import compute_device

log = logging.getLogger(__name__)

ExportFn = Callable[[Path], Any]
NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the version, the directory or bucket, and the engine."""


@runtime_checkable
class PolicyWeights(Protocol):
    """The trainer's weights, in both forms a sync may need (both collective)."""

    def export(self, out_dir: Path) -> Any:
        """Write a HF checkpoint (config.json + safetensors) into `out_dir`."""
        ...

    def named_tensors(self) -> NamedTensors:
        """(HF name, full tensor) pairs; each tensor is yielded by exactly one rank."""
        ...


WeightsArg = Union[ExportFn, NamedTensors, PolicyWeights]


# ----------------------------------------------------------------------------- process-group helpers

def _rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _world(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _global_rank(group: Any, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _all_errors(error: str | None, group: Any = None) -> list[str]:
    """Every rank's error (None = fine), in rank order; doubles as a barrier (on the control group
    unless `group` is given: rank 0 may arrive from a long HTTP call)."""
    return all_errors(error, group)


def _from_rank0(obj: Any, group: Any = None) -> Any:
    """`obj` as rank 0 of `group` (default: the control group) has it, on every rank."""
    return broadcast_object(obj, group)


def _engine_name(engine: Any) -> str:
    urls = getattr(engine, "urls", None)
    if urls:
        return f"{type(engine).__name__}({', '.join(map(str, urls))})"
    path = getattr(engine, "model_path", None)
    return f"{type(engine).__name__}({path})" if path else type(engine).__name__


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- weight sources

def _export_fn(weights: WeightsArg) -> ExportFn:
    if isinstance(weights, PolicyWeights):
        return weights.export
    if callable(weights):
        return weights
    raise TypeError("DiskSync needs an export_fn(out_dir) or an object with export(out_dir)")


def _named_tensors(weights: WeightsArg) -> NamedTensors:
    if isinstance(weights, PolicyWeights):
        return weights.named_tensors()
    if isinstance(weights, Mapping):
        return weights.items()
    if callable(weights):
        raise TypeError("this sync sends tensors: pass (name, tensor) pairs or an object with named_tensors()")
    return weights


@dataclass
class MegatronWeights:
    """`PolicyWeights` of megatron model chunks (imports `moe_rl.policy.convert` only when used).

    hf_config: the HF config.json dict written with each export; aux_dir: a HF dir
    whose tokenizer / generation files are copied next to the weights; dtype: cast on export.
    """

    chunks: list[Any]
    arch: Any
    hf_config: dict[str, Any]
    dtype: torch.dtype | None = None
    aux_dir: str | Path | None = None

    def export(self, out_dir: Path) -> Any:
        from moe_rl.policy.convert import copy_aux_files, export_hf

        result = export_hf(self.chunks, out_dir, self.arch, self.hf_config, dtype=self.dtype)
        if self.aux_dir is not None and _rank() == 0:
            copy_aux_files(self.aux_dir, out_dir)
        return result

    def named_tensors(self) -> NamedTensors:
        from moe_rl.policy.convert import iter_hf_tensors

        # Unsharded tensors may share storage with the parameters: receivers copy, never keep them.
        for name, t in iter_hf_tensors(self.chunks, self.arch):
            yield name, (t if self.dtype is None else t.to(self.dtype))


# ----------------------------------------------------------------------------- disk

_VERSION_DIR = re.compile(r"^v(\d+)$")


def version_dir(root: str | Path, version: int) -> Path:
    """`root/v000042` for version 42."""
    return Path(root) / f"v{int(version):06d}"


def list_versions(root: str | Path) -> list[tuple[int, Path]]:
    """Committed version directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name))]
    return sorted(found)


def _remove_dir(path: Path) -> None:
    """Delete a directory so that no half-deleted `vN` is ever visible: rename first, then delete."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.deleting.{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class DiskSync:
    """Versioned HF checkpoints under `root`, loaded by the engine from disk.

    `root` must be visible to all trainer ranks and to the servers. The newest
    `keep_last` versions are kept, and always the one the engine serves.
    """

    def __init__(self, root: str | Path, keep_last: int = 2, group: Any = None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = int(keep_last)
        self.group = group
        self.served: Path | None = None  # the version dir the engine loaded last

    def sync(self, version: int, export_fn: WeightsArg, engine: Any) -> Path:
        """Export, commit and load version `version` (collective; `engine` is used on rank 0 only).

        Returns the committed directory. Raises WeightSyncError on every rank when the
        export fails on any rank (then no `vN` directory exists and the served one is
        untouched) or when the engine refuses the weights (then `vN` stays for
        inspection and the previously served directory is kept).
        """
        if int(version) < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        final = version_dir(self.root, version)
        tmp = final.with_name(final.name + ".tmp")
        self._raise_from_rank0(self._prepare(final, tmp) if _rank(self.group) == 0 else None)
        self._export(version, _export_fn(export_fn), tmp)
        error = None
        if _rank(self.group) == 0:
            error = self._commit_and_load(version, tmp, final, engine)
        self._raise_from_rank0(error)
        self.served = final
        return final

    def _prepare(self, final: Path, tmp: Path) -> str | None:
        """Rank 0: clear leftovers of an earlier attempt at this version."""
        if self.served is not None and final == self.served:
            return f"version dir {final} is the one the engine serves; sync a new version number"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in (tmp, final):  # an earlier crash or a refused load of the same version
                if stale.exists():
                    shutil.rmtree(stale)
        except OSError as e:
            return f"cannot prepare {tmp}: {_describe(e)}"
        return None

    def _export(self, version: int, export_fn: ExportFn, tmp: Path) -> None:
        error = None
        try:
            export_fn(tmp)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"rank {_rank(self.group)}: {_describe(e)}"
            log.exception("weight export of version %d failed", version)
        errors = _all_errors(error, self.group)  # also the barrier before the rename
        if errors:
            if _rank(self.group) == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise WeightSyncError(f"export of weight version {version} into {tmp} failed ({'; '.join(errors)}); "
                                  f"the engine keeps serving {self.served or 'its current weights'}")

    def _commit_and_load(self, version: int, tmp: Path, final: Path, engine: Any) -> str | None:
        """Rank 0: check the export, rename it into place, make the engine load it, clean up."""
        problem = _checkpoint_problem(tmp)
        if problem:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"export of weight version {version} into {tmp} is incomplete: {problem}"
        os.replace(tmp, final)  # atomic: readers see no vN or a complete vN
        if engine is not None:
            try:
                load = getattr(engine, "update_weights_from_disk", None) or engine.update_weights
                load(str(final), str(version))
            except Exception as e:  # noqa: BLE001 - reported on every rank
                kept = self.served or "its previous weights"
                return (f"engine {_engine_name(engine)} refused weight version {version} from {final}: "
                        f"{_describe(e)}; it keeps serving {kept}")
        self.served = final
        self.cleanup()
        return None

    def _raise_from_rank0(self, error: str | None) -> None:
        """Raise rank 0's error (if any) on every rank."""
        error = _from_rank0(error, self.group)
        if error:
            raise WeightSyncError(error)

    def cleanup(self) -> list[Path]:
        """Rank 0: delete versions beyond the newest `keep_last` (never the served one) and stale .tmp dirs."""
        if _rank(self.group) != 0:
            return []
        versions = list_versions(self.root)
        keep = {p for _, p in versions[-self.keep_last:]} | ({self.served} if self.served else set())
        removed = [p for _, p in versions if p not in keep]
        removed += [p for p in self.root.glob("v*.tmp") if p.is_dir()]
        for p in removed:
            _remove_dir(p)
        return removed


def _checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a loadable HF checkpoint, or None."""
    if not path.is_dir():
        return "the export wrote no directory"
    if not (path / "config.json").is_file():
        return "config.json is missing"
    if not any(path.glob("*.safetensors")):
        return "no .safetensors file"
    return None


# ----------------------------------------------------------------------------- buckets

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
    bucket of its own. No bucket is empty.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    used = 0
    for m in metas:
        fits = used + m.nbytes <= bucket_bytes and used % m.itemsize == 0
        if current and not fits:
            buckets.append(current)
            current, used = [], 0
        current.append(m)
        used += m.nbytes
    if current:
        buckets.append(current)
    return buckets


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


# ----------------------------------------------------------------------------- collect on rank 0

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
    me = _rank(group)
    local: list[tuple[str, torch.Tensor]] = [(n, t.detach()) for n, t in named_tensors]
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


# ----------------------------------------------------------------------------- tensor (in process)

class TensorSync:
    """HF-named tensors from all ranks into an engine in rank 0's process (a `LocalEngine`).

    atomic=True gathers everything first and updates the engine with one call, which
    validates every name and shape before copying (a bad update changes nothing);
    atomic=False updates bucket by bucket (less memory on rank 0, not all-or-nothing).
    """

    def __init__(self, bucket_bytes: int = 256 << 20, atomic: bool = True, group: Any = None):
        self.bucket_bytes = int(bucket_bytes)
        self.atomic = atomic
        self.group = group

    def sync(self, version: int, named_tensors: WeightsArg, engine: Any) -> int:
        """Send the weights to `engine` on rank 0 (collective). Returns the number of tensors sent."""
        error: str | None = None
        staged: list[tuple[str, torch.Tensor]] = []
        count = 0
        for bucket in collect_to_rank0(_named_tensors(named_tensors), self.bucket_bytes, self.group):
            count += len(bucket.metas)
            if self.atomic:
                staged += bucket.pairs
            elif error is None:  # after a failure keep receiving: the senders must finish
                error = self._load(engine, bucket.pairs, str(version) if bucket.last else None, version)
        if _rank(self.group) == 0 and error is None and (self.atomic or not count):
            error = self._load(engine, staged, str(version), version)
        error = _from_rank0(error, self.group)
        if error:
            raise WeightSyncError(error)
        return int(_from_rank0(count, self.group))

    @staticmethod
    def _load(engine: Any, pairs: list[tuple[str, torch.Tensor]], tag: str | None, version: int) -> str | None:
        try:
            engine.update_weights_from_tensors(pairs, tag)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            return f"engine {_engine_name(engine)} refused weight version {version} ({len(pairs)} tensors): " \
                   f"{_describe(e)}"
        return None


# ----------------------------------------------------------------------------- nccl (SGLang)

def group_rank_offsets(server_tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Rank offset of each server in the update group (trainer = rank 0) and the group's world size."""
    offsets, nxt = [], 1
    for tp in server_tp_sizes:
        if int(tp) < 1:
            raise ValueError(f"server tp sizes must be >= 1, got {list(server_tp_sizes)}")
        offsets.append(nxt)
        nxt += int(tp)
    return offsets, nxt


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str = "nccl") -> dict[str, Any]:
    """Body of POST /init_weights_update_group (InitWeightsUpdateGroupReqInput)."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_payload(bucket: Sequence[TensorMeta], group_name: str, *, flush_cache: bool,
                   weight_version: str | None, load_format: str | None = "flattened_bucket") -> dict[str, Any]:
    """Body of POST /update_weights_from_distributed (UpdateWeightsFromDistributedReqInput) for one bucket."""
    body: dict[str, Any] = {
        "names": [m.name for m in bucket],
        "dtypes": [m.dtype for m in bucket],
        "shapes": [list(m.shape) for m in bucket],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": False,
        "weight_version": weight_version,
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


def bucket_payloads(buckets: Sequence[Sequence[TensorMeta]], group_name: str, version: int | str, *,
                    flush_cache: bool = True, load_format: str | None = "flattened_bucket") -> list[dict[str, Any]]:
    """One update body per bucket: only the last one flushes the cache and sets the weight version,
    so a server never reports the new version while it still holds part of the old weights."""
    last = len(buckets) - 1
    return [update_payload(b, group_name, flush_cache=flush_cache and i == last,
                           weight_version=str(version) if i == last else None, load_format=load_format)
            for i, b in enumerate(buckets)]


def _post_json(url: str, path: str, payload: Any, timeout: float, keys: Any = None) -> tuple[int, Any]:
    """POST JSON (with the run's Bearer key when `keys`, a RunKeys, is given); returns (HTTP status,
    parsed body or text). Connection problems raise WeightSyncError."""
    headers = {"Content-Type": "application/json", **(keys.header(path) if keys is not None else {})}
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(payload).encode(), method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise WeightSyncError(f"server {url}: POST {path} failed: {_describe(e)}") from None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")[:500]


def _reply_error(url: str, path: str, status: int, body: Any) -> str | None:
    if status == 200 and (not isinstance(body, dict) or body.get("success", True)):
        return None
    msg = body.get("message", body) if isinstance(body, dict) else body
    return f"server {url} {path} (HTTP {status}): {msg}"


def new_custom_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                     timeout: timedelta = timedelta(minutes=10)) -> Any:
    """A process group outside the default one, joined with the SGLang servers.

    The same construction as SGLang's `init_custom_process_group`
    (sglang/srt/utils/common.py): rendezvous on `init_method`, a PrefixStore named
    after the group, then torch's group helper. Uses torch internals, as SGLang does.
    """
    from torch.distributed.distributed_c10d import (PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` in a daemon thread: a call left waiting on a server (an update group that never
    forms, an HTTP call of `http_timeout`) must not hold up the process's exit, as an executor's would."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            done.set_exception(e)

    threading.Thread(target=run, name=f"weight-sync-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return done


class NcclSync:
    """Broadcast the trainer's weights from rank 0 to SGLang servers (`rollout.weight_sync=nccl`).

    admin_urls: the servers themselves (not the router). server_tp_sizes: each
    server's --tp-size (one int for all). master_address / master_port: where rank 0
    listens for the update group; the servers must reach it. backend "nccl" (GPU);
    "gloo" works for CPU tests. dtype: cast before sending (e.g. the servers' bf16).

    Rejoining long-lived servers: each connect forms a group of a new name
    (`group_name` + a random suffix), since torch refuses a second group of a name that
    exists (`_new_process_group_helper`), and a trainer that died without `close()`
    (NCCL abort, OOM kill, kill -9) leaves its group registered in every server. Before
    joining, rank 0 closes what such a trainer may have left open on the servers, best
    effort: an update session (`/end_weight_update`; `/begin_weight_update` is refused
    while one is open) and the group it joined last, whose name `state_file` keeps
    (`/destroy_weights_update_group`).
    """

    def __init__(self, admin_urls: Sequence[str], *, master_address: str, master_port: int,
                 server_tp_sizes: int | Sequence[int] = 1, group_name: str = "moe_rl_weight_sync",
                 backend: str = "nccl", bucket_bytes: int = 1 << 30, dtype: torch.dtype | None = None,
                 load_format: str | None = "flattened_bucket", flush_cache: bool = True,
                 http_timeout: float = 600.0, group_timeout: timedelta = timedelta(minutes=10), group: Any = None,
                 keys: Any = None, state_file: str | Path | None = None):
        self.urls = [u.rstrip("/") for u in admin_urls]
        self.keys = keys  # the servers' RunKeys (moe_rl/rollout/auth.py), or None
        if not self.urls:
            raise ValueError("NcclSync needs the servers' URLs")
        tps = [server_tp_sizes] * len(self.urls) if isinstance(server_tp_sizes, int) else list(server_tp_sizes)
        if len(tps) != len(self.urls):
            raise ValueError(f"{len(self.urls)} servers but {len(tps)} tp sizes")
        self.offsets, self.world_size = group_rank_offsets(tps)
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_prefix, self.backend = group_name, backend
        self.group_name = group_name  # made unique by each connect
        self.state_file = None if state_file is None else Path(state_file)
        self.bucket_bytes, self.dtype, self.load_format = int(bucket_bytes), dtype, load_format
        self.flush_cache, self.http_timeout, self.group_timeout = flush_cache, float(http_timeout), group_timeout
        self.group = group
        self._pg: Any = None
        self._session: bool | None = None  # None: not probed; False: the servers have no session endpoints

    # ------------------------------------------------------------------ group
    def connect(self) -> None:
        """Rank 0: make every server join the update group, and join it as rank 0 (collective)."""
        error = None
        if _rank(self.group) == 0 and self._pg is None:
            error = self._connect()
        error = _from_rank0(error, self.group)
        if error:
            raise WeightSyncError(error)

    def _connect(self) -> str | None:
        self._leave_stale_group()
        self.group_name = f"{self.group_prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self._remember_group(self.group_name)
        path = "/init_weights_update_group"
        futures = [_in_daemon_thread(_post_json, url, path,
                                     init_group_payload(self.master_address, self.master_port, off,
                                                        self.world_size, self.group_name, self.backend),
                                     self.http_timeout, self.keys) for url, off in zip(self.urls, self.offsets)]
        # The servers' HTTP calls return only once everybody joined: join while they wait. A server
        # that refuses answers at once, and then nobody else joins: stop waiting for the group then
        # (the join thread gives up at group_timeout) rather than for the whole timeout.
        joined = _in_daemon_thread(new_custom_group, self.backend, f"tcp://{self.master_address}:{self.master_port}",
                                   self.world_size, 0, self.group_name, self.group_timeout)
        while not joined.done():
            refused = [f for f in futures if f.done() and (f.exception() is not None
                                                           or _reply_error("", path, *f.result()) is not None)]
            if refused:
                return self._first_error(path, futures, only_done=True)
            time.sleep(0.05)
        try:
            self._pg = joined.result()
        except Exception as e:  # noqa: BLE001
            return f"joining weight update group {self.group_name} at {self.master_address}:{self.master_port} " \
                   f"failed: {_describe(e)}"
        return self._first_error(path, futures)

    def _first_error(self, path: str, futures: list, only_done: bool = False) -> str | None:
        errors = []
        for url, fut in zip(self.urls, futures):
            if only_done and not fut.done():
                continue
            try:
                err = _reply_error(url, path, *fut.result())
            except WeightSyncError as e:
                err = str(e)
            if err:
                errors.append(err)
        return "; ".join(errors) or None

    def _leave_stale_group(self) -> None:
        """Rank 0, before joining: end an update session and leave the group that a trainer which
        died mid-run left on the servers (best effort: a server without either says so, and is fine)."""
        stale = None
        try:
            stale = json.loads(self.state_file.read_text()).get("group_name") if self.state_file else None
        except (OSError, ValueError, AttributeError):
            pass
        for url in self.urls:
            calls = [("/end_weight_update", {})] + ([("/destroy_weights_update_group", {"group_name": stale})]
                                                   if stale else [])
            for path, body in calls:
                try:
                    status, reply = _post_json(url, path, body, 30.0, self.keys)
                except WeightSyncError as e:
                    log.warning("before joining the update group: %s", e)
                    continue
                if status == 200 and (not isinstance(reply, dict) or reply.get("success", True)):
                    log.info("server %s: %s, left by an earlier trainer", url,
                             "closed an open update session" if path == "/end_weight_update"
                             else f"destroyed update group {stale}")

    def _remember_group(self, name: str) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"group_name": name, "servers": self.urls}))
        os.replace(tmp, self.state_file)

    def close(self) -> None:
        """Rank 0: leave the update group on both sides."""
        if self._pg is None:
            return
        for url in self.urls:
            try:
                _post_json(url, "/destroy_weights_update_group", {"group_name": self.group_name}, 30.0, self.keys)
            except WeightSyncError as e:
                log.warning("%s", e)
        dist.destroy_process_group(self._pg)
        self._pg = None

    # ------------------------------------------------------------------- sync
    def sync(self, version: int, named_tensors: WeightsArg, engine: Any = None) -> int:
        """Broadcast all weights as version `version` (collective over the trainer's ranks).

        `engine` is unused (the servers are addressed by URL); it is accepted so every
        sync has the same call. Returns the number of tensors sent.
        """
        self.connect()
        source = _named_tensors(named_tensors)
        if self.dtype is not None:
            source = ((n, t.to(self.dtype)) for n, t in source)
        rank0 = _rank(self.group) == 0
        error = self._call_all("/begin_weight_update", {}) if rank0 else None
        count = 0
        for bucket in collect_to_rank0(source, self.bucket_bytes, self.group):
            count += len(bucket.metas)
            if error is None:  # after a failure keep draining: the other ranks are sending
                error = self._send_bucket(bucket, version)
        if rank0:
            end_error = self._call_all("/end_weight_update", {})
            error = error or end_error
        error = _from_rank0(error, self.group)
        if error:
            raise WeightSyncError(f"weight version {version} over {self.group_name}: {error}")
        return int(_from_rank0(count, self.group))

    def _send_bucket(self, bucket: Bucket, version: int) -> str | None:
        """POST the bucket's metadata to every server and broadcast its bytes while they wait."""
        # flush_cache and weight_version go with the last bucket only (see bucket_payloads)
        payload = update_payload(bucket.metas, self.group_name, flush_cache=self.flush_cache and bucket.last,
                                 weight_version=str(version) if bucket.last else None, load_format=self.load_format)
        path = "/update_weights_from_distributed"
        futures = [_in_daemon_thread(_post_json, url, path, payload, self.http_timeout, self.keys)
                   for url in self.urls]
        device = compute_device()
        if self.load_format == "flattened_bucket":
            dist.broadcast(flatten_bucket([t.to(device) for t in bucket.tensors]), src=0, group=self._pg)
        else:  # one broadcast per tensor, in `names` order
            for t in bucket.tensors:
                dist.broadcast(t.to(device).contiguous(), src=0, group=self._pg)
        return self._first_error(path, futures)

    def _call_all(self, path: str, payload: Any) -> str | None:
        """POST to every server; a 404 on the session endpoints means an SGLang without them."""
        if self._session is False:
            return None
        futures = [_in_daemon_thread(_post_json, url, path, payload, self.http_timeout, self.keys)
                   for url in self.urls]
        errors, missing = [], 0
        for url, fut in zip(self.urls, futures):
            try:
                status, body = fut.result()
            except WeightSyncError as e:
                errors.append(str(e))
                continue
            if status == 404:
                missing += 1
                continue
            err = _reply_error(url, path, status, body)
            if err:
                errors.append(err)
        if missing == len(self.urls):
            self._session = False
            return None
        self._session = True
        return "; ".join(errors) or None


# ----------------------------------------------------------------------------- factory

WeightSync = Union[DiskSync, TensorSync, NcclSync]


def make_weight_sync(cfg: Any, *, root: str | Path | None = None, admin_urls: Sequence[str] = (),
                     master_address: str | None = None, master_port: int | None = None,
                     server_tp_sizes: int | Sequence[int] = 1, bucket_bytes: int | None = None,
                     keep_last: int = 2, backend: str = "nccl", group: Any = None, keys: Any = None,
                     state_file: str | Path | None = None) -> WeightSync:
    """The sync `rollout.weight_sync` names (`cfg` is a RunConfig or its RolloutConfig).

    disk needs `root` (a directory the trainer and the servers share); nccl needs
    `admin_urls`, `master_address` and `master_port` (`backend` "gloo" reaches
    `moe-rl serve` on CPU over the same calls).
    """
    rollout = getattr(cfg, "rollout", cfg)
    kind, engine = rollout.weight_sync, getattr(rollout, "engine", None)
    if kind == "tensor" and engine == "sglang":
        raise ValueError("rollout.weight_sync=tensor copies into a LocalEngine in the trainer's process; "
                         "SGLang servers take disk or nccl")
    if kind == "disk":
        if root is None:
            raise ValueError("rollout.weight_sync=disk needs a root directory for the weight versions")
        return DiskSync(root, keep_last=keep_last, group=group)
    if kind == "tensor":
        return TensorSync(bucket_bytes=bucket_bytes or (256 << 20), group=group)
    if kind == "nccl":
        if not admin_urls or master_address is None or master_port is None:
            raise ValueError("rollout.weight_sync=nccl needs the servers' admin_urls, master_address and master_port")
        return NcclSync(admin_urls, master_address=master_address, master_port=master_port,
                        server_tp_sizes=server_tp_sizes, bucket_bytes=bucket_bytes or (1 << 30), backend=backend,
                        http_timeout=max(600.0, float(getattr(rollout, "timeout_s", 0.0))), group=group, keys=keys,
                        state_file=state_file)
    raise ValueError(f"rollout.weight_sync must be disk, tensor or nccl, got {kind!r}")
