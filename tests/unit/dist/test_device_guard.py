"""The device guard: host tensors in moe_rl's collectives fail on CPU as they would under NCCL.

Every check that enters the guard runs in spawned gloo ranks (`run_ranks`): the guard activates compat and
patches torch.distributed for the life of a block, which the test process itself
should not carry. Each worker returns plain values that the tests assert on.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_rl.testing import run_ranks


def _raises(fn, *args) -> str:
    """The HostTensorInCollective message of `fn(*args)`, or "" when it passes."""
    from moe_rl.dist.device_guard import HostTensorInCollective

    try:
        fn(*args)
    except HostTensorInCollective as exc:
        return str(exc)
    return ""


def _reduce_here(t: torch.Tensor) -> None:
    dist.all_reduce(t)


# ------------------------------------------------------------------ (a) (b) (c): the guard itself
def _guard_basics() -> dict:
    from moe_rl.dist.device_guard import device_guard
    from moe_rl.dist.devices import compute_device

    rank = dist.get_rank()
    original_all_reduce = dist.all_reduce
    out: dict = {}
    with device_guard(checked=(__name__,)) as guard:
        on = guard.is_on_device
        out["device_inside"] = str(compute_device())
        host = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        out["host_message"] = _raises(_reduce_here, host)
        dev = host.to(compute_device())
        out["moved_is_copy"] = dev is not host
        out["host_still_host"] = not on(host)
        out["device_message"] = _raises(_reduce_here, dev)
        out["reduced"] = dev.tolist()
        out["host_unchanged"] = host.tolist()
        # (c) marks: factories, moves, propagation, views, in-place, host copies
        out["marks"] = {
            "factory_device": on(torch.zeros(2, device=compute_device())),
            "factory_string": on(torch.ones(2, device="cuda")),
            "factory_host": on(torch.zeros(2)),
            "op_of_device": on(dev * 2 + host),
            "like_of_device": on(torch.zeros_like(dev)),
            "new_of_device": on(dev.new_zeros(3)),
            "explicit_host_like": on(torch.zeros_like(dev, device="cpu")),
            "view_of_device": on(dev[1:]),
            "reduction_of_device": on(dev.max(dim=0).values),
            "cpu_of_device": on(dev.cpu()),
            "to_cpu_of_device": on(dev.to("cpu")),
            "cpu_is_copy": dev.cpu() is not dev,
            "cuda_of_host": on(host.cuda()),
            "cuda_is_copy": host.cuda() is not host,
            "to_like_device": on(host.to(dev)),
            "host_after_copy_from_device": on(host.clone().copy_(dev)),
            "device_to_device_is_self": dev.to(compute_device()) is dev,
            "megatron_allocation": on(torch.empty(2, device=torch.cuda.current_device())),
            "module_to_device": on(torch.nn.Linear(2, 2).to(device=compute_device()).weight),
            "module_on_host": on(torch.nn.Linear(2, 2).weight),
        }
        # Point-to-point through P2POp: a host tensor is caught, a device one is sent.
        peer = 1 - rank
        host_ops = [dist.P2POp(dist.isend, torch.zeros(1), peer), dist.P2POp(dist.irecv, torch.zeros(1), peer)]
        out["p2p_host_message"] = _raises(dist.batch_isend_irecv, host_ops)
        send, recv = torch.full((1,), float(rank), device=compute_device()), torch.zeros(1, device=compute_device())
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        if rank == 1:
            ops.reverse()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out["p2p_received"] = recv.item()
        # Object collectives are exempt, and their host tensors inside torch are not ours.
        gathered = [None, None]
        dist.all_gather_object(gathered, {"rank": rank})
        out["objects"] = gathered
    # compat stays active (its current_device is the CPU); the guard's own pieces are gone
    out["restored"] = (dist.all_reduce is original_all_reduce and str(torch.cuda.current_device()) == "cpu"
                       and str(compute_device()) == "cpu")
    return out


def test_guard_rejects_host_tensors_tracks_marks_and_restores():
    a, b = run_ranks(_guard_basics, 2)
    for r in (a, b):
        assert r["device_inside"] == "cuda:0"
        # (a) a host tensor in a checked caller's all_reduce fails, naming call, caller and tensor
        msg = r["host_message"]
        assert "torch.distributed.all_reduce" in msg and "test_device_guard.py" in msg
        assert "shape [2]" in msg and "torch.float32" in msg and "compute_device()" in msg
        # (b) moved to compute_device() it passes and sums correctly; the host original is untouched
        assert r["moved_is_copy"] and r["host_still_host"] and r["device_message"] == ""
        assert r["reduced"] == [3.0, 30.0]
        assert r["p2p_host_message"] and "p2p_op_list[0].tensor" in r["p2p_host_message"]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["restored"]
    assert a["host_unchanged"] == [1.0, 10.0] and b["host_unchanged"] == [2.0, 20.0]
    assert a["p2p_received"] == 1.0 and b["p2p_received"] == 0.0
    # (c) how placement propagates
    want = {"factory_device": True, "factory_string": True, "factory_host": False, "op_of_device": True,
            "like_of_device": True, "new_of_device": True, "explicit_host_like": False, "view_of_device": True,
            "reduction_of_device": True, "cpu_of_device": False, "to_cpu_of_device": False, "cpu_is_copy": True,
            "cuda_of_host": True, "cuda_is_copy": True, "to_like_device": True,
            "host_after_copy_from_device": False, "device_to_device_is_self": True, "megatron_allocation": True,
            "module_to_device": True, "module_on_host": False}
    assert a["marks"] == want


# ------------------------------------------------------------------ which callers are checked
_PROBE = "import torch.distributed as dist\ndef reduce(t):\n    dist.all_reduce(t)\n"


def _probe(module_name: str):
    """A function whose calls come from module `module_name` (what the guard inspects)."""
    ns: dict = {"__name__": module_name}
    exec(compile(_PROBE, f"<{module_name}>", "exec"), ns)
    return ns["reduce"]


def _default_scope() -> dict:
    from moe_rl.dist.device_guard import device_guard

    with device_guard():
        return {name: bool(_raises(_probe(name), torch.ones(1)))
                for name in ("moe_rl.recipes.rl.step", "moe_rl.policy.replay", "moe_rl", "moe_rl.testing.e2e",
                             "moe_rlx", "megatron.core.tensor_parallel.mappings", "__main__")}


def test_default_guard_checks_moe_rl_code_only():
    (checked,) = run_ranks(_default_scope, 1)
    assert checked == {"moe_rl.recipes.rl.step": True, "moe_rl.policy.replay": True, "moe_rl": True,
                       "moe_rl.testing.e2e": False, "moe_rlx": False,
                       "megatron.core.tensor_parallel.mappings": False, "__main__": False}


# ------------------------------------------------------------------ (d) (e): the offenders, before and after
# The collective lines of the four offenders as they were before they moved to the device
# (trainer `_agree`, drift metrics' `_all_reduce_sum`, `Policy._all_reduce`, `Recording.finish`).
def _old_agree(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _old_all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _old_policy_all_reduce(values: torch.Tensor) -> torch.Tensor:
    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def _old_recording_reduce(buf: torch.Tensor) -> None:
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)


def _stats(rank: int) -> dict:
    """RouteStats / LogprobStats / expert-load sums of this rank's share, reduced."""
    from moe_rl.drift.metrics import all_reduce_counts, expert_load, logprob_mismatch, route_stats

    g = torch.Generator().manual_seed(rank)
    before = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(30)]).view(10, 3, 2)
    after = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(30)]).view(10, 3, 2)
    logp = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    return {"routes": route_stats(before, after).all_reduce().summary(),
            "logp": logprob_mismatch(logp, logp + 0.1 * torch.randn(4, 5, generator=g, dtype=torch.float64))
            .all_reduce().summary(),
            "load": all_reduce_counts(expert_load(after.to(torch.uint8), 6)).tolist()}


