"""moe_rl/dist/collectives.py on 4 gloo ranks: `share_out` gives every rank its group's payload and nothing
else, and a failure of rank 0 in a hand-off reaches every rank (nobody is left waiting)."""
from __future__ import annotations

import pickle

from moe_rl.testing import run_ranks

GROUPS = [[0, 1], [2, 3]]  # model-parallel groups: their ranks train on the same share


def _share_out_worker() -> dict:
    import torch.distributed as dist

    from moe_rl.dist import collectives
    from moe_rl.rollout.engine import RolloutError
    from moe_rl.rollout.outage import RankZeroFailed, RolloutLost, attempt, unwrap

    me = dist.get_rank()
    collectives.init_control_group(60.0)
    peers = next(g for g in GROUPS if me in g)
    key = GROUPS.index(peers)
    payloads = {k: {"key": k, "blob": bytes(1000 * (k + 1))} for k in range(len(GROUPS))} if me == 0 else None
    first = collectives.share_out(payloads, key, peers)
    second = collectives.share_out(payloads, key, peers)  # the groups made by the first call are reused
    out = {"key": key, "got": first["key"], "size": len(pickle.dumps(first)), "again": second["key"],
           "same_object_on_rank0": me == 0 and first is payloads[0]}

    def lose():
        raise RolloutError("no server answered")

    def crash():
        raise ZeroDivisionError("a reward function divided by zero")

    for name, fn, expected in (("lost", lose, RolloutLost), ("crash", crash, ZeroDivisionError)):
        plan = attempt(fn) if me == 0 else None
        plans = {k: plan for k in range(len(GROUPS))} if me == 0 else None
        try:
            unwrap(collectives.share_out(plans, key, peers))
            out[name] = "nothing raised"
        except (RolloutLost, RankZeroFailed, ZeroDivisionError) as e:
            out[name] = (type(e).__name__, str(e))
    return out


def test_share_out_gives_each_group_its_payload_and_failures_to_all():
    results = run_ranks(_share_out_worker, 4, timeout=120)
    for rank, r in enumerate(results):
        key = 0 if rank < 2 else 1
        assert r["got"] == r["again"] == key
        assert 1000 * (key + 1) < r["size"] < 1000 * (key + 1) + 200  # its own payload, not the others'
        assert r["lost"] == ("RolloutLost", "no server answered")
        expected = "ZeroDivisionError" if rank == 0 else "RankZeroFailed"  # rank 0 raises its own exception
        assert r["crash"][0] == expected and "a reward function divided by zero" in r["crash"][1]
    assert results[0]["same_object_on_rank0"]
