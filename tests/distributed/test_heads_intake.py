"""`rollout.intake=heads` (moe_rl/recipes/rl/heads.py) on 4 gloo ranks, TP2 x DP2: each data-parallel head
asks for, receives and scores its own groups, and every rank trains on exactly the share it gets when
rank 0 receives the whole step (moe_rl/recipes/rl/batch.py, the reference): the same samples, rows,
advantages and metrics, through DAPO's refill rounds, R3's coverage, shuffled minibatches and the
token-balanced plan. Rank 0 receives no more than the other head, and a failure on one head stops
every rank. The collectives it uses (`heads`, `exchange`, `to_peers`) are checked on their own."""
from __future__ import annotations

import pickle

import pytest

from moe_rl.testing import run_ranks

GROUPS = [[0, 1], [2, 3]]  # model-parallel groups (TP2): each trains on its data-parallel rank's share
OVERRIDES = ["rollout.n_samples=2", "data.prompts_per_step=8", "algo.num_minibatches=2", "algo.dynamic_sampling=true",
             "algo.dynamic_sampling_max_rounds=3", "algo.shuffle_minibatches=true", "algo.replay=r3"]


def _runs(me: int, groups: list[list[int]] = GROUPS):
    from moe_rl.config import load_config
    from moe_rl.recipes.rl.batch import RankZeroIntake
    from moe_rl.recipes.rl.heads import HeadsIntake
    from moe_rl.recipes.rl.rollouts import SyncRollouts
    from moe_rl.routes import Geometry
    from moe_rl.testing.intake import SeededEngine, intake_run

    cfg = load_config(None, OVERRIDES)
    peers = next(g for g in groups if me in g)
    geo = Geometry(num_layers=3, topk=2, num_experts=8, moe_layers=[1, 2])
    dp = groups.index(peers)
    ref = intake_run(cfg, me, dp, len(groups), peers, SeededEngine(geo, wire=True) if me == 0 else None, [1, 2])
    ref.intake, ref.rollouts = RankZeroIntake(), SyncRollouts()
    heads = HeadsIntake(me, dp, peers, cfg.data.prompts_per_step)
    new = intake_run(cfg, me, dp, len(groups), peers, SeededEngine(geo, wire=True) if heads.is_head else None, [1, 2])
    new.intake, new.rollouts = heads, SyncRollouts(draw=heads.draw, request=heads.request)
    return ref, new


def _view(batch) -> dict:
    if batch.share is None:
        return {"metrics": batch.metrics, "share": None}
    s = batch.share.samples
    return {"metrics": batch.metrics, "tokens": batch.tokens, "minibatches": batch.share.minibatches,
            "seqs": [x.tolist() for x in s.sequences], "adv": s.advantages.tolist(), "rewards": s.rewards.tolist(),
            "routes": [r.tolist() for r in s.routes], "logp": [x.tolist() for x in s.engine_logp]}


def _same_share_worker(groups: list[list[int]] = GROUPS) -> dict:
    import torch.distributed as dist

    from moe_rl.dist import collectives

    me = dist.get_rank()
    collectives.init_control_group(120.0)
    ref, new = _runs(me, groups)
    steps = []
    for step in (1, 2, 3):
        steps.append((_view(ref.intake.batch(ref, step)), _view(new.intake.batch(new, step))))
    return {"steps": steps, "bytes_ref": ref.engine.bytes_in if ref.engine else 0,
            "bytes_new": new.engine.bytes_in if new.engine else 0}