def _offenders() -> dict:
    from moe_rl.dist.device_guard import device_guard

    rank = dist.get_rank()
    out = {"plain": _stats(rank)}
    with device_guard(checked=("moe_rl", __name__)):
        out["guarded"] = _stats(rank)
        out["old"] = {
            "trainer._agree": _raises(_old_agree, rank == 0),
            "drift.metrics._all_reduce_sum": _raises(_old_all_reduce_sum, torch.ones(3, dtype=torch.int64)),
            "Policy._all_reduce": _raises(_old_policy_all_reduce, torch.ones(2, dtype=torch.float64)),
            "Recording.finish": _raises(_old_recording_reduce, torch.full((2, 3, 4, 2), -1, dtype=torch.int32)),
        }
    return out


def test_fixed_drift_reductions_pass_under_guard_and_old_patterns_fail():
    ranks = run_ranks(_offenders, 2)
    for r in ranks:
        # (d) the fixed reductions run under the guard and give the numbers they give without it
        assert r["guarded"] == r["plain"]
        # (e) each offender's former host-tensor collective is caught
        for name, msg in r["old"].items():
            assert "host tensor" in msg and "compute_device()" in msg, name
    # and the numbers are the sums over both ranks: against one process over the union
    from moe_rl.drift.metrics import expert_load, route_stats

    def share(rank):
        g = torch.Generator().manual_seed(rank)
        return ([torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(30)]).view(10, 3, 2)
                 for _ in range(2)])

    (b0, a0), (b1, a1) = share(0), share(1)
    whole = route_stats(torch.cat([b0, b1]), torch.cat([a0, a1])).summary()
    assert ranks[0]["plain"]["routes"] == pytest.approx(whole, rel=0, abs=1e-12)
    assert ranks[0]["plain"]["load"] == expert_load(torch.cat([a0, a1]), 6).tolist()


def _agree_under_guard() -> list:
    from moe_rl.dist.collectives import agree as _agree
    from moe_rl.dist.device_guard import device_guard

    with device_guard():
        return [_agree(dist.get_rank() == 1), _agree(False)]


def test_trainer_agree_passes_under_guard():
    assert run_ranks(_agree_under_guard, 2) == [[True, False], [True, False]]


def test_guard_refuses_a_cuda_machine(monkeypatch):
    from moe_rl.dist.device_guard import DeviceGuardError, device_guard

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(DeviceGuardError, match="CPU machines"):
        with device_guard():
            pass
