"""The LoRA demo (launch/configs/tiny_cpu_lora.yaml) under `moe-rl train`, with R3: the adapters alone
learn the task, the servers serve what the trainer computes (merged weights pushed), R3 replays every
engine route and drift is measured, and the checkpoint holds the adapters."""
from __future__ import annotations

import json
import subprocess
import sys

from moe_rl.testing import free_ports


def test_the_lora_demo_learns_with_r3_and_the_servers_serve_the_merged_weights(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", "launch/configs/tiny_cpu_lora.yaml",
                        "algo.replay=r3", "train.steps=24", "train.save_every=24", "log.tensorboard=false",
                        "log.report=false", "log.progress=false", f"log.run_dir={tmp_path}",
                        f"rollout.base_port={free_ports(1)}"], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    m = {row["step"]: row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
         if "step" in row}
    assert m[1]["reward/success_rate"] <= 0.25  # chance is 1/16
    assert max(m[s]["reward/success_rate"] for s in range(18, 25)) >= 0.8, {s: m[s]["reward/success_rate"] for s in m}
    assert all(m[s]["replay/coverage"] == 1.0 for s in m)  # R3: every response token's engine route replayed
    drift = [m[s] for s in m if "drift/logp_abs_diff" in m[s]]
    assert drift and all(d["drift/logp_abs_diff"] <= 1e-4 for d in drift)  # engine == trainer: the merged push
    assert all(0.0 <= d["drift/volatility"] <= 1.0 for d in drift)
    from megatron.core import dist_checkpointing

    ckpt = tmp_path / "checkpoints" / "step_000024" / "policy"
    assert dist_checkpointing.load_content_metadata(str(ckpt))["model_state"] == "lora_adapters"
