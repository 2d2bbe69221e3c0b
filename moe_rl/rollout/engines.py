"""The rollout engines a run can use (`rollout.engine`) and the weight syncs that reach them
(`rollout.weight_sync`), and what each one is.

Code that depends on the engine asks its `EngineKind` (does it run as server processes,
on GPUs only, sharded over a tensor-parallel group, which weight syncs reach it, does a
router go in front of several) instead of comparing engine names; adding an engine is an
entry here plus its server command (`moe_rl.rollout.launcher.SERVER_COMMANDS`). Code that
depends on the weight sync asks its `WeightSyncKind` the same way; the strategies themselves
are `moe_rl.rollout.weight_sync` (one module each, picked once by `make_weight_sync`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineKind:
    name: str
    runs_as_servers: bool       # rollouts come from server processes (launched, or at rollout.urls)
    gpu_only: bool              # its servers need GPUs
    tensor_parallel: bool       # each server shards over `rollout.server_tp_size` GPUs of its own
    router_when_many: bool      # `rollout.router=null` puts sglang-router in front of more than one server
    weight_syncs: tuple[str, ...]  # the `rollout.weight_sync` kinds that reach it
    what: str                   # for messages

    def server_tp(self, rollout: Any) -> int:
        """GPUs per server (1 for an engine that does not shard)."""
        return int(rollout.server_tp_size) if self.tensor_parallel else 1


ENGINE_KINDS: dict[str, EngineKind] = {
    "local": EngineKind("local", runs_as_servers=True, gpu_only=False, tensor_parallel=False,
                        router_when_many=False, weight_syncs=("disk", "nccl"),
                        what="`moe-rl serve` servers (SGLang's HTTP API over HF transformers)"),
    "sglang": EngineKind("sglang", runs_as_servers=True, gpu_only=True, tensor_parallel=True,
                         router_when_many=True, weight_syncs=("disk", "nccl"), what="SGLang servers"),
    "inprocess": EngineKind("inprocess", runs_as_servers=False, gpu_only=False, tensor_parallel=False,
                            router_when_many=False, weight_syncs=("tensor", "disk"),
                            what="the local engine inside trainer rank 0"),
}


def engine_kind(rollout: Any) -> EngineKind:
    """The kind of `rollout.engine` (`rollout`: a RolloutConfig or anything with `.engine`)."""
    return _kind_of(rollout, "engine", ENGINE_KINDS)


def _kind_of(rollout: Any, key: str, table: dict[str, Any]) -> Any:
    name = str(getattr(rollout, key))
    if name not in table:
        raise ValueError(f"rollout.{key} must be one of {', '.join(table)}, got {name!r}")
    return table[name]


@dataclass(frozen=True)
class WeightSyncKind:
    name: str
    # Joins one process group with every server rank (trainer rank 0 + rank_offset + tp_rank):
    # NCCL refuses two of its ranks on one GPU (no colocation, no server on rank 0's GPU), a
    # restarted server cannot rejoin (no restarts), and data-parallel or pipeline replicas
    # inside a server would take the same ranks (SGLang asserts dp_size == 1).
    update_group: bool
    what: str                   # for messages


WEIGHT_SYNC_KINDS: dict[str, WeightSyncKind] = {
    "disk": WeightSyncKind("disk", update_group=False, what="HF checkpoints on a shared filesystem"),
    "tensor": WeightSyncKind("tensor", update_group=False, what="tensors copied into an engine in this process"),
    "nccl": WeightSyncKind("nccl", update_group=True, what="a broadcast to the servers over an update group"),
}


def weight_sync_kind(rollout: Any) -> WeightSyncKind:
    """The kind of `rollout.weight_sync` (`rollout`: a RolloutConfig or anything with `.weight_sync`)."""
    return _kind_of(rollout, "weight_sync", WEIGHT_SYNC_KINDS)