def test_heads_give_every_rank_the_share_rank0_would():
    results = run_ranks(_same_share_worker, 4, timeout=300)
    refills = 0
    for rank, r in enumerate(results):
        for step, (ref, new) in enumerate(r["steps"], 1):
            for key in ("tokens", "minibatches", "seqs", "rewards", "routes", "logp"):
                assert new.get(key) == ref.get(key), (rank, step, key)
            assert new.get("adv") == pytest.approx(ref.get("adv"), abs=1e-6), (rank, step)
            assert new["metrics"].keys() == ref["metrics"].keys(), (rank, step)
            for key, value in ref["metrics"].items():
                assert new["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (rank, step, key)
            refills += ref["metrics"].get("filter/rounds", 1) > 1
    assert refills, "no step refilled: DAPO's rounds went unchecked"
    assert all("replay/coverage" in ref["metrics"] for ref, _ in results[0]["steps"])
    # the replies' bytes: all on rank 0 before; now on the two heads, rank 0 with no more than the other
    ref_in, new_in = [r["bytes_ref"] for r in results], [r["bytes_new"] for r in results]
    assert ref_in[1:] == [0, 0, 0] and new_in[1] == new_in[3] == 0
    assert new_in[0] + new_in[2] == ref_in[0] and new_in[0] <= 2 * new_in[2]


def test_one_head_hands_its_peers_the_step():
    """DP 1 (TP2 on 2 ranks): the one head receives the whole step; its heads' collectives are no-ops,
    not collectives that wait for its peers (which wait in the hand-off): the step does not hang."""
    results = run_ranks(_same_share_worker, 2, [[0, 1]], timeout=120)
    for rank, r in enumerate(results):
        for step, (ref, new) in enumerate(r["steps"], 1):
            assert new.get("seqs") == ref.get("seqs") and new["metrics"] == pytest.approx(ref["metrics"]), (rank, step)


def _failure_worker(kind: str) -> tuple[str, str]:
    import torch.distributed as dist

    from moe_rl.dist import collectives
    from moe_rl.rollout.engine import RolloutError
    from moe_rl.rollout.outage import RankZeroFailed, RolloutLost

    me = dist.get_rank()
    collectives.init_control_group(120.0)
    _, new = _runs(me)
    if me == 2:  # the second head's engine fails
        new.engine.fail = RolloutError("no server answered") if kind == "lost" else ValueError("bad reply")
    try:
        new.intake.batch(new, 1)
        return ("nothing raised", "")
    except (RolloutLost, RankZeroFailed, ValueError) as e:
        return (type(e).__name__, str(e))


@pytest.mark.parametrize("kind", ["lost", "crash"])
def test_a_failure_on_one_head_stops_every_rank(kind):
    results = run_ranks(_failure_worker, 4, kind, timeout=300)
    if kind == "lost":  # no server answered: every rank ends the run the same way (exit 3, a checkpoint)
        assert results == [("RolloutLost", "no server answered")] * 4
        return
    assert results[2] == ("ValueError", "bad reply")  # the failing head raises its own
    for rank in (0, 1, 3):
        assert results[rank][0] == "RankZeroFailed" and "rank 2 failed: ValueError: bad reply" in results[rank][1]


def _collectives_worker() -> dict:
    import torch.distributed as dist

    from moe_rl.dist import collectives

    me = dist.get_rank()
    collectives.init_control_group(60.0)
    peers = next(g for g in GROUPS if me in g)
    heads, group = collectives.heads(GROUPS.index(peers), peers)
    out = {"heads": heads}
    got = None
    if me == peers[0]:
        h = [r for _, r in heads].index(me)
        # each head sends the other a payload of its own size; nothing to itself
        got = collectives.exchange({1 - h: bytes(1000 * (h + 1))}, group)
        out["got"] = {k: len(v) for k, v in got.items()}
    mine = collectives.to_peers({"from": me, "got": out.get("got")} if me == peers[0] else None, peers)
    out["peer"] = mine["from"]
    out["size"] = len(pickle.dumps(mine))
    return out


def test_heads_exchange_and_to_peers():
    results = run_ranks(_collectives_worker, 4, timeout=120)
    assert all(r["heads"] == [(0, 0), (1, 2)] for r in results)
    assert results[0]["got"] == {1: 2000} and results[2]["got"] == {0: 1000}  # only what was addressed to it
    assert [r["peer"] for r in results] == [0, 0, 2, 2]
