"""Drift alarms (`drift.alarm`): thresholds, the once-per-metric warning, the stop error, the config rules."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.drift.alarm import EXIT_DRIFT_ALARM, HEALTH_ALARMS, Alarms, DriftAlarm, worst_layer
from moe_rl.drift.config import AlarmConfig

DEMO = Path(__file__).resolve().parents[3] / "launch" / "configs" / "tiny_cpu.yaml"


def _metrics(volatility=0.05, margin=1.0, k3=1e-4, vio=0.5, mismatch=0.01):
    return {"drift/volatility": volatility, "drift/volatility/layer_01": volatility / 2,
            "drift/volatility/layer_03": volatility * 1.5, "drift/volatility/exact_match": 0.99,
            "drift/route_margin": margin, "drift/route_margin/layer_01": margin * 2,
            "drift/route_margin/layer_03": margin / 2, "drift/logp_k3": k3, "drift/load_max_vio": vio,
            "drift/rollout_mismatch": mismatch}


def test_no_threshold_set_logs_nothing():
    alarms = Alarms(AlarmConfig())
    assert not alarms.active
    assert alarms.check(1, _metrics(volatility=1.0)) == {}
    alarms.enforce()  # nothing fired, nothing raised


def test_ceilings_fire_strictly_above_and_the_floor_strictly_below():
    cfg = AlarmConfig(volatility=0.1, rollout_mismatch=0.2, logp_k3=1e-3, load_max_vio=1.0, route_margin=0.5)
    alarms = Alarms(cfg)
    assert alarms.check(1, _metrics()) == {HEALTH_ALARMS: 0.0}
    at_threshold = _metrics(volatility=0.1, mismatch=0.2, k3=1e-3, vio=1.0, margin=0.5)
    assert alarms.check(2, at_threshold) == {HEALTH_ALARMS: 0.0}
    past = _metrics(volatility=0.11, mismatch=0.21, k3=2e-3, vio=1.5, margin=0.4)
    assert alarms.check(3, past) == {HEALTH_ALARMS: 5.0}
    assert {f.name for f in alarms.fired} == set(cfg.thresholds())
    assert alarms.check(4, _metrics(margin=0.49)) == {HEALTH_ALARMS: 1.0}
    assert [(f.key, f.side) for f in alarms.fired] == [("drift/route_margin", "below")]


def test_unmeasured_or_nan_metrics_fire_nothing():
    """A step that did not measure drift (drift.every) has no key; a step without tokens has NaN."""
    alarms = Alarms(AlarmConfig(volatility=0.1, route_margin=0.5))
    assert alarms.check(1, {"reward/mean": 0.3}) == {HEALTH_ALARMS: 0.0}
    assert alarms.check(2, {"drift/volatility": math.nan, "drift/route_margin": math.nan}) == {HEALTH_ALARMS: 0.0}


def test_worst_layer_is_the_largest_for_a_ceiling_and_the_smallest_for_a_floor():
    m = _metrics(volatility=0.2, margin=0.2)
    assert worst_layer(m, "drift/volatility", "above") == (3, pytest.approx(0.3))
    assert worst_layer(m, "drift/route_margin", "below") == (3, pytest.approx(0.1))
    # drift/volatility/exact_match is not a layer; a metric without per-layer keys has no worst layer
    assert worst_layer(m, "drift/logp_k3", "above") == (None, None)


def test_warn_logs_once_per_metric_with_layer_and_step(caplog):
    alarms = Alarms(AlarmConfig(volatility=0.1, logp_k3=1e-3))
    with caplog.at_level(logging.WARNING, logger="moe_rl"):
        alarms.check(5, _metrics(volatility=0.2))
        alarms.check(6, _metrics(volatility=0.3))               # same metric again: counted, not logged
        out = alarms.check(7, _metrics(volatility=0.3, k3=0.01))  # a second metric: logged once
        alarms.enforce()                                          # warn never stops
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "drift/volatility = 0.2 is above drift.alarm.volatility = 0.1 at step 5, worst layer 03 (0.3)" \
        in warnings[0]
    assert "drift/logp_k3 = 0.01 is above drift.alarm.logp_k3 = 0.001 at step 7" in warnings[1]
    assert out == {HEALTH_ALARMS: 2.0}
    caplog.clear()
    other_rank = Alarms(AlarmConfig(volatility=0.1), rank=1)
    with caplog.at_level(logging.WARNING, logger="moe_rl"):
        assert other_rank.check(5, _metrics(volatility=0.2)) == {HEALTH_ALARMS: 1.0}  # counted, said by rank 0 only
    assert not caplog.records


def test_stop_raises_the_named_error_with_the_metric():
    alarms = Alarms(AlarmConfig(route_margin=0.5, action="stop"))
    alarms.check(3, _metrics(margin=0.6))
    alarms.enforce()  # not crossed: goes on
    assert alarms.check(4, _metrics(margin=0.3)) == {HEALTH_ALARMS: 1.0}
    with pytest.raises(DriftAlarm, match=r"drift/route_margin = 0.3 is below drift.alarm.route_margin = 0.5 "
                                         r"at step 4, worst layer 03 \(0.15\)") as e:
        alarms.enforce()
    assert e.value.step == 4 and e.value.fired[0].key == "drift/route_margin"
    assert EXIT_DRIFT_ALARM == 4


def test_alarm_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"drift.alarm.action: 'halt' is not one of warn, stop"):
        load_config(str(DEMO), ["drift.alarm.action=halt"])
    with pytest.raises(ConfigError, match=r"drift.alarm.volatility: 1.5 must be in \[0.0, 1.0\]"):
        load_config(str(DEMO), ["drift.alarm.volatility=1.5"])
    with pytest.raises(ConfigError, match=r"drift.alarm.route_margin: -1.0 must be >= 0.0"):
        load_config(str(DEMO), ["drift.alarm.route_margin=-1"])
    with pytest.raises(ConfigError, match=r"drift.alarm.load_max_vio is set, but drift.enabled=false.*"
                                          r"set drift.enabled=true"):
        load_config(str(DEMO), ["drift.alarm.load_max_vio=2", "drift.enabled=false"])
    with pytest.raises(ConfigError, match=r"drift.alarm.volatility is set, but drift.step_tokens=false"):
        load_config(str(DEMO), ["drift.alarm.volatility=0.2", "drift.step_tokens=false"])
    with pytest.raises(ConfigError, match=r"drift.alarm.rollout_mismatch is set, but "
                                          r"rollout.return_routed_experts=false"):
        load_config(str(DEMO), ["drift.alarm.rollout_mismatch=0.2", "rollout.return_routed_experts=false"])
    cfg = load_config(str(DEMO), ["drift.alarm.volatility=0.2", "drift.alarm.action=stop"])
    assert cfg.drift.alarm.thresholds() == {"volatility": 0.2} and cfg.drift.alarm.action == "stop"
    assert load_config(str(DEMO)).drift.alarm.thresholds() == {}  # off by default


# ---------------------------------------------------------------- the collapse alarm

def _step(success=0.3, grad=0.5, entropy=None):
    """A step's metrics; without `entropy` the engine gave no log-probs (the gradient alone decides)."""
    return {"reward/success_rate": success, "perf/grad_norm": grad} | (
        {} if entropy is None else {"rollout/entropy": entropy})


