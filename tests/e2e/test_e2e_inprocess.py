"""`rollout.engine=inprocess`: the engine inside the trainer gives the run a `moe-rl serve` server gives.

Same config and seeds, one trainer rank: once with the engine behind HTTP (weights by disk),
once in the trainer's process (weights copied as tensors). Every request carries its
sampling seed, so both must draw the same samples and take the same steps.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.testing import free_ports

BASE = ["--config", "launch/configs/tiny_cpu.yaml", "train.world_size=1", "parallel.ep=1", "train.steps=2",
        "train.save_every=0", "train.eval_every=0", "rollout.n_samples=4", "rollout.max_new_tokens=2",
        "data.prompts_per_step=4", "log.tensorboard=false", "log.report=false", "log.progress=false", "drift.probe_every=1",
        "drift.every=1"]


def _train(run_dir: Path, *overrides: str) -> dict[int, dict]:
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", *BASE, *overrides, f"log.run_dir={run_dir}"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(row["step"]): row for row in rows}


def test_inprocess_engine_takes_the_served_engines_steps(tmp_path):
    served = _train(tmp_path / "served", f"rollout.base_port={free_ports(1)}")
    inproc = _train(tmp_path / "inprocess", "rollout.engine=inprocess", "rollout.weight_sync=tensor")
    assert not (tmp_path / "inprocess" / "servers").exists()  # no server was started
    assert sorted(inproc) == sorted(served) == [1, 2]
    for step in (1, 2):
        a, b = served[step], inproc[step]
        assert b["reward/mean"] == a["reward/mean"], step  # the same samples were drawn
        for key in ("loss/pg_loss", "loss/ratio_mean", "perf/grad_norm", "drift/volatility"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)
        # After each tensor sync the engine serves the trainer's weights: the same log-probs.
        assert b["drift/logp_abs_diff"] <= 1e-4, (step, b["drift/logp_abs_diff"])
