"""Rendered sbatch scripts run for real under the stand-in srun / sbatch / scontrol,
with a stand-in interpreter: servers answer /health, trainer ranks record their
environment and arguments and exit. Checks what each rank would get on a cluster
(against an expectation computed here, independently of the launcher), the URLs
the trainer is given, per-node logs, failures, preemption + requeue, and that no
process outlives the job.
"""
from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from moe_rl.launch import slurm as slurm_mod
from moe_rl.launch.cli import main as launch_main
from moe_rl.launch.plan import NodeShape
from moe_rl.launch.slurm import SlurmOptions, render_script
from moe_rl.launch.standin import install, job_dir, live_job_processes, signal_batch, wait_job

TINY = "launch/configs/tiny_cpu.yaml"
QWEN = "launch/configs/qwen3_30b_a3b_gspo.yaml"
NODES = [f"127.0.0.{i}" for i in range(1, 7)]  # loopback addresses: each "node" binds its own ports

FAKE_PYTHON = r'''#!{real}
"""Stand-in interpreter: servers answer /health (a router /readiness), `train` records its rank's view and exits."""
import json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REAL = {real!r}
argv = sys.argv[1:]
mod = argv[1] if argv[:1] == ["-m"] else None
sub = argv[2] if len(argv) > 2 else None


def opt(name):
    return argv[argv.index(name) + 1]


# Every call is recorded; with FAKE_ONLY_IN_CONTAINER this interpreter exists only in the
# image, as a container's python would: outside a --container-image step it is not there.
if os.environ.get("FAKE_DUMP"):
    os.makedirs(os.environ["FAKE_DUMP"], exist_ok=True)
    with open(os.path.join(os.environ["FAKE_DUMP"], "calls.jsonl"), "a") as f:
        f.write(json.dumps({{"argv": argv, "container": os.environ.get("MOE_RL_STANDIN_CONTAINER")}}) + "\n")
if os.environ.get("FAKE_ONLY_IN_CONTAINER") and not os.environ.get("MOE_RL_STANDIN_CONTAINER"):
    print("fake python: not found outside the container image:", *argv, file=sys.stderr, flush=True)
    sys.exit(127)


ROUTERS = ("sglang_router.launch_router", "moe_rl.rollout.router_main")


def serve():
    port = int(opt("--port"))
    if str(port) == os.environ.get("FAKE_BROKEN_PORT"):
        print("cannot start: fake failure", flush=True)
        sys.exit(3)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            ready = "/readiness" if mod in ROUTERS else "/health"
            self.send_response(200 if self.path == ready else 404)  # a router: /health is not enough
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((opt("--host"), port), Health)
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    print("serving", opt("--host"), port, flush=True)
    server.serve_forever()


def train():
    out = os.environ["FAKE_DUMP"]
    os.makedirs(out, exist_ok=True)
    rank = os.environ["RANK"]
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    stop = []
    signal.signal(signal.SIGUSR1, lambda *a: stop.append(1))
    open(os.path.join(out, f"ready-{{rank}}-restart-{{restart}}"), "w").close()  # USR1 is handled from here on
    # The first run trains until USR1 (or FAKE_TRAIN_SECONDS); a requeued run finishes at once.
    deadline = time.time() + (float(os.environ.get("FAKE_TRAIN_SECONDS", "0")) if restart == "0" else 0)
    while time.time() < deadline and not stop:
        time.sleep(0.05)
    run_dir = [a.split("=", 1)[1] for a in argv if a.startswith("log.run_dir=")][-1]
    step = 1 if stop else int(os.environ.get("FAKE_STEPS", "1"))
    if rank == "0":  # a complete checkpoint, as the trainer writes it
        ckpt = os.path.join(run_dir, "checkpoints", f"step_{{step:06d}}")
        os.makedirs(ckpt, exist_ok=True)
        with open(os.path.join(ckpt, "meta.json"), "w") as f:
            json.dump({{"step": step, "world_size": int(os.environ["WORLD_SIZE"])}}, f)
    with open(os.path.join(out, f"rank-{{rank}}-restart-{{restart}}.json"), "w") as f:
        json.dump({{"env": dict(os.environ), "argv": argv, "stopped": bool(stop)}}, f)
    print(f"rank {{rank}} done", flush=True)


if mod in ("sglang.launch_server", *ROUTERS) or (mod == "moe_rl.cli" and sub == "serve"):
    serve()
elif mod == "moe_rl.cli" and sub == "train":
    train()
elif mod == "moe_rl.launch.task" and sub == "prepare-model":
    print("/fake/init_model")
else:
    os.execv(REAL, [REAL] + argv)
'''


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """Stand-in SLURM on PATH, a stand-in interpreter, and a place for ranks to report."""
    env = install(tmp_path / "bin", tmp_path / "state", NODES)
    env["MOE_RL_STANDIN_KILL_WAIT"] = "5"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("FAKE_DUMP", str(tmp_path / "dump"))
    return {"tmp": tmp_path, "state": tmp_path / "state", "python": str(fake), "dump": tmp_path / "dump"}