def test_collapse_alarm_is_on_by_default_in_asynchronous_runs_only():
    assert not Alarms(AlarmConfig()).active                                  # on-policy: off
    assert Alarms(AlarmConfig(), asynchronous=True).window == 8              # algo.max_staleness >= 1: on
    assert not Alarms(AlarmConfig(collapse_steps=0), asynchronous=True).active  # 0 = off
    assert Alarms(AlarmConfig(collapse_steps=4)).window == 4                 # asked for: on either way
    cfg = load_config(str(DEMO), ["drift.alarm.collapse_steps=6", "drift.alarm.collapse_entropy=0.1"])
    assert (cfg.drift.alarm.collapse_steps, cfg.drift.alarm.collapse_entropy) == (6, 0.1)
    with pytest.raises(ConfigError, match=r"drift.alarm.collapse_steps: -1 must be >= 0"):
        load_config(str(DEMO), ["drift.alarm.collapse_steps=-1"])


def test_collapse_fires_when_half_of_a_full_window_stalled():
    alarms = Alarms(AlarmConfig(collapse_steps=8))
    for step in range(1, 5):  # 4 stalled steps, but the window is not full yet
        assert alarms.check(step, _step(grad=0.0)) == {HEALTH_ALARMS: 0.0, "health/stalled_steps": float(step)}
    for step in range(5, 8):  # learning again: 4 of 7
        assert alarms.check(step, _step())[HEALTH_ALARMS] == 0.0
    assert alarms.check(8, _step()) == {HEALTH_ALARMS: 1.0, "health/stalled_steps": 4.0}  # 4 of the last 8
    assert "collapse: 4 of the last 8 steps stalled below 0.8 success" in alarms.fired[0].describe()
    assert alarms.check(9, _step()) == {HEALTH_ALARMS: 0.0, "health/stalled_steps": 3.0}  # step 1 left the window


