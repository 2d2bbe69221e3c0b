"""algo.auto_staleness through `moe-rl train`: with a KL bar every step crosses, an asynchronous run
that starts at K=2 lowers K one step at a time to 0, says so in its log, and never trains a token
staler than the K its batch was asked for with."""
from __future__ import annotations

import json
import subprocess
import sys

from moe_rl.testing import free_ports


def test_auto_staleness_lowers_k_to_on_policy_and_logs_each_step_down(tmp_path):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", "launch/configs/tiny_cpu.yaml",
                        "train.world_size=1", "parallel.ep=1", "rollout.engine=inprocess", "rollout.weight_sync=tensor",
                        "algo.max_staleness=2", "algo.auto_staleness=true", "algo.auto_staleness_kl=1e-12",
                        "algo.auto_staleness_steps=1", "train.steps=5", "data.eval=null", "train.eval_every=0",
                        "train.save_every=0", "log.report=false", "log.progress=false", "drift.enabled=false",
                        f"log.run_dir={run}", f"rollout.base_port={free_ports(1)}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["rollout/staleness_bound"] for row in rows] == [2, 1, 0, 0, 0]
    # each batch at most as stale as the K it was asked for with (step s's batch: at step s - K)
    assert [row["rollout/staleness_max"] for row in rows][3:] == [0, 0]
    assert max(row["rollout/staleness_max"] for row in rows) <= 2
    log = (run / "train.log").read_text()
    assert "algo.auto_staleness: K 2 -> 1 after step 1" in log and "algo.auto_staleness: K 1 -> 0 after step 2" in log