def _render(cluster, config, shape, overrides=(), **opts):
    options = SlurmOptions(python=cluster["python"], nccl_ifname="lo", gloo_ifname="lo", health_timeout=30,
                           stop_timeout=5, **opts)
    rendered = render_script(config, list(overrides), shape, options, run_dir=cluster["tmp"] / "run")
    return slurm_mod.write_job(rendered, cluster["tmp"] / "job.sbatch"), rendered


def _submit(cluster, script: Path) -> str:
    return slurm_mod.submit(script)


def _ranks(cluster, restart=0) -> dict[int, dict]:
    out = {}
    for f in cluster["dump"].glob(f"rank-*-restart-{restart}.json"):
        d = json.loads(f.read_text())
        out[int(d["env"]["RANK"])] = d
    return out


def expected_ranks(shape: NodeShape, nodes: list[str]) -> dict[int, dict[str, str]]:
    """What srun + rank-env must give each trainer rank: block placement over the trainer nodes."""
    train_nodes = nodes[:shape.nodes] if shape.colocated else nodes[:shape.nodes - shape.rollout_nodes]
    g = shape.gpus_per_node
    world = len(train_nodes) * g
    return {r: {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r % g), "LOCAL_WORLD_SIZE": str(g),
                "NODE_RANK": str(r // g), "SLURMD_NODENAME": train_nodes[r // g], "MASTER_ADDR": train_nodes[0],
                "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
            for r in range(world)}


def _assert_clean(cluster, job: str) -> None:
    assert live_job_processes(job) == [], "processes outlived the job"
    leftovers = job_dir(cluster["state"], job) / "leftovers.txt"
    assert not leftovers.exists(), f"the script left processes running:\n{leftovers.read_text()}"


def _output(cluster, job: str) -> str:
    return (cluster["tmp"] / "run" / "logs" / f"slurm-{job}.out").read_text()


@pytest.mark.parametrize("nodes,rollout,gpus", [(2, 1, 2), (3, 1, 2), (4, 2, 2), (2, 0, 2), (3, 0, 1)])
def test_launch_rank_env_matches_block_placement(cluster, nodes, rollout, gpus):
    shape = NodeShape(nodes, rollout, gpus)
    script, rendered = _render(cluster, TINY, shape, ["parallel.ep=1"])
    job = _submit(cluster, script)
    assert wait_job(cluster["state"], job, 60) == 0, _output(cluster, job)
    ranks = _ranks(cluster)
    expected = expected_ranks(shape, NODES)
    assert sorted(ranks) == sorted(expected)
    serve_nodes = NODES[:nodes] if rollout == 0 else NODES[nodes - rollout:nodes]
    urls = ",".join(f"http://{n}:30000" for n in serve_nodes)
    master_port = ranks[0]["env"]["MASTER_PORT"]
    assert master_port == str(20000 + int(job) % 9000)
    for r, want in expected.items():
        env, argv = ranks[r]["env"], ranks[r]["argv"]
        assert {k: env[k] for k in want} == want, f"rank {r}"
        assert env["MASTER_PORT"] == master_port and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert argv[argv.index("--config") + 1] == str(Path(TINY).absolute())
        assert f"rollout.urls=[{urls}]" in argv and "train.resume=auto" in argv
        assert f"log.run_dir={rendered.run_dir}" in argv
    logs = rendered.run_dir / "logs" / f"job-{job}-0"
    train_nodes = sorted({e["SLURMD_NODENAME"] for e in expected.values()})
    assert sorted(p.name for p in logs.glob("train-*.log")) == [f"train-{n}.log" for n in train_nodes]
    assert sorted(p.name for p in logs.glob("rollout-*.log")) == sorted(f"rollout-{n}-0.log" for n in serve_nodes)
    # --label: every line of a trainer log names its task
    for log in logs.glob("train-*.log"):
        assert all(line.split(":")[0].strip().isdigit() for line in log.read_text().splitlines() if line)
    _assert_clean(cluster, job)


def test_launch_sglang_servers_and_router(cluster, monkeypatch):
    """SGLang shape with a trainer that accepts rollout.admin_urls: router in front, updates to the servers."""
    fields = slurm_mod._rollout_fields
    monkeypatch.setattr(slurm_mod, "_rollout_fields", lambda cfg: fields(cfg) | {"admin_urls"})
    monkeypatch.setattr(slurm_mod, "_check_overrides", lambda *a, **k: None)
    shape = NodeShape(3, 2, 4)  # 1 trainer node x 4 ranks; 2 rollout nodes x 2 servers (tp=2)
    overrides = ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2", "rollout.host=127.0.0.1"]
    script, rendered = _render(cluster, QWEN, shape, overrides)
    assert rendered.servers.per_node == 2 and rendered.servers.router_port == 30002
    job = _submit(cluster, script)
    assert wait_job(cluster["state"], job, 60) == 0, _output(cluster, job)
    ranks = _ranks(cluster)
    assert sorted(ranks) == [0, 1, 2, 3]
    workers = ",".join(f"http://{n}:{p}" for n in NODES[1:3] for p in (30000, 30001))
    argv = ranks[0]["argv"]
    assert f"rollout.urls=[http://{NODES[1]}:30002]" in argv
    assert f"rollout.admin_urls=[{workers}]" in argv
    logs = rendered.run_dir / "logs" / f"job-{job}-0"
    assert (logs / f"router-{NODES[1]}.log").is_file()
    assert "--base-gpu-id 2" in rendered.text and "SGLANG_RETURN_ORIGINAL_LOGPROB" not in rendered.text
    _assert_clean(cluster, job)


def _calls(cluster) -> list[dict]:
    path = cluster["dump"] / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_launch_container_mode_runs_nothing_of_moe_rl_on_the_batch_host(cluster, monkeypatch):
    """--container-image: the interpreter exists only inside the image, so every moe_rl command of
    the job (helpers included: prepare-model, wait-healthy) must run in a --container-image step."""
    monkeypatch.setenv("FAKE_ONLY_IN_CONTAINER", "1")
    script, rendered = _render(cluster, TINY, NodeShape(2, 1, 2), ["parallel.ep=1"], container_image="moe_rl.sqsh")
    job = _submit(cluster, script)
    assert wait_job(cluster["state"], job, 60) == 0, _output(cluster, job)
    calls = _calls(cluster)
    outside = [c["argv"] for c in calls if c["container"] != "moe_rl.sqsh"]
    assert not outside, f"ran outside the container: {outside}"
    subs = [c["argv"][2] for c in calls if c["argv"][:2] == ["-m", "moe_rl.launch.task"]]
    assert {"prepare-model", "wait-healthy", "rank-env"} <= set(subs)
    assert sorted(_ranks(cluster)) == [0, 1]
    _assert_clean(cluster, job)


def test_launch_fake_python_outside_the_container_fails_the_job(cluster, monkeypatch):
    """The check above has teeth: the same job without --container-image cannot start its helpers."""
    monkeypatch.setenv("FAKE_ONLY_IN_CONTAINER", "1")
    script, _ = _render(cluster, TINY, NodeShape(2, 1, 2), ["parallel.ep=1"])
    job = _submit(cluster, script)
    assert wait_job(cluster["state"], job, 60) != 0
    assert "not found outside the container image" in _output(cluster, job)
    assert not _ranks(cluster)
    _assert_clean(cluster, job)


def test_launch_server_that_fails_to_start_fails_the_job_clearly(cluster, monkeypatch):
    monkeypatch.setenv("FAKE_BROKEN_PORT", "30000")
    script, rendered = _render(cluster, TINY, NodeShape(2, 1, 2))
    job = _submit(cluster, script)
    assert wait_job(cluster["state"], job, 60) != 0
    out = _output(cluster, job)
    assert "a server step exited" in out and f"http://{NODES[1]}:30000" in out
    assert str(rendered.run_dir / "logs") in out  # where to look
    log = rendered.run_dir / "logs" / f"job-{job}-0" / f"rollout-{NODES[1]}-0.log"
    assert "fake failure" in log.read_text()
    assert not _ranks(cluster), "the trainer must not start without servers"
    _assert_clean(cluster, job)


def test_launch_preemption_checkpoints_requeues_and_resumes(cluster, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN_SECONDS", "60")
    monkeypatch.setenv("FAKE_STEPS", "3")
    script, rendered = _render(cluster, TINY, NodeShape(2, 1, 2), ["train.steps=3"])
    job = _submit(cluster, script)
    deadline = time.monotonic() + 60
    while "trainer: " not in (_output(cluster, job) if (rendered.run_dir / "logs" / f"slurm-{job}.out").exists()
                              else ""):
        assert time.monotonic() < deadline, "the trainer never started"
        time.sleep(0.2)
    while len(list(cluster["dump"].glob("ready-*-restart-0"))) < 2:  # both ranks handle USR1 now
        assert time.monotonic() < deadline, "the trainer ranks never got ready"
        time.sleep(0.1)
    signal_batch(cluster["state"], job, signal.SIGUSR1)  # as --signal=B:USR1@N before the time limit
    assert wait_job(cluster["state"], job, 90) == 0, _output(cluster, job)
    out = _output(cluster, job)
    assert "USR1: asking the trainer to checkpoint and stop" in out and "requeueing job" in out
    first, second = _ranks(cluster, 0), _ranks(cluster, 1)
    assert sorted(first) == [0, 1] and all(d["stopped"] for d in first.values())
    assert sorted(second) == [0, 1], "the requeued run did not start the trainer"
    assert "train.resume=auto" in second[0]["argv"]
    assert (job_dir(cluster["state"], job) / "run1.rc").read_text() == "0"
    assert "all 3 steps are done" not in out.split("restart 1")[0]
    _assert_clean(cluster, job)


def test_launch_cli_submits_and_prints_the_job_id(cluster, capsys):
    run_dir = cluster["tmp"] / "run"
    code = launch_main(["slurm", "--config", TINY, "--nodes", "2", "--rollout-nodes", "1", "--gpus-per-node", "2",
                        "--run-dir", str(run_dir), "--python", cluster["python"], "--health-timeout", "30",
                        "--stop-timeout", "5", "parallel.ep=1"])
    out = capsys.readouterr().out
    assert code == 0, out
    job = out.split("submitted job ")[1].split()[0]
    script = run_dir / "launch" / "job.sbatch"
    assert str(script) in out and script.is_file()
    frozen = run_dir / "launch" / "config.yaml"
    assert frozen.read_text() == Path(TINY).read_text()
    assert f"CONFIG={frozen}" in script.read_text()
    assert wait_job(cluster["state"], job, 60) == 0, _output(cluster, job)
    assert sorted(_ranks(cluster)) == [0, 1]
    _assert_clean(cluster, job)


REHEARSAL = "launch/configs/rehearsal_cpu.yaml"


@pytest.mark.parametrize("config,nodes,rollout,tasks,cpus,overrides", [
    (REHEARSAL, 2, 1, None, None, ["train.steps=3"]),  # 2 ranks on node 1; 2 workers + the router on node 2
    (TINY, 3, 1, 1, 2, ["parallel.ep=2"]),              # 2 trainer nodes x 1 rank, 2 CPUs each
    (TINY, 2, 0, None, None, []),                       # colocated: 1 rank and 1 server per node
])
def test_launch_cpu_mode_job_places_ranks_without_srun_warnings(cluster, config, nodes, rollout, tasks, cpus,
                                                              overrides):
    """CPU mode under the stand-in srun, which inherits the job's task counts as SLURM 22.05 does:
    every step gets the tasks it states, and srun has nothing to warn about."""
    script, rendered = _render(cluster, config, NodeShape(nodes, rollout, 0, tasks, cpus), overrides)
    job = _submit(cluster, script)
    assert wait_job(cluster["state"], job, 60) == 0, _output(cluster, job)
    out = _output(cluster, job)
    assert "can't honor" not in out and "Warning" not in out, out
    shape = rendered.shape
    ranks = _ranks(cluster)
    expected = expected_ranks(dataclasses.replace(shape, gpus_per_node=shape.ranks_per_node), NODES)
    assert sorted(ranks) == sorted(expected)
    for r, want in expected.items():
        env = ranks[r]["env"]
        assert {k: env[k] for k in want} == want, f"rank {r}"
        assert env["OMP_NUM_THREADS"] == str(cpus or 1) and env["CUDA_VISIBLE_DEVICES"] == ""
    serve_nodes = NODES[:nodes] if rollout == 0 else NODES[nodes - rollout:nodes]
    workers = [f"http://{n}:{p}" for n in serve_nodes for p in rendered.servers.ports]
    argv = ranks[0]["argv"]
    if rendered.servers.use_router:
        assert f"rollout.urls=[http://{serve_nodes[0]}:{rendered.servers.router_port}]" in argv
        assert f"rollout.admin_urls=[{','.join(workers)}]" in argv and "rollout.router=null" in argv
        assert (rendered.run_dir / "logs" / f"job-{job}-0" / f"router-{serve_nodes[0]}.log").is_file()
    else:
        assert f"rollout.urls=[{','.join(workers)}]" in argv
    _assert_clean(cluster, job)
