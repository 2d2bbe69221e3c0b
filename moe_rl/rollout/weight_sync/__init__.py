"""Weight sync, trainer -> rollout engines, after each policy update.

Three ways, chosen by `rollout.weight_sync` (`make_weight_sync`):

- `DiskSync` (disk): the trainer writes a HF checkpoint (safetensors) into
  `root/vNNNNNN.tmp`, renames it to `root/vNNNNNN` once every rank finished, then
  rank 0 asks the engine to load it (`/update_weights_from_disk`). Works with every
  engine and across nodes (shared filesystem); old versions are deleted.
- `TensorSync` (tensor): the HF-named tensors are sent to rank 0, which copies
  them into a `LocalEngine` living in its own process. No files.
- `NcclSync` (nccl): every rank that owns HF tensors joins one process group with each
  SGLang server (`/init_weights_update_group`) and broadcasts its own share bucket by bucket
  while each server receives it (`/update_weights_from_distributed`); optionally only what
  changed (`rollout.weight_sync_delta`), verified against the servers' checksums
  (`rollout.verify_weights`). NCCL on GPUs, gloo to `moe-rl serve` on CPU.

Every `sync` is collective: all trainer ranks call it, in the same order, and all
of them raise the same `WeightSyncError` when any part failed (see `common`).

Modules: `common` (the error, weight sources, hand-offs), `buckets` (tensor metadata, SGLang's
flattened layout, a rank's buckets, collecting every rank's buckets on rank 0), `sglang_calls`
(the SGLang requests), `delta`, `verify`, `disk`, `tensor`, `nccl` (one strategy each),
`funnel` (the earlier nccl path, the bench's baseline), and `make_weight_sync` here, which picks one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, Union

from moe_rl.rollout.config import pushes_in_place
from moe_rl.rollout.engines import engine_kind
from moe_rl.rollout.weight_sync.buckets import (Bucket, TensorMeta, collect_to_rank0, dtype_name, flatten_bucket,
                                                local_buckets, plan_buckets, unflatten_bucket)
from moe_rl.rollout.weight_sync.common import (ExportFn, MegatronWeights, NamedTensors, PolicyWeights, WeightsArg,
                                               WeightSyncError)
from moe_rl.rollout.weight_sync.disk import DiskSync, list_versions, version_dir
from moe_rl.rollout.weight_sync.delta import DeltaBase, flatten_sparse, unflatten_sparse
from moe_rl.rollout.weight_sync.funnel import FunnelSync
from moe_rl.rollout.weight_sync.nccl import NcclSync, PushStats
from moe_rl.rollout.weight_sync.sglang_calls import group_rank_offsets, new_custom_group
from moe_rl.rollout.weight_sync.verify import mismatches, tensor_checksum
from moe_rl.rollout.weight_sync.tensor import TensorSync

__all__ = ["Bucket", "DeltaBase", "DiskSync", "ExportFn", "FunnelSync", "MegatronWeights", "NamedTensors",
           "NcclSync", "PolicyWeights", "PushStats", "TensorMeta", "TensorSync", "WeightSync",
           "WeightSyncError", "WeightsArg", "collect_to_rank0", "dtype_name", "flatten_bucket",
           "flatten_sparse", "group_rank_offsets", "list_versions", "local_buckets",
           "make_weight_sync", "mismatches", "new_custom_group", "plan_buckets", "tensor_checksum",
           "unflatten_bucket", "unflatten_sparse", "version_dir"]

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
    kind = rollout.weight_sync
    engine = engine_kind(rollout) if getattr(rollout, "engine", None) is not None else None
    if engine is not None and kind not in engine.weight_syncs:
        raise ValueError(f"rollout.weight_sync={kind} cannot reach {engine.what} (rollout.engine={engine.name}); "
                         f"use {' or '.join(engine.weight_syncs)}")
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
                        state_file=state_file, flush_cache=not pushes_in_place(rollout),
                        delta=bool(getattr(rollout, "weight_sync_delta", False)),
                        verify=bool(getattr(rollout, "verify_weights", False)))
    raise ValueError(f"rollout.weight_sync must be disk, tensor or nccl, got {kind!r}")
