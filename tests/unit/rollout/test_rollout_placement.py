"""Where the servers a trainer launches on its own machine run (moe_rl/rollout/placement.py), checked
with simulated GPU counts, and the command lines that place them."""
from __future__ import annotations

import pytest

from moe_rl.config import RolloutConfig
from moe_rl.rollout.launcher import plan_servers
from moe_rl.rollout.placement import server_gpus


def _flag(argv, name):
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def test_launched_sglang_servers_start_after_the_trainers_gpus():
    """Trainer rank r is on cuda:r; server i of a local launch gets its own tp GPUs after them."""
    cfg = RolloutConfig(engine="sglang", num_servers=3, tp_size=2, base_port=31000)
    gpus = server_gpus(cfg, trainer_ranks=2, device_count=8)
    assert gpus == [2, 4, 6]
    servers, _ = plan_servers(cfg, "/ckpt", gpus=gpus)
    assert [_flag(list(s.argv), "--base-gpu-id") for s in servers] == ["2", "4", "6"]
    assert all("--enable-memory-saver" not in s.argv for s in servers)


def test_too_few_gpus_for_trainer_and_servers_is_refused_naming_the_fields():
    cfg = RolloutConfig(engine="sglang", num_servers=4, tp_size=2)
    with pytest.raises(ValueError) as e:
        server_gpus(cfg, trainer_ranks=2, device_count=8)  # 2 + 4 x 2 = 10 > 8
    for word in ("rollout.num_servers=4", "rollout.tp_size=2", "need 10 GPU(s)", "has 8", "train.world_size"):
        assert word in str(e.value)
    with pytest.raises(ValueError, match="has 0"):
        server_gpus(RolloutConfig(engine="sglang"), trainer_ranks=1, device_count=0)


def test_colocated_servers_share_the_trainers_gpus_and_can_release_memory():
    for engine in ("sglang", "local"):
        cfg = RolloutConfig(engine=engine, num_servers=2, tp_size=2 if engine == "sglang" else 1, colocated=True,
                            base_port=31000)
        gpus = server_gpus(cfg, trainer_ranks=4, device_count=4)
        assert gpus == ([0, 2] if engine == "sglang" else [0, 1])
        servers, _ = plan_servers(cfg, "/ckpt", gpus=gpus)
        assert all(list(s.argv).count("--enable-memory-saver") == 1 for s in servers)  # release is a no-op without
    with pytest.raises(ValueError, match="need 6 GPU"):
        server_gpus(RolloutConfig(engine="sglang", num_servers=3, tp_size=2, colocated=True), 4, 4)


def test_moe_rl_serve_placement_cpu_wraparound_and_the_nccl_rule():
    local = RolloutConfig(engine="local", num_servers=2, base_port=31000)
    assert server_gpus(local, trainer_ranks=2, device_count=0) == [None, None]  # CPU: serve picks the CPU
    servers, _ = plan_servers(local, "/ckpt", gpus=[None, None])
    assert all("--device" not in s.argv for s in servers)
    assert server_gpus(local, trainer_ranks=2, device_count=4) == [2, 3]
    servers, _ = plan_servers(local, "/ckpt", gpus=[2, 3])
    assert [_flag(list(s.argv), "--device") for s in servers] == ["cuda:2", "cuda:3"]
    assert server_gpus(local, trainer_ranks=1, device_count=1) == [0, 0]  # disk sync: sharing is fine
    nccl = RolloutConfig(engine="local", num_servers=1, weight_sync="nccl")
    with pytest.raises(ValueError, match="trainer rank 0's GPU 0"):
        server_gpus(nccl, trainer_ranks=1, device_count=1)
    assert server_gpus(RolloutConfig(urls=["http://a:1"]), 1, 8) is None  # servers started elsewhere


def test_a_tp_size_in_sglang_args_sizes_the_placement_and_the_update_group():
    cfg = RolloutConfig(engine="sglang", num_servers=2, tp_size=1, sglang_args=["--tp-size", "4"], base_port=31000)
    assert cfg.server_tp_size == 4
    gpus = server_gpus(cfg, trainer_ranks=0, device_count=8)
    assert gpus == [0, 4]
    servers, _ = plan_servers(cfg, "/ckpt", gpus=gpus)
    assert all(list(s.argv).count("--tp-size") == 2 and s.argv[-1] == "4" for s in servers)
    from moe_rl.config import load_config
    from moe_rl.recipes.build import update_group

    run = load_config(None, ["rollout.engine=sglang", "rollout.weight_sync=nccl", "rollout.urls=[http://a:1]",
                             "rollout.sglang_args=[--tp-size=4]", "rollout.weight_sync_port=31999"])
    assert update_group(run, None)["server_tp_sizes"] == 4  # each server joins with 4 ranks


def test_preflight_checks_the_gpu_plan_before_anything_starts():
    from moe_rl.config import load_config
    from moe_rl.train.preflight import _devices

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.num_servers=2", "rollout.tp_size=2",
                             "train.world_size=4"])
    assert "need 8 GPU(s), but this machine has 4" in _devices(cfg, device_count=4)
    assert _devices(cfg, device_count=8) is None
    assert _devices(load_config(None, []), device_count=0) is None  # moe-rl serve on the CPU


@pytest.mark.parametrize("overrides,cores,want", [
    (["algo.max_staleness=2", "train.world_size=1", "parallel.ep=1"], 2, (1, 1)),  # they compute at once
    (["algo.max_staleness=2"], 8, (2, 2)),                                         # 2 ranks + 1 server
    (["algo.max_staleness=0", "train.world_size=1", "parallel.ep=1"], 2, (2, None)),  # in turns
    (["algo.max_staleness=0"], 2, (1, None)),
    (["algo.max_staleness=2", "rollout.urls=[http://elsewhere:30000]"], 2, (1, None)),  # servers elsewhere
    (["algo.max_staleness=2", "rollout.engine=inprocess", "rollout.weight_sync=tensor"], 2, (1, None)),
])
def test_ranks_and_the_servers_they_launch_share_the_cores_when_they_compute_at_once(monkeypatch, overrides, cores,
                                                                                     want):
    import moe_rl.dist.devices as devices
    from moe_rl.config import load_config
    from moe_rl.recipes.build import cpu_threads_of

    monkeypatch.setattr("os.cpu_count", lambda: cores)
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert cpu_threads_of(load_config("launch/configs/tiny_cpu.yaml", overrides)) == want


def test_a_gpu_machine_keeps_the_servers_threads(monkeypatch):
    import moe_rl.dist.devices as devices
    from moe_rl.config import load_config
    from moe_rl.recipes.build import cpu_threads_of

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    assert cpu_threads_of(load_config("launch/configs/tiny_cpu.yaml", ["algo.max_staleness=2"])) == (8, None)
