"""Rollout server launcher: SGLang / router command lines, and real `moe-rl serve` processes."""
from __future__ import annotations

import os
import sys
import time

import pytest

from moe_rl.config import RolloutConfig
from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.launcher import (LauncherError, ServerGroup, ServerSpec, plan_servers, router_command,
                                     sglang_server_command, wants_router)
from moe_rl.rollout.processes import _group_members, port_is_free, tail
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.testing import free_port


def _flag(argv, name):
    """Value after `name` in argv (asserting the flag appears exactly once)."""
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


# ----------------------------------------------------------------------------- command lines

def test_sglang_command_has_parallelism_ports_memory_and_routes():
    argv = sglang_server_command("/models/qwen3-30b-a3b", host="0.0.0.0", port=30001, tp_size=4, ep_size=4,
                                 mem_fraction=0.7, base_gpu_id=4, python="py",
                                 extra_args=["--dtype", "bfloat16", "--max-running-requests", 256])
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert _flag(argv, "--model-path") == "/models/qwen3-30b-a3b"
    assert _flag(argv, "--host") == "0.0.0.0" and _flag(argv, "--port") == "30001"
    assert _flag(argv, "--tp-size") == "4" and _flag(argv, "--ep-size") == "4"
    assert _flag(argv, "--mem-fraction-static") == "0.7"
    assert _flag(argv, "--base-gpu-id") == "4"
    assert "--enable-return-routed-experts" in argv and "--skip-tokenizer-init" in argv
    # user arguments last and verbatim (argparse lets a repeated flag there win)
    assert argv[-4:] == ["--dtype", "bfloat16", "--max-running-requests", "256"]


def test_sglang_command_omits_ep_of_one_and_checks_sizes():
    argv = sglang_server_command("m", host="h", port=1, tp_size=2)
    assert "--ep-size" not in argv and _flag(argv, "--tp-size") == "2"
    with pytest.raises(ValueError, match="ep_size to divide tp_size"):
        sglang_server_command("m", host="h", port=1, tp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="mem_fraction"):
        sglang_server_command("m", host="h", port=1, mem_fraction=1.5)


def test_router_command():
    argv = router_command(["http://a:1", "http://b:2"], host="0.0.0.0", port=9000, python="py",
                          extra_args=["--policy", "round_robin"])
    assert argv == ["py", "-m", "sglang_router.launch_router", "--host", "0.0.0.0", "--port", "9000",
                    "--worker-urls", "http://a:1", "http://b:2", "--policy", "round_robin"]
    argv = router_command(["http://a:1"], host="10.0.0.5", port=9000, prometheus_port=9001, python="py")
    assert _flag(argv, "--prometheus-port") == "9001" and _flag(argv, "--prometheus-host") == "10.0.0.5"
    with pytest.raises(ValueError):
        router_command([], host="h", port=1)


def test_plan_sglang_servers_from_config():
    cfg = RolloutConfig(engine="sglang", num_servers=3, host="0.0.0.0", base_port=31000,
                        sglang_args=["--dtype", "bfloat16"], mem_fraction=0.6)
    servers, router = plan_servers(cfg, "/ckpt", tp_size=2, ep_size=2, python="py")
    assert [s.port for s in servers] == [31000, 31001, 31002]
    assert [s.url for s in servers] == [f"http://127.0.0.1:{p}" for p in (31000, 31001, 31002)]
    for i, s in enumerate(servers):
        # log-probs of the tempered distribution, SGLang's default, are what the trainer recomputes
        assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in s.env
        assert _flag(list(s.argv), "--port") == str(31000 + i)
        assert _flag(list(s.argv), "--base-gpu-id") == str(2 * i)  # disjoint GPUs per server
        assert _flag(list(s.argv), "--tp-size") == "2" and _flag(list(s.argv), "--ep-size") == "2"
        assert _flag(list(s.argv), "--mem-fraction-static") == "0.6"
        assert list(s.argv[-2:]) == ["--dtype", "bfloat16"]
    assert router is not None and router.port == 31003
    assert _flag(list(router.argv), "--prometheus-port") == "31004"  # never the shared default 29000
    assert router.health_path == "/readiness"  # its /health answers before any worker is registered
    assert list(router.argv[router.argv.index("--worker-urls") + 1:]) == [s.url for s in servers]
    group = ServerGroup(servers, "/tmp/unused", router=router)
    assert group.urls == ["http://127.0.0.1:31003"] and group.admin_urls == [s.url for s in servers]


def test_plan_single_sglang_server_has_no_router_and_local_has_no_sglang_env():
    servers, router = plan_servers(RolloutConfig(engine="sglang", num_servers=1), "/ckpt")
    assert router is None and len(servers) == 1
    servers, router = plan_servers(RolloutConfig(engine="local", num_servers=2, base_port=40000), "/ckpt")
    assert router is None
    assert list(servers[1].argv[1:]) == ["-m", "moe_rl.cli", "serve", "--model-path", "/ckpt", "--host", "127.0.0.1",
                                         "--port", "40001", "--enable-return-routed-experts"]
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in servers[0].env
    with pytest.raises(ValueError, match="already run"):
        plan_servers(RolloutConfig(urls=["http://gpu-node:30000"]), "/ckpt")


@pytest.mark.parametrize("engine", ["local", "sglang"])
@pytest.mark.parametrize("inflight, disabled", [("in_place", True), ("retract", False), ("wait", False),
                                                ("auto", False)])
