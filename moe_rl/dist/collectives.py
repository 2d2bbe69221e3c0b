"""Object hand-offs between trainer ranks, on a gloo group of their own with a rollout-sized timeout.

Rank 0 (or, under rollout.intake=heads, each data-parallel head) talks to the rollout servers.
While it generates (and retries, and waits for a server to come back, up to the rollout budget
`moe_rl.config.handoff_timeout_s`), the other ranks wait for its samples; while it starts
servers or loads weights into them, they wait for its answer. Those waits are hand-offs of
Python objects, and they run here, on the *control group*: gloo (objects are pickled on the
host anyway), made once per run with a timeout derived
from the rollout budget, so no rank times out before rank 0's own "no server came back" path
has run, and no NCCL collective is pending meanwhile (NCCL's watchdog would abort the job at the
default group's timeout, whatever the rollout settings). Tensor collectives stay on the
default group and megatron's groups, on the compute device.

Without `init_control_group` (tests that drive a single step, tools) the default group is used.
"""
from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from moe_rl.dist.devices import compute_device

_control: Any = None  # the control group once made
_timeout = timedelta(minutes=30)  # its timeout, for the groups share_out makes beside it
_layout: dict[tuple[int, ...], Any] = {}  # share_out's gloo group of each model-parallel group, once made
_heads: list[tuple[int, int]] = []        # (key, first rank) of every model-parallel group
_head_group: list[Any] = []               # a gloo group of those first ranks, once made (None: one group)


def init_control_group(timeout_s: float) -> Any:
    """Make the control group (collective: every rank calls it, once, after the default group)."""
    global _control, _timeout
    if dist.is_initialized() and dist.get_world_size() > 1 and _control is None:
        _timeout = timedelta(seconds=float(timeout_s))
        _control = dist.new_group(backend="gloo", timeout=_timeout)
    return _control


def destroy_control_group() -> None:
    global _control
    if _control is not None and dist.is_initialized():
        dist.destroy_process_group(_control)
    _control = None
    _layout.clear()
    _heads.clear()
    _head_group.clear()


def control_group() -> Any:
    """The group object hand-offs use: the control group, or None (the default group) without one."""
    return _control


def rank(group: Any = None) -> int:
    """This process's rank in `group` (default: the world); 0 without torch.distributed."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group: Any = None) -> int:
    """The size of `group` (default: the world); 1 without torch.distributed."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def broadcast_object(obj: Any, group: Any = None) -> Any:
    """Rank 0's (of `group`; default: the control group) Python object, on every rank of it."""
    group = _control if group is None else group
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (of `group`; default: the control group), in rank order."""
    group = _control if group is None else group
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_errors(error: str | None, group: Any = None) -> list[str]:
    """Every rank's error (None = fine), in rank order; doubles as a barrier."""
    return [e for e in all_gather_objects(error, group) if e]


def scatter_objects(per_rank: Sequence[Any] | None, group: Any = None) -> Any:
    """Rank 0 gives rank r `per_rank[r]` (of `group`; default: the control group); others pass None."""
    group = _control if group is None else group
    if world_size(group) == 1:
        assert per_rank is not None
        return per_rank[0]
    out: list[Any] = [None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.scatter_object_list(out, list(per_rank) if dist.get_rank() == src else None, src=src, group=group)
    return out[0]


def _learn_groups(key: int, peers: tuple[int, ...]) -> None:
    """First call (collective): every model-parallel group's key and ranks, a gloo group for each and
    one of their first ranks (the heads), made in the same order everywhere."""
    if _heads:
        return
    seen = all_gather_objects((key, peers))
    for k, ranks in sorted(set(seen), key=lambda kr: kr[1]):
        _heads.append((k, ranks[0]))
        _layout[ranks] = dist.new_group(list(ranks), backend="gloo", timeout=_timeout) if len(ranks) > 1 else None
    firsts = [head for _, head in _heads]
    _head_group.append(dist.new_group(firsts, backend="gloo", timeout=_timeout) if len(firsts) > 1 else None)


def heads(key: int, peers: Sequence[int]) -> tuple[list[tuple[int, int]], Any]:
    """(key, world rank) of the first rank of every model-parallel group, in rank order, and a gloo
    group of those ranks (None when there is one); collective over all ranks on the first call.
    `key`, `peers`: this rank's group key (its data-parallel rank) and its group's world ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [(key, 0)], None
    _learn_groups(key, tuple(sorted(int(r) for r in peers)))
    return list(_heads), _head_group[0]


def to_peers(obj: Any, peers: Sequence[int]) -> Any:
    """The first of `peers`' `obj` on every rank of `peers` (its model-parallel group, made by
    `heads`/`share_out`); the first rank keeps its object as it is (not a copy)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    ranks = tuple(sorted(int(r) for r in peers))
    group = _layout[ranks]
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=ranks[0], group=group)
    return obj if dist.get_rank() == ranks[0] else box[0]


def exchange(outgoing: dict[int, Any], group: Any) -> dict[int, Any]:
    """Point to point among the ranks of `group`: `outgoing[r]` goes to its rank r (group ranks), and
    what each rank sent this one comes back by sender (collective over `group`; a rank that sends
    nothing to r leaves r out). Only the pickled bytes of each pair travel, once: a rank receives
    what is addressed to it, not everybody's (an all-gather would give every rank the whole step)."""
    if world_size(group) == 1:
        return {0: outgoing[0]} if 0 in outgoing else {}
    me, n = rank(group), world_size(group)
    payload = {r: torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
               for r, obj in outgoing.items() if r != me}
    sizes = all_gather_objects([int(payload[r].numel()) if r in payload else -1 for r in range(n)], group)
    inbox = {r: torch.empty(sizes[r][me], dtype=torch.uint8) for r in range(n) if r != me and sizes[r][me] >= 0}
    glob = lambda r: dist.get_global_rank(group, r) if group is not None else r  # noqa: E731
    works = [dist.isend(t, dst=glob(r), group=group) for r, t in payload.items()]
    works += [dist.irecv(t, src=glob(r), group=group) for r, t in inbox.items()]
    for w in works:
        w.wait()
    out = {r: pickle.loads(t.numpy().tobytes()) for r, t in inbox.items()}
    if me in outgoing:
        out[me] = outgoing[me]
    return out


def share_out(per_key: dict[int, Any] | None, key: int, peers: Sequence[int]) -> Any:
    """Rank 0's `per_key[key]` on every rank whose key is `key` (collective over all ranks).

    `peers`: the world ranks that get the same payload as this one (its model-parallel group:
    TP x PP ranks train on the same samples), this rank among them. Each payload travels once
    from rank 0 to the first rank of a group, which broadcasts it to the others on a gloo group
    of their own: every rank receives only its own payload, and rank 0 pickles each one once
    (a scatter to every rank would pickle it once per receiver). Rank 0 keeps its own payload
    as it is (not a copy). The groups are made on the first call, by every rank together.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert per_key is not None
        return per_key[key]
    me, peers = dist.get_rank(), tuple(sorted(int(r) for r in peers))
    _learn_groups(key, peers)
    control = _control
    if me == 0:
        assert per_key is not None
        for k, head in _heads:
            if head != 0:
                dist.send_object_list([per_key[k]], dst=head, group=control)
        mine = per_key[key]
    elif me == peers[0]:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=0, group=control)
        mine = box[0]
    else:
        mine = None
    return to_peers(mine, peers)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def agree(flag: bool) -> bool:
    """True on every rank when any rank saw the flag (a signal may reach one rank first)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], device=compute_device())  # NCCL groups take device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