def test_a_stalled_step_is_below_the_success_bar_with_no_gradient_or_no_entropy():
    def stalled(**kw):
        alarms = Alarms(AlarmConfig(collapse_steps=1))
        return alarms.check(1, _step(**kw))["health/stalled_steps"] == 1.0
    assert stalled(grad=0.0)
    assert stalled(entropy=0.01)                     # one answer sampled, though a gradient flows
    assert not stalled()                             # learning
    assert not stalled(grad=0.0, success=0.85)       # learned: uniform groups of right answers, a few wrong
    assert not stalled(entropy=0.05)                 # at the floor, not below it
    explore = Alarms(AlarmConfig(collapse_steps=3))
    got = [explore.check(step, _step(grad=0.0, entropy=h))["health/stalled_steps"]
           for step, h in enumerate([2.7, 1.4, 1.3], 1)]
    assert got == [0.0, 0.0, 1.0]  # no gradient while it explores (>= half its first entropy): not found yet
    alarms = Alarms(AlarmConfig(collapse_steps=1))
    assert alarms.check(1, {"loss/dpo": 0.5}) == {HEALTH_ALARMS: 0.0, "health/stalled_steps": 0.0}  # not an RL step


def test_collapse_with_action_stop_raises_naming_it():
    alarms = Alarms(AlarmConfig(collapse_steps=2, action="stop"))
    alarms.check(1, _step(grad=0.0))
    with pytest.raises(DriftAlarm, match=r"collapse: 1 of the last 2 steps stalled below 0.8 success .* at step 2"):
        alarms.check(2, _step())
        alarms.enforce()


def test_a_learned_run_dipping_below_the_bar_stays_quiet():
    """Single stalled steps below the bar in a window whose mean success is above it do not fire; the
    bar is drift.alarm.collapse_success."""
    alarms = Alarms(AlarmConfig(collapse_steps=4))
    for step, success in enumerate([0.95, 0.7, 0.95, 0.7], 1):  # 2 of 4 stalled, mean 0.825
        assert alarms.check(step, _step(success=success, grad=0.0))[HEALTH_ALARMS] == 0.0
    strict = Alarms(AlarmConfig(collapse_steps=4, collapse_success=0.99))
    fired = [strict.check(step, _step(success=s, grad=0.0))[HEALTH_ALARMS]
             for step, s in enumerate([0.95, 0.7, 0.95, 0.7], 1)]
    assert fired == [0.0, 0.0, 0.0, 1.0]
