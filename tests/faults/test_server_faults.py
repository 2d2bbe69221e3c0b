"""A rollout server killed mid-step, or replaced by a stranger on its port: the supervised group
restarts it, the client loses no sample, the restarted server gets the current weights before it
serves, and a server that is not the run's is never used nor sent weights."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from moe_rl.config import RolloutConfig
from moe_rl.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from moe_rl.rollout.launcher import RunIdentity, ServerGroup
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.testing.serve import start_serve_process, stop_process

ENV = {"OMP_NUM_THREADS": "1"}


def _info(url: str, path: str = "/model_info") -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as resp:
        return json.loads(resp.read())


def _group(tiny_hf_dir, tmp_path, n: int, max_restarts: int = 3) -> tuple[ServerGroup, RunIdentity]:
    ident = RunIdentity.for_run(tmp_path / "run", "127.0.0.1", trusted_dirs=[tiny_hf_dir.parent])
    cfg = RolloutConfig(engine="local", num_servers=n, max_restarts=max_restarts)
    return ServerGroup.from_config(cfg, tiny_hf_dir, tmp_path / "logs", env=ENV, identity=ident), ident


@pytest.mark.parametrize("n", [1, 2])
def test_server_killed_mid_step_is_restarted_and_no_sample_is_lost(tiny_hf_dir, tmp_path, n):
    group, ident = _group(tiny_hf_dir, tmp_path, n)
    reqs = [GenerateRequest([1 + i, 2, 3], SamplingParams(max_new_tokens=48, seed=i, n=4)) for i in range(8)]
    with group:
        group.wait_healthy(timeout=120)
        group.watch(interval=0.2)
        with SGLangClient(group.urls, served_name=ident.run_id, no_server_timeout=120, probe_interval=0.5,
                          max_attempts=6, backoff_base=0.2) as client:
            client.update_weights_from_disk(tiny_hf_dir, "v7")  # the restarted server must get these
            out: list = []
            worker = threading.Thread(target=lambda: out.append(client.generate(reqs)))
            worker.start()
            victim = group.urls[0]
            deadline = time.monotonic() + 60
            while client.server_states()[victim]["inflight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            old_pid = group.pids["server-0"]
            os.kill(old_pid, signal.SIGKILL)  # only the process this test's group started
            worker.join(240)
            assert out, "generate did not return"
            results = out[0]
            assert [len(r) for r in results] == [4] * 8  # every sample came back
            assert all(len(s.output_ids) == 48 or s.finish_reason == "stop" for r in results for s in r)
            assert all(s.finish_reason != "abort" for r in results for s in r)
            deadline = time.monotonic() + 120  # the supervisor restarted it; a probe updated its weights
            while time.monotonic() < deadline:
                if group.restarts.get("server-0") and client.server_states()[victim]["healthy"]:
                    break
                client.health()
                time.sleep(0.5)
            assert group.restarts == {"server-0": 1} and group.pids["server-0"] != old_pid
            if n == 1:  # the only server: the step's samples came from the restarted one
                assert {s.weight_version for r in results for s in r} == {"v7"}
            assert _info(victim)["weight_version"] == "v7"


def test_stranger_on_a_dead_servers_port_is_refused(tiny_hf_dir, tmp_path):
    group, ident = _group(tiny_hf_dir, tmp_path, 1, max_restarts=0)
    req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2, seed=0))
    stranger = None
    with group:
        group.wait_healthy(timeout=120)
        port = group.servers[0].port
        with SGLangClient(group.urls, served_name=ident.run_id, no_server_timeout=8, probe_interval=0.5,
                          max_attempts=2, backoff_base=0.1) as client:
            assert len(client.generate([req])[0]) == 1
            pid = group.pids["server-0"]
            os.kill(pid, signal.SIGKILL)
            group._running[0].proc.wait(10)
            try:  # another run's server (another model name) takes the port
                stranger = start_serve_process(tiny_hf_dir, "--served-model-name", "someone-else", port=port)
                with pytest.raises(RolloutError, match="not this run's"):
                    client.generate([req])
                with pytest.raises(RolloutError):
                    client.update_weights_from_disk(tiny_hf_dir, "v9")
                assert _info(stranger.url)["weight_version"] == "default"  # nothing pushed into it
            finally:
                if stranger is not None:
                    stop_process(stranger.proc)
