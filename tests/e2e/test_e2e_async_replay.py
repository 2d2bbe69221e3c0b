"""R3 across weight versions, through the trainer (issue: asynchronous RL). An asynchronous run
(algo.max_staleness=2, engine in the trainer's process, answers of up to 24 tokens, lr 1e-2 so
that one update moves routes) trains samples whose
tokens come from several weight versions; every route it replays is checked, token by token,
against an HF forward of the weights of the version that computed it."""
from __future__ import annotations

import pytest

from moe_rl.config import load_config
from moe_rl.testing import run_ranks
from moe_rl.testing.async_replay_worker import async_replay_worker

pytestmark = pytest.mark.slow

OVERRIDES = ["train.world_size=1", "parallel.ep=1", "rollout.engine=inprocess", "rollout.weight_sync=tensor",
             "algo.max_staleness=2", "algo.tis_cap=2", "algo.replay=r3", "rollout.return_routed_experts=true",
             "data.train=toy:echo-tail", "data.eval=null", "rollout.max_new_tokens=24", "rollout.n_samples=4",
             "data.prompts_per_step=4", "algo.num_minibatches=1", "algo.shuffle_minibatches=false",
             "drift.enabled=false", "train.eval_every=0", "train.save_every=0", "log.tensorboard=false", "log.report=false",
             "log.progress=false", "train.lr=1e-2", "reward.name=moe_rl.testing.e2e:varied_reward"]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_r3_replays_each_tokens_route_from_the_version_that_computed_it(tmp_path, mode):
    cfg = load_config("launch/configs/tiny_cpu.yaml", [*OVERRIDES, f"rollout.inflight_update={mode}",
                                                       f"log.run_dir={tmp_path}"])
    out = run_ranks(async_replay_worker, 1, cfg.to_dict(), str(tmp_path), 6, timeout=900)[0]
    rows = out["rows"]
    spanning = [r for r in rows if len(r["versions"]) > 1]
    print(f"{mode}: {len(rows)} samples, {len(spanning)} span a push, "
          f"{sum(r['checked'] for r in rows)} of {sum(r['positions'] for r in rows)} positions compared, "
          f"{sum(r['versions_differ'] for r in spanning)} of the spanning ones routed otherwise by the other version")
    assert spanning, "no sample lived through a push: the check compared nothing across versions"
    assert sum(r["versions_differ"] for r in spanning) >= len(spanning) // 2  # the versions' routes differ
    assert all(r["replayed_is_engine"] for r in rows)
    assert all(r["equal"] == r["checked"] for r in rows), [r for r in rows if r["equal"] != r["checked"]][:3]
    assert max(m["rollout/staleness_max"] for m in out["metrics"]) <= 2
