"""Value-based RL end to end on CPU (2 trainer ranks, EP2, the critic an MoE too): value
pretraining leaves the policy bit for bit, then GAE steps with the critic's R2 and without;
resume from a checkpoint taken mid-warm-up gives the same next steps as an uninterrupted run."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.testing import free_ports, run_ranks
from moe_rl.testing.e2e import critic_steps_worker

GAE = ["model.tiny.vocab_size=16", "parallel.ep=2", "parallel.micro_batch_size=2",
       "parallel.max_tokens_per_microbatch=null", "rollout.n_samples=4", "rollout.max_new_tokens=2",
       "data.prompts_per_step=4", "algo.num_minibatches=2", "train.world_size=2", "train.lr=1e-3",
       "log.tensorboard=false", "log.report=false", "log.progress=false", "data.train=toy:add-easy", "train.eval_every=0",
       "reward.name=moe_rl.testing.e2e:digit_first_reward", "algo.advantage=gae", "algo.loss=dapo",
       "algo.lam=adaptive", "algo.lam_alpha=1.0", "algo.ntp_coef=0.1", "critic.lr=1e-3",
       "critic.warmup_steps=1", "critic.updates_per_step=2", "drift.probe_size=4", "drift.every=1"]
KEYS = ["critic/value_loss", "critic/explained_variance", "critic/value_mean", "critic/return_mean",
        "critic/value_clip_frac", "critic/grad_norm", "critic/lam_policy_mean", "critic/drift/volatility",
        "loss/pg_loss", "loss/ntp_loss", "perf/grad_norm", "drift/volatility"]


def test_gae_steps_with_and_without_critic_replay(tmp_path):
    cfg = load_config("launch/configs/tiny_cpu.yaml", GAE + [f"log.run_dir={tmp_path}", "train.steps=4",
                                                             f"rollout.base_port={free_ports(1)}"])
    results = run_ranks(critic_steps_worker, 2, cfg.to_dict(), str(tmp_path), ["r2", "off"], timeout=900)
    warm, *steps = results[0]
    assert warm["metrics"]["critic/warmup"] == 1.0
    assert all(r["policy_unchanged"] for r in results[0][:1] + results[1][:1]), "warm-up moved the policy"
    assert warm["critic_change"] > 0 and "loss/pg_loss" not in warm["metrics"]
    for r in steps:
        m, name = r["metrics"], f"critic replay {r['replay']}"
        for key in KEYS:
            assert key in m and math.isfinite(m[key]), f"{name}: {key} missing or not finite"
        assert m["critic/warmup"] == 0.0
        assert not r["policy_unchanged"] and r["critic_change"] > 0, name
        assert 0.0 < m["critic/lam_policy_mean"] <= 0.5 + 1e-9  # 1 - 1/(1.0 * length): 0.5 at 2 tokens, 0 at 1
        assert 0.0 <= m["critic/value_clip_frac"] <= 1.0
    assert [r["metrics"]["critic/value_loss"] for r in results[1]] == [r["metrics"]["critic/value_loss"]
                                                                      for r in results[0]]


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): r for r in rows}


def _train(args, timeout=900):
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config", "launch/configs/tiny_cpu.yaml", *GAE, *args,
           f"rollout.base_port={free_ports(1)}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_resume_mid_warmup_gives_the_same_next_steps(tmp_path):
    """A checkpoint of step 1 of a 2-step value pretraining: the resumed run is still in warm-up at
    step 2 and matches the uninterrupted run (policy, critic and their optimizers restored)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    base = ["critic.warmup_steps=2", "train.steps=3", "train.save_every=1", "train.keep_last=5"]
    _train([*base, f"log.run_dir={straight}"])
    _train([*base, f"train.resume={straight}/checkpoints/step_000001", f"log.run_dir={resumed}"])
    assert "resumed from" in (resumed / "train.log").read_text()
    ma, mb = _metrics(straight), _metrics(resumed)
    assert sorted(mb) == [2, 3] and mb[2]["critic/warmup"] == 1.0 and mb[3]["critic/warmup"] == 0.0
    for step in (2, 3):
        for key, value in ma[step].items():
            if key.split("/")[0] in ("reward", "loss", "critic") and "drift" not in key or key == "perf/grad_norm":
                assert mb[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
