"""Real jobs through `moe-rl launch slurm` (no --dry-run) on a two-node SLURM cluster on this
machine (tests/slurm/conftest.py, tools/slurm_cluster.sh): the colocated shape of the CPU
rehearsal, the disaggregated one preempted by USR1 with requeue and resume, and a rollout server
killed mid-job. Every job must leave no queue entry and no process behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _completed(job, timeout: float, steps: int) -> None:
    """The job ends COMPLETED with exit 0, every step 1..steps once in metrics.jsonl, nothing left."""
    state = job.wait(timeout)
    exit_code = job.info().get("ExitCode", "?")
    assert state == "COMPLETED", f"job {job.id}: {state} (ExitCode {exit_code})\n{job.report()}"
    assert job.steps() == list(range(1, steps + 1)), f"metrics steps {job.steps()}\n{job.report()}"
    job.assert_no_leftovers()


def _wait_for_step(job, step: int, timeout: float) -> None:
    """Block until metrics.jsonl holds `step` while the job runs; fail with its logs otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if step in job.steps():
            return
        if job.state() not in {"PENDING", "RUNNING", "CONFIGURING"}:
            pytest.fail(f"job {job.id} ended ({job.state()}) before step {step}\n{job.report()}")
        time.sleep(1)
    job.cancel()
    pytest.fail(f"job {job.id}: step {step} not in metrics.jsonl after {timeout:g} s\n{job.report()}")


def test_colocated_rehearsal_completes(slurm_cluster, tmp_path):
    """rehearsal_cpu_colocated.yaml on 2 nodes, every node trains and serves, 3 steps."""
    job = slurm_cluster.launch("launch/configs/rehearsal_cpu_colocated.yaml", 2, 0, tmp_path / "run", "train.steps=3")
    _completed(job, timeout=600, steps=3)


@pytest.mark.timeout(1500)
def test_preempted_job_requeues_and_resumes_every_step_once(slurm_cluster, tmp_path):
    """rehearsal_cpu.yaml (trainer on node1, the servers and the router on node2), and USR1 to the
    batch shell (as --signal=B:USR1 before the time limit) once step 2 is logged: the trainer
    checkpoints, the job requeues itself, the restart resumes and finishes; every step is in
    metrics.jsonl exactly once and the restart has its own logs/job-<id>-1. It is also the
    disaggregated shape's run to completion: the restart runs that shape again from a checkpoint."""
    steps = 4
    job = slurm_cluster.launch("launch/configs/rehearsal_cpu.yaml", 2, 1, tmp_path / "run", f"train.steps={steps}",
                 "train.save_every=100")
    _wait_for_step(job, 2, timeout=600)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job.id], check=True)
    _completed(job, timeout=1200, steps=steps)
    assert job.info().get("Restarts") == "1", f"Restarts {job.info().get('Restarts')}\n{job.report()}"
    logs = job.run_dir / "logs"
    assert (logs / f"job-{job.id}-0").is_dir() and (logs / f"job-{job.id}-1").is_dir(), job.report()
    first = (logs / f"slurm-{job.id}.out").read_text()
    assert "requeueing job" in first, job.report()
    # the checks of the stand-in rehearsal of this job (tests/e2e/test_e2e_slurm.py), which skips here
    assert "can't honor" not in first, job.report()  # every srun step's task counts agree
    assert list((logs / f"job-{job.id}-0").glob("router-*.log")), job.report()  # behind the real sglang-router
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert all("perf/weight_sync_s" in r for r in rows), job.report()  # weights synced every step


def _server_pids(job) -> list[int]:
    """PIDs of the job's `moe_rl.cli serve` processes (they carry the job's SLURM_JOB_ID)."""
    return [int(line.split()[0]) for line in job.processes()
            if "moe_rl.cli serve" in line or "moe-rl serve" in line]


def test_killed_rollout_server_ends_the_job_with_a_clear_message(slurm_cluster, tmp_path):
    """SIGKILL the only rollout server after step 1: the job ends within a bounded time, either
    COMPLETED or failed with a message naming the lost server (the trainer waits rollout.timeout_s
    for it, checkpoints its last step and exits 3), and leaves nothing behind."""
    job = slurm_cluster.launch("launch/configs/tiny_cpu.yaml", 2, 1, tmp_path / "run", "train.steps=200",
                               "rollout.timeout_s=10")  # the wait after the kill: 10 s, not the default 120
    _wait_for_step(job, 1, timeout=300)
    pids = _server_pids(job)
    assert pids, f"no moe-rl serve process of job {job.id}: {job.processes()}\n{job.report()}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    state = job.wait(timeout=400)
    took = time.monotonic() - killed_at
    if state != "COMPLETED":
        logs = "\n".join(p.read_text(errors="replace") for p in (job.run_dir / "logs").rglob("*")
                         if p.is_file())
        named = re.search(r"node2:\d+", logs) and any(
            s in logs for s in ("RolloutError", "WeightSyncError", "no rollout server answered within rollout.timeout_s"))
        assert named, \
            f"job {job.id} {state} {took:.0f} s after the kill without naming the server\n{job.report()}"
    job.assert_no_leftovers()
