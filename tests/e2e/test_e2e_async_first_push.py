"""The first pushes of an asynchronous run keep the samples they land on (issue: cluster path, round 3).

SGLang labels the weights a server starts with "default" and gives every request alive at the first
push a ("default", 0, k) span: version 0, which an asynchronous run may train on. The client took
only the versions the run had pushed, so it generated those samples again and took the server out
of rotation until a probe (a one-server run stalled on it). Here one `moe-rl serve` (SGLang's
labels), K=1 with retracted pushes: step 2's batch is asked for before step 1 trains, and the server
generates its four 460-token samples one at a time (--max-running-requests 1), several times as long
as step 1's training, so the first push lands while they generate. The samples spanning
"default" -> "1" are trained, none is generated again.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_rl.testing import TinyMoEConfig, free_ports, make_tiny_qwen3_moe
from moe_rl.testing.serve import start_serve_process, stop_process

pytestmark = pytest.mark.slow

# a vocabulary of 512 makes EOS (id 2) rare in a random model's samples: they run to max_new_tokens
OVERRIDES = ["train.world_size=1", "parallel.ep=1", "rollout.engine=local", "rollout.weight_sync=disk",
             "algo.max_staleness=1", "rollout.inflight_update=retract", "algo.tis_cap=2", "algo.replay=off",
             "data.train=toy:echo-tail", "data.eval=null", "rollout.max_new_tokens=460", "data.max_prompt_len=32",
             "parallel.max_tokens_per_microbatch=512", "rollout.n_samples=2", "data.prompts_per_step=2",
             "algo.num_minibatches=1", "drift.enabled=false", "train.eval_every=0", "train.save_every=0",
             "train.steps=3", "log.tensorboard=false", "log.report=false", "log.progress=false",
             "reward.name=moe_rl.testing.e2e:varied_reward"]


def test_samples_spanning_the_first_push_are_trained_not_generated_again(tmp_path):
    model = make_tiny_qwen3_moe(tmp_path / "model", config=TinyMoEConfig(vocab_size=512))
    run_dir = tmp_path / "run"
    server = start_serve_process(model, "--max-running-requests", "1", "--trusted-dir", str(tmp_path))
    try:
        proc = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", "launch/configs/tiny_cpu.yaml",
                               *OVERRIDES, f"model.hf_path={model}", f"rollout.urls=[{server.url}]",
                               f"log.run_dir={run_dir}", f"rollout.base_port={free_ports(1)}"],
                              capture_output=True, text=True, timeout=600)
    finally:
        stop_process(server.proc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/stale_resamples"] for r in rows] == [0.0, 0.0, 0.0]
    # step 2's batch was asked for before the first push and generated across it
    assert rows[1]["rollout/partial_frac"] > 0, "no sample lived through the first push: nothing was checked"
    assert rows[1]["rollout/staleness_max"] == 1.0  # its "default" tokens are version 0, one behind
    assert all(r["rollout/dropped_stale_groups"] == 0.0 for r in rows[1:])
