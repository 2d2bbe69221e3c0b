"""`TensorSync` (rollout.weight_sync=tensor): the HF-named tensors are sent to trainer rank 0, which
copies them into a `LocalEngine` living in its own process. No files."""
from __future__ import annotations

from typing import Any

import torch

from moe_rl.dist.collectives import rank
from moe_rl.rollout.weight_sync.buckets import collect_to_rank0
from moe_rl.rollout.weight_sync.common import (WeightsArg, WeightSyncError, _describe, _engine_name, _from_rank0,
                                               _named_tensors)

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

    def close(self) -> None:
        """Nothing to leave (only the nccl sync holds a process group with the servers)."""

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
        if rank(self.group) == 0 and error is None and (self.atomic or not count):
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
