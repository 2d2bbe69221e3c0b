"""Faults during a real `moe-rl train` run (2 ranks, EP2, tiny model, one `moe-rl serve`): each run that
can survive finishes with the metrics of an undisturbed run, bit for bit from the last checkpoint on.
Only processes this test started (the trainer and its rollout server) are signalled, by PID."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.testing import free_ports

pytestmark = pytest.mark.slow

STEPS = 4
ARGS = ["--config", "launch/configs/tiny_cpu.yaml", "model.tiny.vocab_size=16", "parallel.ep=2",
        "parallel.micro_batch_size=2", "parallel.max_tokens_per_microbatch=null", "rollout.n_samples=4",
        "rollout.max_new_tokens=2", "data.prompts_per_step=4", "algo.num_minibatches=2", "train.world_size=2",
        "train.lr=1e-3", "log.tensorboard=false", "log.report=false", "log.progress=false", "data.train=toy:add-easy",
        f"train.steps={STEPS}", "train.save_every=1", "train.eval_every=0"]
COMPARED = ("reward", "loss", "adv")


def _train(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moe_rl.cli", "train", *ARGS, f"log.run_dir={run_dir}",
                             f"rollout.base_port={free_ports(1)}", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {int(r["step"]): r for r in rows}  # the latest record of each step


def _same(reference: dict[int, dict], got: dict[int, dict], steps) -> None:
    for step in steps:
        for key, value in reference[step].items():
            if key.split("/")[0] in COMPARED or key == "perf/grad_norm":
                assert got[step][key] == value, (step, key, got[step][key], value)


def _wait_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = run_dir / "metrics.jsonl"
        if m.exists() and any(json.loads(x).get("step") == step for x in m.read_text().splitlines() if x.strip()):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached; trainer exit code {proc.poll()}")


def _server_pid(run_dir: Path) -> int:
    """The rollout server the trainer launched (its pid from train.log; a child of our trainer)."""
    pids = re.findall(r"started server-0 \(pid (\d+)\)", (run_dir / "train.log").read_text())
    return int(pids[-1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    run_dir = tmp_path_factory.mktemp("undisturbed")
    code, out = _finish(_train(run_dir))
    assert code == 0, out[-3000:]
    return _metrics(run_dir)


def test_server_killed_during_the_run_is_restarted_and_nothing_is_lost(reference, tmp_path):
    proc = _train(tmp_path)
    _wait_step(tmp_path, 1, proc)
    victim = _server_pid(tmp_path)
    os.kill(victim, signal.SIGKILL)
    code, out = _finish(proc)
    assert code == 0, out[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "restarting it (1 of 3)" in log and _server_pid(tmp_path) != victim
    _same(reference, _metrics(tmp_path), range(1, STEPS + 1))


def test_no_server_back_within_the_timeout_checkpoints_and_exits(reference, tmp_path):
    proc = _train(tmp_path, "rollout.max_restarts=0", "rollout.timeout_s=10")
    _wait_step(tmp_path, 2, proc)
    os.kill(_server_pid(tmp_path), signal.SIGKILL)
    code, out = _finish(proc)
    assert code == 3, out[-3000:]
    assert "no rollout server answered within rollout.timeout_s=10" in (tmp_path / "train.log").read_text()
    from moe_rl.train.checkpoint import latest_checkpoint

    done = max(_metrics(tmp_path))
    assert latest_checkpoint(tmp_path).name == f"step_{done:06d}"  # every finished step is kept
    code, out = _finish(_train(tmp_path, "train.resume=auto"))
    assert code == 0, out[-3000:]
    _same(reference, _metrics(tmp_path), range(1, STEPS + 1))


@pytest.mark.parametrize("victim", [0, 1])
def test_rank_killed_leaves_no_server_and_resume_continues(reference, tmp_path, victim):
    proc = _train(tmp_path)
    _wait_step(tmp_path, 2, proc)
    server = _server_pid(tmp_path)
    children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    ranks = sorted(p for p in children if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text())
    assert len(ranks) == 2, children
    os.kill(ranks[victim], signal.SIGKILL)  # rank 0 started the server; rank 1 did not
    code, out = _finish(proc)
    assert code != 0
    deadline = time.monotonic() + 30
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(server), "the rollout server outlived its run"
    code, out = _finish(_train(tmp_path, "train.resume=auto"))
    assert code == 0, out[-3000:]
    _same(reference, _metrics(tmp_path), range(1, STEPS + 1))


def test_server_killed_mid_async_run_is_restarted_and_no_step_trains_on_older_tokens(tmp_path):
    # algo.max_staleness=2: the servers are generating the next two batches when the kill lands; those
    # requests are sent again to the restarted server (which gets the latest weights first), every
    # step runs once, and no step trains on a token more than 2 versions old
    proc = _train(tmp_path, "algo.max_staleness=2", "algo.tis_cap=2", "rollout.max_new_tokens=6")
    _wait_step(tmp_path, 1, proc)
    victim = _server_pid(tmp_path)
    os.kill(victim, signal.SIGKILL)
    code, out = _finish(proc)
    assert code == 0, out[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "restarting it (1 of 3)" in log and "is healthy again" in log
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "rollout/staleness_max" in r]
    assert sorted(r["step"] for r in steps) == list(range(1, STEPS + 1))
    assert all(r["rollout/staleness_max"] <= 2 for r in steps), [r["rollout/staleness_max"] for r in steps]
    assert all(r["reward/mean"] == r["reward/mean"] for r in steps)  # every step had its samples


def _batches_drawn(ckpt: Path, n: int) -> tuple[dict, dict]:
    """The data order a checkpoint saved, and the order after exactly `n` batches of the same sampler."""
    import torch

    from moe_rl.data.sampler import PromptSampler

    saved = torch.load(ckpt / "rank_00000.pt", weights_only=False)["sampler"]
    fresh = PromptSampler(saved["dataset_len"], saved["batch_size"], seed=saved["seed"], shuffle=saved["shuffle"])
    for _ in range(n):
        fresh.next_batch()
    return saved, fresh.state_dict()


def test_sigterm_mid_async_run_saves_the_batches_in_flight_as_untrained_and_resume_trains_each_once(tmp_path):
    # algo.max_staleness=2: at the signal the servers are generating the next two steps' batches.
    # The checkpoint of the last step records the data order before those batches, so the resumed
    # run asks for them again: no batch is skipped or trained twice, and no step trains on a token
    # more than 2 versions old (the resumed run's first batches are fresh)
    from moe_rl.testing.e2e import sigterm_after_first_step
    from moe_rl.train.checkpoint import latest_checkpoint

    extra = ("algo.max_staleness=2", "algo.tis_cap=2", "rollout.max_new_tokens=6")
    # to the whole process group after step 1, as SLURM signals a job step
    code, out = sigterm_after_first_step([sys.executable, "-m", "moe_rl.cli", "train", *ARGS, f"log.run_dir={tmp_path}",
                                          f"rollout.base_port={free_ports(1)}", *extra, "train.steps=100"], tmp_path)
    assert code == 0 and "Traceback" not in out, out[-3000:]
    stopped = max(_metrics(tmp_path))
    assert f"checkpoint of step {stopped} saved" in (tmp_path / "train.log").read_text()
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == f"step_{stopped:06d}"
    saved, want = _batches_drawn(ckpt, stopped)  # `stopped` + 2 batches were drawn; `stopped` trained
    assert (saved["epoch"], saved["position"]) == (want["epoch"], want["position"])
    code, out = _finish(_train(tmp_path, *extra, f"train.steps={stopped + 2}", "train.resume=auto"))
    assert code == 0, out[-3000:]
    saved, want = _batches_drawn(latest_checkpoint(tmp_path), stopped + 2)
    assert (saved["epoch"], saved["position"]) == (want["epoch"], want["position"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "rollout/staleness_max" in r]
    assert [r["step"] for r in steps] == list(range(1, stopped + 3))  # each step once, none skipped
    assert all(r["rollout/staleness_max"] <= 2 for r in steps), [r["rollout/staleness_max"] for r in steps]
    assert steps[stopped]["rollout/staleness_max"] == 0  # the first step after the resume: asked anew
