"""Multi-turn rollouts end to end (launch/configs/tiny_cpu_tool.yaml, 2 ranks EP2, `moe-rl serve`), in one
asynchronous run: episodes with the calculator tool run, only the model's tokens are trained, the
routes merged turn by turn are the trainer's, drift is measured by turn, and the staleness bound
holds per token across turns."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_rl.testing import free_ports


def test_tool_episodes_train_only_the_models_tokens_replay_merged_routes_and_keep_the_bound(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", "launch/configs/tiny_cpu_tool.yaml",
                        "train.steps=4", "train.eval_every=4", "log.progress=false", "log.report=false",
                        "log.tensorboard=false", "algo.replay=r3", "drift.every=1", "rollout.max_new_tokens=2",
                        "rollout.max_episode_tokens=6", "algo.max_staleness=2", "algo.tis_cap=2",
                        f"log.run_dir={tmp_path}", f"rollout.base_port={free_ports(1)}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # K = 2: the servers play the next two steps' episodes while the trainer trains; every token's
    # version, the environment's included, within 2 of the trained weights
    assert [row["rollout/staleness_max"] for row in rows] == [0.0, 1.0, 2.0, 2.0]  # the pipeline fills, then K
    for row in rows:
        assert 1.0 < row["rollout/turns_mean"] <= 2.0 and row["rollout/env_token_frac"] > 0  # some episodes called
        completion_tokens = row["rollout/response_len"] * row["loss/num_seqs"]
        model_tokens = completion_tokens * (1 - row["rollout/env_token_frac"])
        assert row["loss/num_tokens"] == pytest.approx(model_tokens, abs=1e-3)  # the environment's are not trained
        by_turn = [row[f"drift/volatility_by_turn/{t}/num_tokens"] for t in (0, 1)]
        # each routed row in one turn (the one whose token it produces) or in the context (prompt, environment)
        assert sum(by_turn) + row["drift/volatility_by_turn/context/num_tokens"] == row["drift/volatility/num_tokens"] \
            and by_turn[1] > 0
    # step 1's episodes come from the trained weights (staleness 0): the routes merged turn by turn
    # over HTTP (routed_experts_start_len) are the ones the trainer's routers choose
    first = rows[0]
    assert first["drift/rollout_mismatch"] < 0.01, first["drift/rollout_mismatch"]  # routes off by one position: 0.38
    assert all(first[f"drift/rollout_mismatch_by_turn/{t}"] < 0.01 for t in (0, 1))
    assert first["drift/logp_by_turn/1/abs_diff"] < 1e-4
    assert "eval/success_rate" in rows[-1]
