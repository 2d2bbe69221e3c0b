"""The `drift` section of the run config: what expert-activation volatility is measured, how often,
and the alarms that act on it (`drift.alarm`, moe_rl/drift/alarm.py).

The `check_*(cfg)` rules take the whole `RunConfig` (`moe_rl.config`, which imports this
module: hence `Any`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from moe_rl.configurable import choice, ranged

ALARM_ACTIONS = ("warn", "stop")

# The alarm thresholds: field of `drift.alarm` -> (metric key, whether it fires above or below the
# value). All are measured on the step's own tokens (`step_drift` in moe_rl/recipes/rl/drift_views.py).
ALARM_METRICS: dict[str, tuple[str, str]] = {
    "volatility": ("drift/volatility", "above"),
    "rollout_mismatch": ("drift/rollout_mismatch", "above"),
    "logp_k3": ("drift/logp_k3", "above"),
    "load_max_vio": ("drift/load_max_vio", "above"),
    "route_margin": ("drift/route_margin", "below"),
}

COLLAPSE_DEFAULT_STEPS = 8  # the collapse alarm's window in asynchronous runs
COLLAPSE_GRAD = 1e-8        # a stalled step's gradient norm is at most this (perf/grad_norm: 0.0 when nothing trains)


@dataclass
class AlarmConfig:
    """Thresholds on the drift metrics of each step and what to do when one is crossed; all unset = off."""

    volatility: float | None = ranged(None, ge=0.0, le=1.0)
    """Fire when `drift/volatility` (share of top-k experts that changed across the step's updates)
    exceeds this; None = no alarm. Off by default: what is normal depends on the model and the step size."""
    rollout_mismatch: float | None = ranged(None, ge=0.0, le=1.0)
    """Fire when `drift/rollout_mismatch` (share of top-k experts the engine and the trainer chose
    differently) exceeds this; None = no alarm. Needs rollout.return_routed_experts=true."""
    logp_k3: float | None = ranged(None, ge=0.0)
    """Fire when `drift/logp_k3` (k3 estimate of KL(rollout || trainer) on the response tokens) exceeds
    this; None = no alarm. A growing train-inference gap is the usual sign before an MoE run collapses."""
    load_max_vio: float | None = ranged(None, ge=0.0)
    """Fire when `drift/load_max_vio` (max over layers of the busiest expert's load / mean load - 1;
    0 = balanced, E - 1 = one expert takes every token) exceeds this; None = no alarm."""
    route_margin: float | None = ranged(None, ge=0.0)
    """Fire when `drift/route_margin` (mean gap between the k-th and (k+1)-th router logit) falls
    below this floor: routers that cannot tell their experts apart flip routes; None = no alarm."""
    collapse_steps: int | None = ranged(None, ge=0)
    """The collapse alarm: fire when, over the last N steps, the mean success rate is below
    collapse_success and at least half of the steps stalled below it: a sampling policy whose entropy
    (`rollout/entropy`) fell below collapse_entropy, or no gradient (`perf/grad_norm` ~ 0: every group
    uniform, or every token carrying an advantage clipped) from a policy whose entropy is under half
    its first step's (no gradient while it still explores is a task not found yet): a policy that
    stopped learning before it learned the task. None = 8 in asynchronous runs (algo.max_staleness
    >= 1), where stale samples can stall it, and off otherwise; 0 = off. `health/stalled_steps`
    counts the stalled steps of the window."""
    collapse_entropy: float = ranged(0.05, ge=0.0)
    """The collapse alarm's entropy floor, in nats per sampled token."""
    collapse_success: float = ranged(0.8, gt=0.0, le=1.0)
    """The collapse alarm's success rate (reward/success_rate): below it a run that stopped learning has
    not learned its task. A learned policy turns deterministic too (uniform groups of right answers, a
    few prompts always wrong: 0.85-0.95 on the toy tasks with no gradient), hence not 1."""
    action: str = choice("warn", ALARM_ACTIONS)
    """What a crossed threshold does, for every alarm: warn = log it once per metric with the worst
    layer and the step, and go on; stop = checkpoint the step and exit with status 4 naming the metric.
    Either way `health/alarms` counts the alarms of each step and the report marks them."""

    def collapse_window(self, asynchronous: bool) -> int:
        """N of the collapse alarm for this run (0: off): collapse_steps, or its default."""
        if self.collapse_steps is None:
            return COLLAPSE_DEFAULT_STEPS if asynchronous else 0
        return int(self.collapse_steps)

    def thresholds(self) -> dict[str, float]:
        """The alarms that are set: field name -> threshold."""
        return {name: getattr(self, name) for name in ALARM_METRICS if getattr(self, name) is not None}


@dataclass
class DriftConfig:
    """Routing drift measurement (expert volatility, train-rollout mismatch)."""

    enabled: bool = True
    """Measure drift; on, since it is a cheap extra forward on a small probe set."""
    probe_size: int = ranged(16, ge=1)
    """Fixed probe sequences whose routes are compared before and after each update."""
    probe_every: int = ranged(1, ge=1)
    """Measure on the probe set every N steps."""
    step_tokens: bool = True
    """Also measure on the step's own training tokens (the volatility that replay removes)."""
    every: int = ranged(1, ge=1)
    """Measure step-token drift every N steps: each measurement costs one extra forward pass."""
    per_update: bool = False
    """Also measure probe-set volatility across each optimizer update (`drift/volatility_per_update`,
    the per-gradient-update figure of the GSPO paper); costs one probe forward per update."""
    alarm: AlarmConfig = field(default_factory=AlarmConfig)


def check_drift(cfg: Any) -> Iterator[str]:
    """An alarm needs its metric: the step-token drift of an RL run (and engine routes for the route mismatch)."""
    d = cfg.drift
    for name in d.alarm.thresholds():
        key = f"drift.alarm.{name}"
        if cfg.train.mode != "rl":
            yield (f"{key} is set, but train.mode={cfg.train.mode!r} measures no {ALARM_METRICS[name][0]}: "
                   "drift alarms apply to RL runs; unset it")
        elif not (d.enabled and d.step_tokens):
            off = "drift.enabled=false" if not d.enabled else "drift.step_tokens=false"
            yield (f"{key} is set, but {off}: {ALARM_METRICS[name][0]} is never measured, so the alarm could "
                   f"never fire; set drift.enabled=true and drift.step_tokens=true, or unset {key}")
        elif name == "rollout_mismatch" and not cfg.rollout.return_routed_experts:
            yield (f"{key} is set, but rollout.return_routed_experts=false: without the engine's routes "
                   f"drift/rollout_mismatch is never measured; set rollout.return_routed_experts=true or unset {key}")


def step_tokens_due(d: DriftConfig, step: int) -> bool:
    """Whether step `step` measures drift on its own tokens (`drift.step_tokens`, every `drift.every` steps):
    the old pass then records the trainer's free routes for it."""
    return d.enabled and d.step_tokens and step % d.every == 0