def test_servers_of_an_in_place_run_keep_no_prefix_cache(engine, inflight, disabled):
    # an in-place push asks for no cache flush (SGLang refuses it under paused requests), so a cached prefix
    # would keep the KV and routes of the weights that computed it for the rest of the run
    cfg = RolloutConfig(engine=engine, num_servers=2, base_port=42000, inflight_update=inflight)
    servers, _ = plan_servers(cfg, "/ckpt", python="py")
    for s in servers:
        assert list(s.argv).count("--disable-radix-cache") == int(disabled)
    cfg.sglang_args = ["--disable-radix-cache"]  # given by the user too: once on the command line
    if engine == "sglang":
        assert list(plan_servers(cfg, "/ckpt", python="py")[0][0].argv).count("--disable-radix-cache") == 1


@pytest.mark.parametrize("engine, n, choice, expected", [
    ("sglang", 1, None, False), ("sglang", 2, None, True), ("local", 2, None, False),
    ("local", 1, True, True), ("local", 2, True, True), ("sglang", 2, False, False), ("sglang", 1, True, True),
])
def test_router_in_front_when_asked_or_for_several_sglang_servers(engine, n, choice, expected):
    cfg = RolloutConfig(engine=engine, num_servers=n, base_port=41000)
    cfg.router = choice
    assert wants_router(cfg) is expected
    servers, router = plan_servers(cfg, "/ckpt", python="py")
    assert (router is not None) is expected
    if router is not None:  # in front of exactly these servers, on the port after them
        assert router.port == 41000 + n
        assert list(router.argv[router.argv.index("--worker-urls") + 1:]) == [s.url for s in servers]


def test_router_choice_must_be_a_bool_or_auto():
    cfg = RolloutConfig(engine="local", num_servers=2)
    cfg.router = "yes"
    with pytest.raises(ValueError, match="rollout.router must be true, false or null"):
        plan_servers(cfg, "/ckpt")


# ----------------------------------------------------------------------------- real processes

def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_two_local_servers_start_serve_and_stop(tiny_hf_dir, tmp_path):
    cfg = RolloutConfig(engine="local", num_servers=2, base_port=free_port())
    for _ in range(20):  # two consecutive free ports
        if all(port_is_free(cfg.host, cfg.base_port + i) for i in range(2)):
            break
        cfg.base_port = free_port()
    group = ServerGroup.from_config(cfg, tiny_hf_dir, tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    with group:
        group.wait_healthy(timeout=60)
        pids = list(group.pids.values())
        assert len(pids) == 2 and all(group.alive().values())
        with SGLangClient(group.urls, admin_urls=group.admin_urls) as client:
            assert client.health()
            req = GenerateRequest([1, 5, 9], SamplingParams(max_new_tokens=3, seed=0, n=2))
            (samples,) = client.generate([req])
            assert len(samples) == 2 and all(len(s.output_ids) == 3 for s in samples)
            assert samples[0].routed_experts.shape == (3 + 3 - 1, 4, 2)
            assert {s.server for s in samples} <= set(group.urls)
        with pytest.raises(LauncherError, match="already in use"):  # same ports again
            ServerGroup.from_config(cfg, tiny_hf_dir, tmp_path / "logs2").start()
    assert group.pids == {}
    for pid in pids:
        assert _gone(pid) and not _group_members(pid), f"process group {pid} outlived stop()"
    assert (tmp_path / "logs" / "server-0.log").read_text().startswith("$ ")


def test_failing_server_reports_its_log(tmp_path):
    port = free_port()
    bad = ServerSpec("broken", (sys.executable, "-c", "import sys; print('boom: no model here'); sys.exit(3)"),
                     "127.0.0.1", port)
    group = ServerGroup([bad], tmp_path)
    group.start()
    t0 = time.monotonic()
    with pytest.raises(LauncherError) as err:
        group.wait_healthy(timeout=60)
    assert time.monotonic() - t0 < 10  # failed early, not at the timeout
    msg = str(err.value)
    log_path = tmp_path / "broken.log"
    assert str(log_path) in msg and "exited with code 3" in msg and "boom: no model here" in msg
    assert "boom" in tail(log_path)
    assert group.pids == {}  # stopped on failure


def test_hanging_server_times_out_and_is_killed(tmp_path):
    # ignores SIGTERM: stop() must fall back to SIGKILL; also spawns a child that must die with it
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('loading forever', flush=True); time.sleep(60)")
    spec = ServerSpec("hang", (sys.executable, "-c", code), "127.0.0.1", free_port())
    group = ServerGroup([spec], tmp_path, stop_timeout=1.0)
    group.start()
    pid = group.pids["hang"]
    with pytest.raises(LauncherError, match="not healthy after 1.5 s") as err:
        group.wait_healthy(timeout=1.5, interval=0.2)
    assert "loading forever" in str(err.value)
    assert _gone(pid) and not _group_members(pid)


def test_servers_die_with_a_trainer_killed_by_sigkill(tmp_path):
    """kill -9 of the process that launched a server (rank 0) must not leave the server holding its port."""
    import signal
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import sys, time
        from moe_rl.rollout.launcher import ServerGroup, ServerSpec
        spec = ServerSpec("sleeper", (sys.executable, "-c", "import time; time.sleep(600)"), "127.0.0.1", {free_port()})
        group = ServerGroup([spec], {str(tmp_path)!r}).start()
        print(group.pids["sleeper"], flush=True)
        time.sleep(600)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server = int(trainer.stdout.readline())
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(server):
        time.sleep(0.1)
    assert not _alive(server), "the server outlived its trainer"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting to be reaped counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def test_unset_base_port_takes_consecutive_free_ports():
    servers, router = plan_servers(RolloutConfig(engine="local", num_servers=2, router=True), "/ckpt")
    ports = [s.port for s in servers] + [router.port]
    assert ports == list(range(ports[0], ports[0] + 3)) and 20000 <= ports[0] < 32000  # below the ephemeral range
    assert _flag(list(router.argv), "--prometheus-port") == str(ports[0] + 3)
