"""The RL loop on the families with sigmoid routers: a tiny GLM-4.5 and a tiny DeepSeek-V3 (plain
RoPE here; YaRN is in tests/distributed/test_families.py), 2 ranks EP2 behind `moe-rl serve`, one
GSPO step under each replay mode. The engine (HF transformers) and the trainer (megatron) agree on
log-probs (|Δ log p| <= 1e-4) and on every route (the dense first layer shifts no MoE layer in
the served routes), the updates replay what each mode says, and the weights move."""
from __future__ import annotations

import math

import pytest

from moe_rl.config import load_config
from moe_rl.testing import free_ports, run_ranks
from moe_rl.testing.e2e import objective_matrix_worker

SMALL = ["model.tiny.vocab_size=16", "parallel.ep=2", "parallel.micro_batch_size=2", "rollout.n_samples=4",
         "rollout.max_new_tokens=2", "data.prompts_per_step=4", "algo.num_minibatches=2", "train.world_size=2",
         "train.lr=1e-3", "log.tensorboard=false", "log.report=false", "log.progress=false",
         "data.train=toy:add-easy", "drift.every=1", "drift.probe_every=1"]


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_each_replay_mode_on_a_sigmoid_router_family(family, tmp_path):
    cfg = load_config("launch/configs/tiny_cpu.yaml", SMALL + [
        f"model.tiny.family={family}", f"log.run_dir={tmp_path}", f"rollout.base_port={free_ports(1)}",
        "rollout.temperature=0.7", "reward.name=moe_rl.testing.e2e:varied_reward"])
    combos = [("gspo", "off"), ("gspo", "r2"), ("gspo", "r3")]
    results = run_ranks(objective_matrix_worker, 2, cfg.to_dict(), str(tmp_path), combos, False, timeout=900)
    assert [(r["loss"], r["replay"]) for r in results[0]] == combos
    for r in results[0]:
        m, name = r["metrics"], f"{family}/{r['replay']}"
        assert math.isfinite(m["loss/pg_loss"]) and r["weight_change"] > 0, name
        assert m["drift/logp_abs_diff"] <= 1e-4, f"{name}: engine vs trainer |Δ log p| {m['drift/logp_abs_diff']}"
        assert m["drift/rollout_mismatch"] == 0.0, f"{name}: engine and trainer routed differently"
        assert sorted(k for k in m if k.startswith("drift/rollout_mismatch/layer_")) == [
            f"drift/rollout_mismatch/layer_{i:02d}" for i in (1, 2, 3)], name  # MoE layers only, by HF index
        if "replay_check" in r:
            assert r["replay_check"] == "ok", f"{name}: {r['replay_check']}"
