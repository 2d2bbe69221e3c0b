"""CPU rehearsal of a multi-node job: the script `moe-rl launch slurm` renders, run end to end.

The stand-in `sbatch`, `srun` and `scontrol` (moe_rl.launch.standin) run it on this
machine with three "nodes" (127.0.0.1-3, local process groups): one trainer node with
two ranks (EP2, gloo) and two rollout nodes, each running `moe-rl serve` on its own
address. The job is rendered in CPU mode (`--gpus-per-node 0`), as a cluster without
GPUs runs it: the trainer's ranks per node come from the config's train.world_size. It runs in container mode, as clusters with pyxis do: the stand-in srun marks
the steps started with --container-image, and the job's interpreter refuses to run
outside one, so every moe_rl command of the job (trainer, servers and the helpers:
prepare-model, wait-healthy, finished) must run in a container step. The story is a
bad day on a cluster:

1. the job starts, prepares the model, starts both servers, waits for them and trains;
2. after step 1 one rollout node dies (SIGKILL to its processes): training goes on
   with the other server;
3. once the trainer has marked the dead server unhealthy (step 2 or 3) the time limit approaches (USR1 to the batch shell, as
   `--signal=B:USR1@N`): the trainer checkpoints and exits 0, the job requeues itself;
4. the requeued run starts both servers again, resumes from the checkpoint
   (train.resume=auto) and finishes every step;
5. no process of the job is left, and the script itself left nothing for SLURM's
   cleanup to kill.
"""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.launch.plan import NodeShape
from moe_rl.launch.slurm import SlurmOptions, render_script, submit, write_job
from moe_rl.launch.standin import install, job_dir, kill_node, live_job_processes, signal_batch, wait_job

NODES = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
STEPS = 8  # steps of ~0.3 s: room for the kill, its notice and the USR1 before the last one
OVERRIDES = [f"train.steps={STEPS}", "train.save_every=1", "rollout.n_samples=4", "data.prompts_per_step=4",
             "algo.num_minibatches=2", "rollout.max_new_tokens=1", "model.tiny.vocab_size=16",
             "train.eval_every=0", "drift.enabled=false", "log.progress=false", "log.tensorboard=false"]


IMAGE = "moe_rl-rehearsal.sqsh"
# The interpreter as a container image holds it: present inside a --container-image step only.
IMAGE_PYTHON = """#!/bin/sh
if [ "$MOE_RL_STANDIN_CONTAINER" != {image} ]; then
  echo "python: not found outside the container image: $*" >&2
  exit 127
fi
exec {real} "$@"
"""


def _image_python(tmp_path: Path) -> str:
    path = tmp_path / "image-python"
    path.write_text(IMAGE_PYTHON.format(image=shlex.quote(IMAGE), real=shlex.quote(sys.executable)))
    path.chmod(0o755)
    return str(path)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _wait_for(what: str, check, job: str, state: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if (job_dir(state, job) / "done").exists():
            pytest.fail(f"the job ended while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_e2e_slurm_rehearsal_node_loss_preemption_resume(tmp_path, monkeypatch):
    for key, value in install(tmp_path / "bin", tmp_path / "state", NODES).items():
        monkeypatch.setenv(key, value)
    state, run_dir = tmp_path / "state", tmp_path / "run"
    opts = SlurmOptions(nccl_ifname="lo", gloo_ifname="lo", health_timeout=180, stop_timeout=20,
                        container_image=IMAGE, python=_image_python(tmp_path))
    rendered = render_script("launch/configs/tiny_cpu.yaml", OVERRIDES, NodeShape(3, 2, 0), opts, run_dir=run_dir)
    assert rendered.shape.world_size == 2 and "--gpus-per-node" not in rendered.text
    job = submit(write_job(rendered, tmp_path / "job.sbatch"))
    out = run_dir / "logs" / f"slurm-{job}.out"

    _wait_for("step 1", lambda: 1 in _steps(run_dir), job, state, 240)
    assert kill_node(state, NODES[2]) >= 1  # a rollout node dies
    # The dead server is noticed on the first request after the kill: step 2's rollout may have
    # finished before it, so wait for the trainer to say so (at step 2 or 3), not for a step.
    first_log_path = run_dir / "logs" / f"job-{job}-0" / f"train-{NODES[0]}.log"
    _wait_for("the dead server marked unhealthy", lambda: 2 in _steps(run_dir) and first_log_path.is_file()
              and f"{NODES[2]}:30000 marked unhealthy" in first_log_path.read_text(), job, state, 120)
    signal_batch(state, job, signal.SIGUSR1)  # the time limit approaches

    rc = wait_job(state, job, 300)
    text = out.read_text()
    assert rc == 0, text
    assert "USR1: asking the trainer to checkpoint and stop" in text
    assert "requeueing job" in text and f"job-{job}-1" in text
    assert re.search(rf"last complete checkpoint: step [1-7] of {STEPS}", text)  # `finished` ran, in the image
    assert "not found outside the container image" not in text
    assert (job_dir(state, job) / "run0.rc").read_text() == "0"
    assert f"srun: error: {NODES[2]}" in text  # the dead node is reported, not hidden
    assert "can't honor" not in text  # every step's task counts agree

    steps = _steps(run_dir)
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), steps
    resumed_log = (run_dir / "logs" / f"job-{job}-1" / f"train-{NODES[0]}.log").read_text()
    assert "resumed from" in resumed_log
    assert f"{NODES[2]}:30000 marked unhealthy" in first_log_path.read_text()
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "meta.json").is_file()
    assert (run_dir / "report" / "index.md").is_file()
    for restart in (0, 1):
        for node in NODES[1:]:
            assert (run_dir / "logs" / f"job-{job}-{restart}" / f"rollout-{node}-0.log").is_file()

    assert live_job_processes(job) == [], "processes of the job are still running"
    leftovers = job_dir(state, job) / "leftovers.txt"
    assert not leftovers.exists(), f"the script left processes behind:\n{leftovers.read_text()}"


