"""Multi-turn rollouts end to end (launch/configs/tiny_cpu_tool.yaml, 2 ranks EP2, `moe-rl serve`):
episodes with the calculator tool run, are logged, and only the model's tokens are trained."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_rl.testing import free_ports


def test_tool_config_runs_episodes_and_trains_only_the_models_tokens(tmp_path):
    """With R3 and drift every step: the episodes' routes, merged turn by turn over HTTP
    (routed_experts_start_len), are the ones the trainer's routers choose on the same weights."""
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", "launch/configs/tiny_cpu_tool.yaml",
                        "train.steps=2", "train.eval_every=2", "log.progress=false", "log.report=false",
                        "algo.replay=r3", "drift.every=1", "rollout.max_new_tokens=2", "rollout.max_episode_tokens=6",
                        "log.tensorboard=false", f"log.run_dir={tmp_path}", f"rollout.base_port={free_ports(1)}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 1.0 < row["rollout/turns_mean"] <= 2.0 and row["rollout/env_token_frac"] > 0  # some episodes called
        completion_tokens = row["rollout/response_len"] * row["loss/num_seqs"]
        model_tokens = completion_tokens * (1 - row["rollout/env_token_frac"])
        assert row["loss/num_tokens"] == pytest.approx(model_tokens, abs=1e-3)  # the environment's are not trained
        assert 0.0 <= row["reward/mean"] <= 1.2
        assert row["drift/rollout_mismatch"] < 0.01, row["drift/rollout_mismatch"]  # routes off by one position: 0.38
        # drift by turn: every routed position in exactly one turn's count
        by_turn = [row[f"drift/volatility_by_turn/{t}/num_tokens"] for t in (0, 1)]
        assert sum(by_turn) == row["drift/volatility/num_tokens"] and by_turn[1] > 0
        assert all(row[f"drift/rollout_mismatch_by_turn/{t}"] < 0.01 for t in (0, 1))
        assert row["drift/logp_by_turn/1/abs_diff"] < 1e-4
    assert "eval/success_rate" in rows[-1]


def test_asynchronous_episodes_keep_the_staleness_bound_across_turns(tmp_path):
    """algo.max_staleness=2: the servers play the next two steps' episodes while the trainer trains;
    every token's weight version, the environment's included, is within 2 of the trained weights."""
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", "launch/configs/tiny_cpu_tool.yaml",
                        "train.steps=4", "train.eval_every=0", "log.progress=false", "log.report=false",
                        "log.tensorboard=false", "algo.max_staleness=2", "algo.tis_cap=2", "drift.every=1",
                        f"log.run_dir={tmp_path}", f"rollout.base_port={free_ports(1)}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["rollout/staleness_max"] for row in rows] == [0.0, 1.0, 2.0, 2.0]  # the pipeline fills, then K
    assert all(row["rollout/turns_mean"] > 1.0 and "drift/rollout_mismatch_by_turn/1" in row for row in rows)
