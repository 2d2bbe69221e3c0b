"""Object hand-offs between trainer ranks, on a gloo group of their own with a rollout-sized timeout.

Rank 0 alone talks to the rollout servers. While it generates (and retries, and waits for a
server to come back, up to the rollout budget `moe_rl.config.handoff_timeout_s`), the other
ranks wait for its samples; while it starts servers or loads weights into them, they wait for
its answer. Those waits are hand-offs of Python objects, and they run here, on the *control
group*: gloo (objects are pickled on the host anyway), made once per run with a timeout derived
from the rollout budget, so no rank times out before rank 0's own "no server came back" path
has run, and no NCCL collective is pending meanwhile (NCCL's watchdog would abort the job at the
default group's timeout, whatever the rollout settings). Tensor collectives stay on the
default group and megatron's groups, on the compute device.

Without `init_control_group` (tests that drive a single step, tools) the default group is used.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

_control: Any = None  # the control group once made


def init_control_group(timeout_s: float) -> Any:
    """Make the control group (collective: every rank calls it, once, after the default group)."""
    global _control
    if dist.is_initialized() and dist.get_world_size() > 1 and _control is None:
        _control = dist.new_group(backend="gloo", timeout=timedelta(seconds=float(timeout_s)))
    return _control


def destroy_control_group() -> None:
    global _control
    if _control is not None and dist.is_initialized():
        dist.destroy_process_group(_control)
    _control = None


def control_group() -> Any:
    """The group object hand-offs use: the control group, or None (the default group) without one."""
    return _control


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def broadcast_object(obj: Any, group: Any = None) -> Any:
    """Rank 0's (of `group`; default: the control group) Python object, on every rank of it."""
    group = _control if group is None else group
    if _world(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (of `group`; default: the control group), in rank order."""
    group = _control if group is None else group
    if _world(group) == 1:
        return [obj]
    out: list[Any] = [None] * _world(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_errors(error: str | None, group: Any = None) -> list[str]:
    """Every rank's error (None = fine), in rank order; doubles as a barrier."""
    return [e for e in all_gather_objects(error, group) if e]


def scatter_objects(per_rank: Sequence[Any] | None, group: Any = None) -> Any:
    """Rank 0 gives rank r `per_rank[r]` (of `group`; default: the control group); others pass None."""
    group = _control if group is None else group
    if _world(group) == 1:
        assert per_rank is not None
        return per_rank[0]
    out: list[Any] = [None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.scatter_object_list(out, list(per_rank) if dist.get_rank() == src else None, src=src, group=group)
    return out[0]