def _real_slurm_up() -> bool:
    """A real two-node SLURM cluster answers here (tools/slurm_cluster.sh, which CI brings up)."""
    try:
        return subprocess.run(["bash", "tools/slurm_cluster.sh", "status"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(_real_slurm_up(), reason="a real SLURM cluster is up: tests/slurm/test_real_slurm.py runs this "
                                              "rendered job (rehearsal_cpu.yaml on 2 nodes, 1 for rollout) with the "
                                              "same checks on it")
def test_e2e_slurm_rehearsal_cpu_mode_router_and_weight_sync(tmp_path, monkeypatch):
    """launch/configs/rehearsal_cpu.yaml as `--nodes 2 --rollout-nodes 1 --gpus-per-node 0` renders it:
    4 gloo ranks (tp2+pp2+ep2) on node 1, two `moe-rl serve` workers behind the real sglang-router on
    node 2, weights pushed by all 4 ranks every step; 3 steps, exit 0, nothing left running, no srun
    count warning."""
    nodes = NODES[:2]
    for key, value in install(tmp_path / "bin", tmp_path / "state", nodes).items():
        monkeypatch.setenv(key, value)
    state, run_dir = tmp_path / "state", tmp_path / "run"
    opts = SlurmOptions(nccl_ifname="lo", gloo_ifname="lo", health_timeout=180, stop_timeout=20)
    rendered = render_script("launch/configs/rehearsal_cpu.yaml", ["train.steps=3", "log.progress=false"],
                             NodeShape(2, 1, 0), opts, run_dir=run_dir)
    assert rendered.shape.world_size == 4 and rendered.servers.use_router
    job = submit(write_job(rendered, tmp_path / "job.sbatch"))
    rc = wait_job(state, job, 360)
    text = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert rc == 0, text
    assert "can't honor" not in text and "trainer exited with 0" in text
    assert _steps(run_dir) == [1, 2, 3]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert all("perf/weight_sync_s" in m for m in metrics)
    assert all(m["weight_sync/senders"] == 4 for m in metrics)  # every rank pushed its own share, across nodes
    assert (run_dir / "logs" / f"job-{job}-0" / f"router-{nodes[1]}.log").is_file()
    assert live_job_processes(job) == []
    assert not (job_dir(state, job) / "leftovers.txt").exists()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_e2e_slurm_run_submitted_again_on_fewer_nodes_continues_resharded(tmp_path, monkeypatch):
    """A job on two trainer nodes (one rank each, EP2 across them) and a rollout node saves step 1;
    the same run submitted again on one trainer node (1 rank, EP1) resumes that checkpoint
    resharded (train.resume=auto, as every rendered job passes it) and trains step 2."""
    for key, value in install(tmp_path / "bin", tmp_path / "state", NODES).items():
        monkeypatch.setenv(key, value)
    state, run_dir = tmp_path / "state", tmp_path / "run"
    opts = SlurmOptions(nccl_ifname="lo", gloo_ifname="lo", health_timeout=180, stop_timeout=20,
                        container_image=IMAGE, python=_image_python(tmp_path))
    base = [o for o in OVERRIDES if not o.startswith("train.steps=")] + ["log.report=false"]
    for nodes, world, ep, steps in ((3, 2, 2, 1), (2, 1, 1, 2)):
        rendered = render_script("launch/configs/tiny_cpu.yaml",
                                 [*base, f"train.steps={steps}", f"train.world_size={world}", f"parallel.ep={ep}"],
                                 NodeShape(nodes, 1, 0), opts, run_dir=run_dir)
        assert (rendered.shape.train_nodes, rendered.shape.world_size) == (nodes - 1, world)
        job = submit(write_job(rendered, tmp_path / f"job-{nodes}-nodes.sbatch"))
        rc = wait_job(state, job, 300)
        assert rc == 0, (run_dir / "logs" / f"slurm-{job}.out").read_text()[-5000:]
        assert live_job_processes(job) == [], "processes of the job are still running"
    assert _steps(run_dir) == [1, 2]
    log = (run_dir / "logs" / f"job-{job}-0" / f"train-{NODES[0]}.log").read_text()
    assert "resumed from" in log and "the models reshard" in log, log[-3000:]
    meta = json.loads((run_dir / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["world_size"] == 1
