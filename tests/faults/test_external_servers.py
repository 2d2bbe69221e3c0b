"""Faults with servers started by hand (`rollout.urls`), `rollout.weight_sync=nccl` (gloo on CPU:
the same calls).

- A trainer that dies without leaving the weight update group rejoins the servers. A trainer
  killed with -9 never calls `/destroy_weights_update_group`, so each server still holds its
  group, and one killed in the middle of a sync leaves an update session open. torch refuses a
  second group of an existing name, and a server refuses `/begin_weight_update` while a session
  is open: the restarted trainer must join under a new name and close what the dead one left.
- A server that stalls longer than the process groups' timeout: the other ranks wait for rank 0's
  rollout on the control group, whose timeout follows the rollout budget, so they do not time out
  before rank 0 does (on GPUs NCCL's watchdog would have aborted the job).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from moe_rl.rollout.weight_sync import NcclSync
from moe_rl.testing import free_port
from moe_rl.testing.serve import start_serve_process, stop_process

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    """A tiny Qwen3-MoE over the toy tasks' 16 tokens."""
    from moe_rl.testing import make_tiny_qwen3_moe
    from moe_rl.policy.tiny import TinyMoEConfig

    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("toy_model"), config=TinyMoEConfig(vocab_size=16))


@pytest.fixture()
def server(toy_model):
    srv = start_serve_process(toy_model, "--health-check-timeout", "10")
    yield srv
    stop_process(srv.proc)


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _train(run_dir: Path, model: Path, url: str, *extra: str) -> subprocess.Popen:
    args = ["--config", "launch/configs/tiny_cpu.yaml", f"model.hf_path={model}", "parallel.ep=2",
            "parallel.micro_batch_size=2", "parallel.max_tokens_per_microbatch=null", "rollout.n_samples=4",
            "data.prompts_per_step=4", "algo.num_minibatches=2", "train.world_size=2", f"train.steps={STEPS}",
            "train.save_every=1", "train.eval_every=0", "log.tensorboard=false", "log.report=false", "log.progress=false",
            "rollout.weight_sync=nccl", f"rollout.urls=[{url}]", f"log.run_dir={run_dir}", *extra]
    return subprocess.Popen([sys.executable, "-m", "moe_rl.cli", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps(run_dir: Path) -> list[int]:
    m = run_dir / "metrics.jsonl"
    return [json.loads(x)["step"] for x in m.read_text().splitlines() if x.strip()] if m.exists() else []


def _rank_pids(proc: subprocess.Popen) -> list[int]:
    children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    return sorted(p for p in children if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text())


def test_trainer_killed_mid_run_rejoins_servers_it_did_not_start(server, toy_model, tmp_path):
    proc = _train(tmp_path, toy_model, server.url)
    deadline = time.monotonic() + 300
    while 2 not in _steps(tmp_path):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    os.kill(_rank_pids(proc)[0], signal.SIGKILL)  # each rank (EP2: both own tensors) has its update group
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    groups = json.loads((tmp_path / "servers" / "update_group.json").read_text())["group_names"]
    assert len(groups) == 2
    left = [g for g in groups if g.endswith("-r0-s0")]  # rank 1, stopped by SIGTERM, left its own group
    # what the dead trainer left: rank 0's group (still registered in the server) ...
    status, reply = _post(server.url, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
        "group_name": left[0], "backend": "gloo"})
    assert status == 400 and "already exists" in reply["message"]
    # ... and, as after a crash in the middle of a sync, an open update session
    assert _post(server.url, "/begin_weight_update", {})[0] == 200

    out, _ = _train(tmp_path, toy_model, server.url, "train.resume=auto").communicate(timeout=600)
    assert "Traceback" not in out, out[-3000:]
    assert _steps(tmp_path)[-1] == STEPS
    log = (tmp_path / "train.log").read_text()
    assert "closed an open update session" in log and f"destroyed update group {left[0]}" in log
    info = json.loads(urllib.request.urlopen(server.url + "/model_info", timeout=30).read())
    assert info["weight_version"] == str(STEPS)  # the resumed trainer's weights reached the server


def test_a_stalled_server_outlasts_the_collective_timeout_not_the_rollout_budget(server, toy_model, tmp_path):
    proc = _train(tmp_path, toy_model, server.url, "train.collective_timeout_s=5", "train.save_every=0",
                  "train.steps=10")  # the stall starts right after step 1: 9 steps are left for it
    deadline = time.monotonic() + 300
    while 1 not in _steps(tmp_path):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    os.kill(server.proc.pid, signal.SIGSTOP)  # it answers nothing, and nothing fails, for 12 s
    try:
        time.sleep(12)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert _steps(tmp_path)[-1] == 10
    # the stall lands in a rollout or in a weight push (rank 0 waiting on the server either way), while
    # the other rank waits in a hand-off
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    slowest = max(max(r["perf/rollout_s"], r.get("perf/weight_sync_s", 0.0)) for r in rows)
    assert slowest > 5, f"no phase outlasted the 5 s collective timeout ({slowest:.1f} s): the test proves nothing"


def test_a_new_sync_of_the_same_run_destroys_the_group_the_last_one_left(server, tmp_path):
    weights = {"model.norm.weight": torch.ones(64)}
    state = tmp_path / "update_group.json"
    first = NcclSync([server.url], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                     state_file=state)
    first.sync(1, weights.items())  # and never closed, as by a trainer killed with -9
    second = NcclSync([server.url], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                      state_file=state)
    try:
        second.sync(2, weights.items())
        assert second.group_name != first.group_name
        status, reply = _post(server.url, "/destroy_weights_update_group", {"group_name": first.group_name})
        assert status == 400 and "does not exist" in reply["message"]  # the second sync destroyed it
    finally:
        second.close()
