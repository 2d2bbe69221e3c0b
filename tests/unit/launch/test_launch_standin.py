"""The stand-in srun / sbatch / scontrol behave like SLURM where the rendered scripts rely on it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.launch.standin import (StandinError, expand_hostlist, install, job_dir, kill_node, live_job_processes,
                                   sbatch_directives, wait_job)

NODES = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
DUMP = ("import json, os, sys; "
        "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('SLURM')}), flush=True)")


@pytest.fixture
def job_env(tmp_path):
    """The environment of a batch script inside stand-in job 7 on the three nodes."""
    env = {**os.environ, **install(tmp_path / "bin", tmp_path / "state", NODES)}
    env.update({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": ",".join(NODES), "MOE_RL_STANDIN_KILL_WAIT": "2"})
    (job_dir(tmp_path / "state", 7)).mkdir(parents=True)
    return env


def _srun(env, *args, **kw):
    return subprocess.run(["srun", *args], env=env, capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,7],cpu1", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu1"]),
    ("a[8-10]-ib", ["a8-ib", "a9-ib", "a10-ib"]),
    ("127.0.0.1,127.0.0.2", ["127.0.0.1", "127.0.0.2"]),
    ("", []),
])
def test_launch_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def test_launch_expand_hostlist_rejects_bad_ranges():
    with pytest.raises(StandinError):
        expand_hostlist("gpu[a-b]")


def test_launch_srun_gives_each_task_its_slurm_variables(job_env):
    res = _srun(job_env, "--nodes=2", "--ntasks-per-node=3", "--nodelist=127.0.0.2,127.0.0.3", "--label",
                sys.executable, "-c", DUMP)
    assert res.returncode == 0, res.stderr
    seen = {}
    for line in res.stdout.splitlines():
        label, _, payload = line.partition(": ")
        env = json.loads(payload)
        assert env["SLURM_PROCID"] == label
        seen[int(label)] = env
    assert sorted(seen) == list(range(6))
    for rank, env in seen.items():
        assert env["SLURM_NTASKS"] == "6" and env["SLURM_NNODES"] == "2"
        assert env["SLURM_LOCALID"] == str(rank % 3) and env["SLURM_NODEID"] == str(rank // 3)
        assert env["SLURMD_NODENAME"] == NODES[1 + rank // 3]
        assert env["SLURM_TASKS_PER_NODE"] == "3(x2)" and env["SLURM_JOB_NODELIST"] == ",".join(NODES)


def test_launch_srun_splits_uneven_task_counts_in_blocks(job_env):
    res = _srun(job_env, "--nodes=2", "--ntasks=5", "--label", sys.executable, "-c", DUMP)
    envs = sorted((json.loads(line.partition(": ")[2]) for line in res.stdout.splitlines()),
                  key=lambda e: int(e["SLURM_PROCID"]))
    assert [e["SLURMD_NODENAME"] for e in envs] == [NODES[0]] * 3 + [NODES[1]] * 2
    assert [e["SLURM_LOCALID"] for e in envs] == ["0", "1", "2", "0", "1"]
    assert envs[0]["SLURM_TASKS_PER_NODE"] == "3,2"


def test_launch_srun_output_patterns(job_env, tmp_path):
    res = _srun(job_env, "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/out-%j-%N-%t.log",
                sys.executable, "-c", "print('hi')")
    assert res.returncode == 0
    assert sorted(p.name for p in tmp_path.glob("out-*.log")) == [f"out-7-{NODES[0]}-0.log", f"out-7-{NODES[1]}-1.log"]


def test_launch_srun_marks_container_steps(job_env):
    """No container runtime: a --container-image step runs on the host, marked as in the image."""
    show = "import os; print(os.environ.get('MOE_RL_STANDIN_CONTAINER', '-'))"
    inside = _srun(job_env, "--ntasks=1", "--container-image=img.sqsh", "--container-mounts=/a:/a",
                   sys.executable, "-c", show)
    assert inside.returncode == 0 and inside.stdout.split() == ["img.sqsh"]
    outside = _srun({**job_env, "MOE_RL_STANDIN_CONTAINER": "img.sqsh"}, "--ntasks=1", sys.executable, "-c", show)
    assert outside.returncode == 0 and outside.stdout.split() == ["-"]


def test_launch_srun_refuses_nodes_outside_the_job(job_env):
    res = _srun(job_env, "--nodelist=10.0.0.9", "true")
    assert res.returncode == 1 and "not in the job" in res.stderr


def test_launch_srun_outside_a_job_refuses(tmp_path):
    env = {**os.environ, **install(tmp_path / "bin", tmp_path / "state", NODES)}
    env.pop("SLURM_JOB_ID", None)
    res = _srun(env, "true")
    assert res.returncode == 1 and "inside a stand-in sbatch job" in res.stderr


def test_launch_srun_kill_on_bad_exit_stops_the_other_tasks(job_env):
    code = "import os, time, sys; sys.exit(3) if os.environ['SLURM_PROCID'] == '1' else time.sleep(60)"
    start = time.monotonic()
    res = _srun(job_env, "--nodes=1", "--ntasks=3", "--kill-on-bad-exit=1", sys.executable, "-c", code)
    assert time.monotonic() - start < 20
    assert res.returncode == 3 and "task 1: Exited with exit code 3" in res.stderr


def test_launch_srun_forwards_signals_and_escalates(job_env, tmp_path):
    code = ("import os, signal, time\n"
            "signal.signal(signal.SIGUSR1, lambda *a: open(os.environ['OUT'] + os.environ['SLURM_PROCID'], 'w'))\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # only SIGKILL after KillWait ends it
            "print('ready', flush=True)\n"
            "while True: time.sleep(0.05)\n")
    job_env["OUT"] = str(tmp_path / "usr1-")
    proc = subprocess.Popen(["srun", "--nodes=1", "--ntasks=2", "--label", sys.executable, "-c", code], env=job_env,
                            stdout=subprocess.PIPE, text=True)
    for _ in range(2):
        assert "ready" in proc.stdout.readline()
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("usr1-*"))) < 2:
        assert time.monotonic() < deadline, "USR1 did not reach every task"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) != 0  # KillWait (2 s) then SIGKILL
    assert live_job_processes(7) == []


def test_launch_kill_node_kills_only_that_nodes_tasks(job_env, tmp_path):
    proc = subprocess.Popen(["srun", "--nodes=2", "--ntasks-per-node=1", "--label", sys.executable, "-c",
                             "import time; print('up', flush=True); time.sleep(60)"],
                            env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(2):
        proc.stdout.readline()
    assert kill_node(tmp_path / "state", NODES[1]) == 1
    deadline = time.monotonic() + 10
    while len(live_job_processes(7)) > 2:  # srun and the task on node 1 remain
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert f"{NODES[1]}: task 1: Killed by signal 9" in err
    assert live_job_processes(7) == []


def test_launch_scontrol_hostnames_and_requeue(job_env, tmp_path):
    out = subprocess.run(["scontrol", "show", "hostnames", "n[1-2]"], env=job_env, capture_output=True, text=True)
    assert out.stdout.split() == ["n1", "n2"]
    out = subprocess.run(["scontrol", "show", "hostnames"], env=job_env, capture_output=True, text=True)
    assert out.stdout.split() == NODES
    bad = subprocess.run(["scontrol", "requeue", "99"], env=job_env, capture_output=True, text=True)
    assert bad.returncode == 1 and "Invalid job id" in bad.stderr


def test_launch_sbatch_reads_directives_and_runs_the_job(tmp_path):
    env = {**os.environ, **install(tmp_path / "bin", tmp_path / "state", NODES)}
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output=" + str(tmp_path) + "/o-%j.out\n"
                      "#SBATCH --job-name=t\n\necho \"$SLURM_JOB_ID $SLURM_JOB_NODELIST $SLURM_JOB_NAME\"\n"
                      "#SBATCH --nodes=3\n")  # after the first command: not a directive
    assert sbatch_directives(script.read_text()) == ["--nodes=2", f"--output={tmp_path}/o-%j.out", "--job-name=t"]
    res = subprocess.run(["sbatch", str(script)], env=env, capture_output=True, text=True)
    job = res.stdout.split()[-1]
    assert res.stdout.startswith("Submitted batch job ")
    assert wait_job(tmp_path / "state", job, 30) == 0
    assert Path(tmp_path / f"o-{job}.out").read_text().split() == [job, ",".join(NODES[:2]), "t"]


def test_launch_sbatch_refuses_more_nodes_than_it_has(tmp_path):
    env = {**os.environ, **install(tmp_path / "bin", tmp_path / "state", NODES)}
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=4\ntrue\n")
    res = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "node configuration is not available" in res.stderr


def test_launch_sbatch_records_and_kills_what_a_script_leaves_behind(tmp_path):
    env = {**os.environ, **install(tmp_path / "bin", tmp_path / "state", NODES)}
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsetsid sleep 300 &\nsleep 0.5\n")  # escapes its group: only the sweep finds it
    job = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True).stdout.strip()
    assert wait_job(tmp_path / "state", job, 30) == 0
    assert "sleep 300" in (job_dir(tmp_path / "state", job) / "leftovers.txt").read_text()
    assert live_job_processes(job) == []


def test_launch_srun_inherits_the_jobs_task_counts_and_warns_as_slurm(job_env):
    """Inside a batch script srun reads SLURM_NTASKS / SLURM_NTASKS_PER_NODE (the job's) for what its
    command line leaves out: a one-node step with only --ntasks-per-node then asks for the job's tasks,
    and SLURM 22.05 warns, drops --ntasks-per-node and puts them all on that node."""
    job = {**job_env, "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "2"}
    res = _srun(job, "--nodes=1", "--ntasks-per-node=2", "--label", sys.executable, "-c", DUMP)
    assert res.returncode == 0, res.stderr
    assert ("can't honor --ntasks-per-node set to 2 which doesn't match the requested tasks 6 with the number "
            "of requested nodes 1") in res.stderr
    assert len(res.stdout.splitlines()) == 6
    stated = _srun(job, "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--label", sys.executable, "-c", DUMP)
    assert stated.returncode == 0 and "can't honor" not in stated.stderr
    assert sorted(json.loads(line.partition(": ")[2])["SLURM_PROCID"] for line in stated.stdout.splitlines()) == \
        ["0", "1"]
    one = _srun(job, "--nodes=1", "--ntasks=1", sys.executable, "-c", "print('x')")
    assert one.returncode == 0 and "can't honor" not in one.stderr and one.stdout.split() == ["x"]


def test_launch_sbatch_sets_the_jobs_task_counts(tmp_path):
    env = {**os.environ, **install(tmp_path / "bin", tmp_path / "state", NODES), "SLURM_NTASKS": "99"}
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=3\n#SBATCH --cpus-per-task=2\n"
                      f"#SBATCH --output={tmp_path}/o-%j.out\n"
                      'echo "$SLURM_NTASKS $SLURM_NTASKS_PER_NODE $SLURM_TASKS_PER_NODE $SLURM_CPUS_PER_TASK"\n')
    job = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True).stdout.strip()
    assert wait_job(tmp_path / "state", job, 30) == 0
    assert (tmp_path / f"o-{job}.out").read_text().split() == ["6", "3", "3(x2)", "2"]
