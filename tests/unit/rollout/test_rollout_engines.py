"""The engine table (moe_rl/rollout/engines.py) is what the config, the weight-sync factory and
the launchers go by: its weight syncs are exactly the ones a config may combine with the engine."""
from __future__ import annotations

import pytest

from moe_rl.config import ENGINES, WEIGHT_SYNCS, ConfigError, load_config
from moe_rl.rollout.engines import ENGINE_KINDS, WEIGHT_SYNC_KINDS, engine_kind, weight_sync_kind
from moe_rl.rollout.launcher import SERVER_COMMANDS, plan_servers


def test_the_config_allows_the_engines_and_weight_syncs_of_the_table():
    assert ENGINES == tuple(ENGINE_KINDS) and WEIGHT_SYNCS == tuple(WEIGHT_SYNC_KINDS)


@pytest.mark.parametrize("sync", ["disk", "nccl"])  # the syncs that reach servers
@pytest.mark.parametrize("extra, refused", [("rollout.colocated=true", "not allowed with rollout.colocated=true"),
                                            ("rollout.sglang_args=[--dp-size,2]", "--dp-size 2 is not allowed"),
                                            ("rollout.sglang_args=[--pp-size,2]", "--pp-size 2 is not allowed")])
def test_the_update_group_rules_follow_the_weight_sync_kind(sync, extra, refused):
    # a sync that joins one process group with the servers is refused colocated and with dp / pp replicas
    assert WEIGHT_SYNC_KINDS[sync].update_group == (sync == "nccl")
    overrides = ["rollout.engine=sglang", f"rollout.weight_sync={sync}", extra]
    if WEIGHT_SYNC_KINDS[sync].update_group:
        with pytest.raises(ConfigError, match=refused):
            load_config(None, overrides)
    else:
        assert weight_sync_kind(load_config(None, overrides).rollout).name == sync


@pytest.mark.parametrize("engine", list(ENGINE_KINDS))
@pytest.mark.parametrize("sync", WEIGHT_SYNCS)
def test_a_config_combines_an_engine_with_exactly_its_weight_syncs(engine, sync):
    overrides = [f"rollout.engine={engine}", f"rollout.weight_sync={sync}"]
    if sync in ENGINE_KINDS[engine].weight_syncs:
        assert load_config(None, overrides).rollout.weight_sync == sync
    else:
        with pytest.raises(ConfigError, match=f"rollout.weight_sync: '{sync}'"):
            load_config(None, overrides)


def test_every_server_engine_has_a_command_and_the_others_launch_nothing(tmp_path):
    assert set(SERVER_COMMANDS) == {k for k, kind in ENGINE_KINDS.items() if kind.runs_as_servers}
    cfg = load_config(None, ["rollout.engine=inprocess", "rollout.weight_sync=tensor"]).rollout
    with pytest.raises(ValueError, match="rollout.engine=inprocess runs as the local engine inside trainer rank 0"):
        plan_servers(cfg, tmp_path)


def test_an_unknown_engine_names_the_known_ones():
    class Rollout:
        engine = "vllm"

    with pytest.raises(ValueError, match="rollout.engine must be one of local, sglang, inprocess, got 'vllm'"):
        engine_kind(Rollout())
