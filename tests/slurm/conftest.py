"""The real-SLURM tier: a two-node cluster on this machine (tools/slurm_cluster.sh) and helpers
to submit `moe-rl launch slurm` jobs to it, wait for them, and explain them when a test fails.

The session fixture uses a cluster that is already up (`.ci/run` brings one up before `make
test`) and leaves it up; otherwise it brings one up itself (root only: it installs slurm-wlm
and munge with apt-get when missing) and tears it down at the end. Without root, or when the
bring-up fails, every test here skips with what failed and where its log is.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from moe_rl.testing import free_ports

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "slurm_cluster.sh"
CLUSTER_ROOT = Path(os.environ.get("MOE_RL_SLURM_ROOT", "/var/tmp/moe_rl_slurm"))
CONF = CLUSTER_ROOT / "etc" / "slurm.conf"

# States a job does not leave (a requeued job goes back to PENDING, which is not among them).
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _cluster(action: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `tools/slurm_cluster.sh ACTION` against CLUSTER_ROOT."""
    env = {**os.environ, "MOE_RL_SLURM_ROOT": str(CLUSTER_ROOT)}
    return subprocess.run(["bash", str(SCRIPT), action], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The cluster (see SlurmCluster), with SLURM_CONF set for this process and its children."""
    if os.geteuid() != 0:
        pytest.skip("the real-SLURM tier needs root (tools/slurm_cluster.sh installs slurm-wlm "
                    "and starts its daemons); run `sudo bash tools/slurm_cluster.sh up` first")
    already_up = _cluster("status", 60).returncode == 0
    if not already_up:
        try:
            res = _cluster("up", 900)
        except subprocess.TimeoutExpired:
            pytest.skip(f"tools/slurm_cluster.sh up did not finish in 900 s; logs in {CLUSTER_ROOT}/log")
        if res.returncode != 0:
            _cluster("down", 120)
            pytest.skip(f"tools/slurm_cluster.sh up failed (exit {res.returncode}): "
                        f"{res.stderr.strip()[-800:]}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(CONF)
    yield SlurmCluster(CONF)
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if not already_up:
        _cluster("down", 120)


@dataclass
class SlurmCluster:
    """The running cluster, as the tests use it: submit jobs to it."""
    conf: Path

    def launch(self, config: str, nodes: int, rollout_nodes: int, run_dir: Path, *overrides: str) -> "Job":
        """Submit `moe-rl launch slurm --gpus-per-node 0` (no --dry-run) and return the job."""
        cmd = [sys.executable, "-m", "moe_rl.cli", "launch", "slurm", "--config", str(ROOT / config),
               "--nodes", str(nodes), "--rollout-nodes", str(rollout_nodes), "--gpus-per-node", "0",
               "--run-dir", str(run_dir), "--python", sys.executable,
               # ports of its own (servers, router, its metrics), below the ephemeral range
               f"rollout.base_port={free_ports(4)}", "log.report=false", *overrides]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"moe-rl launch slurm failed:\n{res.stdout}\n{res.stderr}"
        match = re.search(r"submitted job (\d+)", res.stdout)
        assert match, f"no job id in moe-rl launch slurm's output:\n{res.stdout}"
        return Job(match.group(1), run_dir)


@dataclass
class Job:
    """A job submitted by `moe-rl launch slurm`: its id and run directory."""
    id: str
    run_dir: Path

    def info(self) -> dict[str, str]:
        """`scontrol show job` as key -> value ({} once slurmctld has forgotten the job)."""
        res = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True)
        if res.returncode != 0:
            return {}
        return dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv)

    def state(self) -> str:
        """JobState, or the last state jobcomp recorded once slurmctld has forgotten the job."""
        info = self.info()
        if info:
            return info["JobState"]
        records = [line for line in _jobcomp_lines() if f"JobId={self.id} " in line]
        return re.search(r"JobState=(\S+)", records[-1]).group(1) if records else "UNKNOWN"

    def wait(self, timeout: float) -> str:
        """Poll until the job reaches a terminal state; on timeout cancel it and fail with its logs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state in TERMINAL:
                return state
            time.sleep(2)
        self.cancel()
        pytest.fail(f"job {self.id} not finished after {timeout:g} s (state {self.state()})\n{self.report()}")

    def cancel(self) -> None:
        """scancel this job (ours: the test submitted it) if it still runs."""
        if self.info().get("JobState") not in TERMINAL | {None}:
            subprocess.run(["scancel", self.id], capture_output=True)

    def steps(self) -> list[int]:
        """The `step` of every line of the run's metrics.jsonl, in file order."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line)["step"] for line in lines if line.strip()]

    def report(self) -> str:
        """What a failing test prints: the job's state, slurm-<job>.out, the tails of its logs."""
        parts = [f"--- scontrol: {self.info() or 'forgotten'}"]
        logs = self.run_dir / "logs"
        for path in sorted(logs.rglob("*")) if logs.exists() else []:
            if path.is_file():
                lines = path.read_text(errors="replace").splitlines()
                parts.append(f"--- {path} (last 60 of {len(lines)} lines)\n" + "\n".join(lines[-60:]))
        return "\n".join(parts)

    def processes(self) -> list[str]:
        """`pid cmdline` of the processes on this machine whose environment has SLURM_JOB_ID=<id>."""
        needle = f"SLURM_JOB_ID={self.id}\0".encode()
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes()
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            if environ.startswith(needle) or b"\0" + needle in environ:
                found.append(f"{proc.name} {cmdline.strip()}")
        return found

    def assert_no_leftovers(self, grace: float = 30.0) -> None:
        """The job is gone from squeue and none of its processes live on (after `grace` seconds)."""
        deadline = time.monotonic() + grace
        while True:
            queued = subprocess.run(["squeue", "-h", "-j", self.id], capture_output=True,
                                    text=True).stdout.strip()
            procs = self.processes()
            if not queued and not procs:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        pytest.fail(f"job {self.id} left behind: squeue {queued!r}, processes {procs}\n{self.report()}")


def _jobcomp_lines() -> list[str]:
    path = CLUSTER_ROOT / "log" / "jobcomp.txt"
    return path.read_text().splitlines() if path.exists() else []
