"""The CPU rehearsal of the flagship wiring: `moe-rl train` on launch/configs/rehearsal_cpu*.yaml.

rehearsal_cpu.yaml: GSPO + R3 on tp2 + sp + pp2 + ep2 (4 ranks) with packing and the distributed
optimizer, two `moe-rl serve` workers behind the real sglang-router, the nccl weight sync's code over
gloo (every rank pushes its own share, verified), eval, dynamic sampling and off-policy overlap,
every collective under the device guard.
rehearsal_cpu_colocated.yaml: servers released after every rollout, with eval every step and
steps skipped by dynamic sampling, so a rollout follows each place a server stays released.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.testing import free_ports

pytestmark = pytest.mark.slow


def _train(config: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "moe_rl.cli", "train", "--config", config, f"log.run_dir={run_dir}",
            f"rollout.base_port={free_ports(4)}", "log.report=false", *overrides]  # 2 servers, the router and its metrics
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_rehearsal_of_the_flagship_wiring(tmp_path):
    proc = _train("launch/configs/rehearsal_cpu.yaml", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r.get("filter/skipped_step", 0.0) == 0.0, f"step {r['step']} was skipped: nothing to measure"
        # R3 routes came back from the workers on every step, through the router setup
        assert "drift/rollout_mismatch" in r and math.isfinite(r["drift/rollout_mismatch"]), r["step"]
        assert math.isfinite(r["loss/pg_loss"]) and math.isfinite(r["perf/grad_norm"]), r["step"]
        assert r["perf/weight_version"] == r["step"]
        # 4 sources (each stage's dense tensors, each rank's experts), each push checked against the servers
        assert r["weight_sync/senders"] == 4.0 and r["weight_sync/verify_s"] > 0, r["step"]
        assert r["weight_sync/busiest_rank_bytes"] < 2 * r["weight_sync/model_bytes"] * 0.75, r["step"]
    # asynchronous (algo.max_staleness=2, in-place pushes): each batch was asked for up to 2 versions back,
    # and per token (the versions the servers report, behind the router, nccl sync) no older than that
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert all(r["rollout/staleness_max"] <= r["rollout/staleness"] for r in rows)
    drift = [r for r in rows if "drift/rollout_mismatch" in r]
    assert drift and all(f"drift/rollout_mismatch_by_staleness/{k}" in r for r in drift for k in (0, 1, 2))
    assert all(sum(r[f"drift/rollout_mismatch_by_staleness/{k}/num_tokens"] for k in (0, 1, 2))
               == r["drift/rollout_mismatch/num_tokens"] for r in drift)  # every routed token has its k
    assert [r["step"] for r in rows if "eval/success_rate" in r] == [2, 4]
    assert {p.name for p in (tmp_path / "servers").glob("*.log")} == {"server-0.log", "server-1.log",
                                                                      "router.log"}
    assert not list((tmp_path / "weights").glob("v*")), "the nccl sync wrote weight versions to disk"
    assert (tmp_path / "checkpoints" / "step_000004" / "meta.json").is_file()


def test_colocated_rehearsal_resumes_before_every_rollout(tmp_path):
    proc = _train("launch/configs/rehearsal_cpu_colocated.yaml", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    skipped = [r["step"] for r in rows if r.get("filter/skipped_step") == 1.0]
    trained = [r["step"] for r in rows if "loss/pg_loss" in r]
    # a rollout after a skipped step and after an eval, each on a server released by the call before
    # (`moe-rl serve` refuses to generate while released, so the run would have failed)
    refilled = [r["step"] for r in rows if r.get("filter/rounds", 1.0) > 1.0]
    assert skipped and trained and refilled, \
        f"skipped {skipped}, trained {trained}, refilled {refilled}: the config no longer covers all three"
    assert all("eval/success_rate" in r for r in rows)
    # Every rollout sampled from the trainer's weights: a release loses the servers' weights (as
    # SGLang's does without --enable-weights-cpu-backup) and the client loads them again when no
    # weight update follows the resume (after an eval, a skipped step). Under R3 the engine's
    # log-probs then equal the trainer's old pass on the same tokens and routes.
    for r in rows:
        if "drift/logp_abs_diff" in r:
            assert r["drift/logp_abs_diff"] <= 1e-4, f"step {r['step']}: engine vs trainer |Δ log p| " \
                                                     f"{r['drift/logp_abs_diff']}: sampled from lost weights"
    assert sum("drift/logp_abs_diff" in r for r in rows) == len(trained)


def test_rehearsal_weights_reach_the_servers_exactly(tmp_path):
    """Without overlap, step 2 samples from the weights step 1 broadcast over the update group:
    the servers' log-probs equal the trainer's on the same tokens and routes."""
    proc = _train("launch/configs/rehearsal_cpu.yaml", tmp_path, "algo.max_staleness=0", "rollout.inflight_update=wait",
                  "train.steps=2", "train.eval_every=0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = _metrics(tmp_path)[-1]
    assert last["step"] == 2 and last["rollout/staleness"] == 0.0
    assert last["drift/logp_abs_diff"] <= 1e-4, f"engine vs trainer |Δ log p| {last['drift/logp_abs_diff']}"
