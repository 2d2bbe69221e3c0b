"""The commands a rendered job runs on its nodes (moe_rl.launch.task)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_rl.dist.ports import free_port
from moe_rl.launch.task import (NOT_FINISHED, TaskError, main, prepare_model, rank_env, tasks_on_node,
                                wait_healthy)

SRUN_TASK = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
             "SLURM_TASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "gpu001", "MASTER_PORT": "21234"}


@pytest.mark.parametrize("text,node,count", [("8(x4)", 3, 8), ("2(x2),1", 2, 1), ("2(x2),1", 1, 2), ("4", 0, 4),
                                             ("3,2", 1, 2)])
def test_launch_tasks_on_node(text, node, count):
    assert tasks_on_node(text, node) == count


def test_launch_tasks_on_node_rejects_garbage():
    with pytest.raises(TaskError, match="cannot parse"):
        tasks_on_node("4(y2)", 0)
    with pytest.raises(TaskError, match="outside"):
        tasks_on_node("4(x2)", 2)


def test_launch_rank_env_from_srun_variables():
    assert rank_env(SRUN_TASK) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                   "NODE_RANK": "1", "GROUP_RANK": "1", "MASTER_ADDR": "gpu001",
                                   "MASTER_PORT": "21234"}


@pytest.mark.parametrize("missing,message", [("SLURM_PROCID", "runs under srun"), ("MASTER_ADDR", "MASTER_ADDR is not set"),
                                             ("MASTER_PORT", "MASTER_PORT is not set")])
def test_launch_rank_env_names_what_is_missing(missing, message):
    env = {k: v for k, v in SRUN_TASK.items() if k != missing}
    with pytest.raises(TaskError, match=message):
        rank_env(env)


def test_launch_rank_env_execs_the_command_with_the_variables():
    code = "import json, os; print(json.dumps({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')}))"
    res = subprocess.run([sys.executable, "-m", "moe_rl.launch.task", "rank-env", "--", sys.executable, "-c", code],
                         env={**os.environ, **SRUN_TASK}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}


def test_launch_rank_env_outside_srun_fails_clearly():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    res = subprocess.run([sys.executable, "-m", "moe_rl.launch.task", "rank-env", "--", "true"], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 1 and "rank-env runs under srun" in res.stderr


@pytest.fixture
def health_server():
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_launch_wait_healthy_returns_when_every_server_answers(health_server):
    said = []
    wait_healthy([health_server, health_server + "/"], timeout=5, say=said.append)
    assert said and "healthy" in said[-1]


def test_launch_wait_healthy_polls_the_given_path(health_server):
    # sglang-router answers /health before it has a worker: the job waits on its /readiness
    with pytest.raises(TaskError) as e:
        wait_healthy([health_server], timeout=0.3, interval=0.1, say=lambda s: None, path="/readiness")
    assert "not healthy after 0.3 s" in str(e.value)
    assert main(["wait-healthy", "--path", "/health", "--timeout", "5", health_server]) == 0


def test_launch_wait_healthy_times_out_naming_the_missing_server(health_server):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TaskError) as e:
        wait_healthy([health_server, dead], timeout=0.5, interval=0.1, log_hint="/logs/job-1-0", say=lambda s: None)
    assert f"not healthy after 0.5 s: {dead}" in str(e.value) and "logs: /logs/job-1-0" in str(e.value)
    assert health_server not in str(e.value)


def test_launch_wait_healthy_fails_fast_when_a_watched_step_dies():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TaskError, match=f"pid {proc.pid}"):
        wait_healthy([dead], timeout=60, watch=[proc.pid], interval=0.1, say=lambda s: None)


def _checkpoint(run_dir, step, complete=True):
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    if complete:
        (path / "meta.json").write_text(json.dumps({"step": step, "world_size": 2}))


def test_launch_finished_reads_complete_checkpoints_only(tmp_path, capsys):
    assert main(["finished", "--run-dir", str(tmp_path), "--steps", "3"]) == NOT_FINISHED
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 3, complete=False)  # a save cut short by the time limit
    assert main(["finished", "--run-dir", str(tmp_path), "--steps", "3"]) == NOT_FINISHED
    assert "step 2 of 3" in capsys.readouterr().out
    _checkpoint(tmp_path / "b", 3)
    assert main(["finished", "--run-dir", str(tmp_path / "b"), "--steps", "3"]) == 0


def test_launch_prepare_model_uses_hf_path_or_writes_the_fresh_model(tmp_path):
    from moe_rl.config import load_config

    assert str(prepare_model("launch/configs/qwen3_30b_a3b_gspo.yaml", [], str(tmp_path))) == \
        "/checkpoints/Qwen3-30B-A3B"
    assert not any(tmp_path.iterdir())
    path = prepare_model("launch/configs/tiny_cpu.yaml", ["model.tiny.vocab_size=16"], str(tmp_path))
    assert path == tmp_path / "init_model" and (path / "config.json").is_file()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == load_config("launch/configs/tiny_cpu.yaml", ["model.tiny.vocab_size=16"]
                                            ).model.tiny.vocab_size
