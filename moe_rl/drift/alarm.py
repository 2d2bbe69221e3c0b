"""Drift alarms (`drift.alarm`): thresholds on a step's drift metrics that warn or stop the run.

The most common MoE RL failures are silent: the train-inference gap or the routers' churn grows
for many steps before the reward collapses. The drift metrics measure it; an alarm acts on it.
`Alarms.check(step, metrics)` runs on each step's metrics (the driver calls it, whatever the
recipe: the metrics are plain keys), returns `health/alarms` (how many thresholds the step
crossed) and, under `action=warn`, logs the first crossing of each metric with its worst layer.
Under `action=stop`, `enforce()` then raises `DriftAlarm`, on every rank at the same step (the
metrics are the same on every rank), and the driver checkpoints that step and exits with
`EXIT_DRIFT_ALARM`, as it exits `EXIT_NO_SERVER` when the rollout servers are lost.

Nothing here imports torch: the report marks the steps past each threshold with the same
`crossed` and the same table (`ALARM_METRICS`, moe_rl/drift/config.py).
"""
from __future__ import annotations

import logging
import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

from moe_rl.drift.config import ALARM_METRICS, COLLAPSE_GRAD, AlarmConfig

EXIT_DRIFT_ALARM = 4  # `moe-rl train` exit status when a drift alarm with action=stop fired
HEALTH_ALARMS = "health/alarms"
HEALTH_STALLED = "health/stalled_steps"

log = logging.getLogger("moe_rl")

@dataclass(frozen=True)
class Fired:
    """One threshold crossed at one step."""

    name: str            # the drift.alarm field
    key: str             # the metric
    value: float
    threshold: float
    side: str            # "above" (a ceiling) or "below" (a floor)
    step: int
    layer: int | None    # the worst MoE layer (HF index) by the per-layer keys; None without them
    layer_value: float | None
    detail: str | None = None  # an alarm over several steps (collapse) says what it saw

    def describe(self) -> str:
        if self.detail is not None:
            return f"{self.detail} at step {self.step}"
        where = f", worst layer {self.layer:02d} ({self.layer_value:.4g})" if self.layer is not None else ""
        return (f"{self.key} = {self.value:.4g} is {self.side} drift.alarm.{self.name} = {self.threshold:g} "
                f"at step {self.step}{where}")


class DriftAlarm(RuntimeError):
    """A drift alarm with `drift.alarm.action=stop` fired; raised on every rank at the same step."""

    def __init__(self, fired: list[Fired]) -> None:
        self.fired = fired
        self.step = fired[0].step
        super().__init__("; ".join(f.describe() for f in fired))


def crossed(value: float, threshold: float, side: str) -> bool:
    """Whether `value` is past `threshold`; a NaN (nothing measured) never is."""
    if math.isnan(value):  # a step without tokens to measure
        return False
    return value > threshold if side == "above" else value < threshold


def worst_layer(metrics: Mapping[str, Any], key: str, side: str) -> tuple[int | None, float | None]:
    """The MoE layer whose `{key}/layer_NN` value is furthest past the threshold's side (the largest
    for a ceiling, the smallest for a floor), with its value; (None, None) without per-layer keys."""
    pattern = re.compile(re.escape(key) + r"/layer_(\d+)$")
    layers = [(int(m.group(1)), float(v)) for k, v in metrics.items()
              if (m := pattern.match(k)) and isinstance(v, (int, float)) and not math.isnan(v)]
    if not layers:
        return None, None
    pick = max if side == "above" else min
    return pick(layers, key=lambda lv: lv[1])


class Alarms:
    """The run's drift alarms (one per set threshold of `drift.alarm`); inactive when none is set."""

    def __init__(self, cfg: AlarmConfig, rank: int = 0, asynchronous: bool = False) -> None:
        self.cfg = cfg
        self.speaks = rank == 0  # every rank sees the same metrics: one warning is enough
        self.thresholds = cfg.thresholds()
        self.warned: set[str] = set()  # metrics whose crossing was logged already: once each
        self.fired: list[Fired] = []   # the last checked step's
        self.window = cfg.collapse_window(asynchronous)  # the collapse alarm's N (0: off)
        self.stalled: deque[bool] = deque(maxlen=max(1, self.window))
        self.success: deque[float] = deque(maxlen=max(1, self.window))
        self.first_entropy: float | None = None  # rollout/entropy of the first step that measured it

    @property
    def active(self) -> bool:
        return bool(self.thresholds) or self.window > 0

    def collapse(self, step: int, metrics: Mapping[str, Any]) -> Fired | None:
        """The collapse alarm: over a full window of the last `window` steps, at least half stalled (below
        drift.alarm.collapse_success with an entropy under the floor, or with no gradient and an entropy
        under half the first step's) and the mean success rate is below it too. A learned run also has
        uniform groups (all right), and single steps of it dip below the bar: the mean keeps it quiet.
        Steps without a success rate and a gradient norm (DPO) are not counted."""
        success, grad = metrics.get("reward/success_rate"), metrics.get("perf/grad_norm")
        if not isinstance(success, (int, float)) or not isinstance(grad, (int, float)):
            return None
        entropy = metrics.get("rollout/entropy")
        measured = isinstance(entropy, (int, float)) and not math.isnan(entropy)
        if measured and self.first_entropy is None:
            self.first_entropy = float(entropy)
        low_entropy = measured and entropy < self.cfg.collapse_entropy
        # no gradient while the policy still explores (at least half its first step's entropy) is a task
        # not found yet, as at the start when every group is wrong: it stalls only once exploring stopped
        explores = measured and self.first_entropy is not None and entropy >= self.first_entropy / 2
        bar = self.cfg.collapse_success
        self.stalled.append(success < bar and ((grad <= COLLAPSE_GRAD and not explores) or low_entropy))
        self.success.append(float(success))
        count, need, mean = sum(self.stalled), (self.window + 1) // 2, sum(self.success) / len(self.success)
        if len(self.stalled) < self.window or count < need or mean >= bar:
            return None
        what = (f"collapse: {count} of the last {self.window} steps stalled below {bar:g} success "
                f"with no gradient or an entropy < {self.cfg.collapse_entropy:g}, mean success {mean:.3g} "
                f"(drift.alarm.collapse_steps={self.window}; now grad norm {grad:.3g}"
                + (f", entropy {entropy:.3g})" if isinstance(entropy, (int, float)) else ")"))
        return Fired("collapse_steps", HEALTH_STALLED, float(count), float(need), "above", step, None, None, what)

    def crossings(self, step: int, metrics: Mapping[str, Any]) -> list[Fired]:
        """The thresholds that `metrics` of `step` cross; a metric this step did not measure crosses none."""
        out = []
        for name, threshold in self.thresholds.items():
            key, side = ALARM_METRICS[name]
            value = metrics.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if crossed(float(value), threshold, side):
                layer, layer_value = worst_layer(metrics, key, side)
                out.append(Fired(name, key, float(value), threshold, side, step, layer, layer_value))
        return out

    def check(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """`health/alarms` of this step (nothing when no alarm is set). Under action=warn the first crossing
        of each metric is logged, on rank 0 (later ones only counted, so a run that stays past a threshold
        does not flood the log); under action=stop the driver's error names them."""
        if not self.active:
            return {}
        self.fired = self.crossings(step, metrics)
        collapsed = self.collapse(step, metrics) if self.window else None
        self.fired += [collapsed] if collapsed else []
        for f in self.fired:
            if self.cfg.action == "warn" and f.key not in self.warned:
                self.warned.add(f.key)
                if self.speaks:
                    log.warning("drift alarm: %s; the run goes on (drift.alarm.action=warn): later crossings of "
                                "this metric are counted in health/alarms, not logged", f.describe())
        return {HEALTH_ALARMS: float(len(self.fired))} | ({HEALTH_STALLED: float(sum(self.stalled))}
                                                           if self.window else {})

    def enforce(self) -> None:
        """Raise `DriftAlarm` when the last checked step crossed a threshold under `action=stop`."""
        if self.fired and self.cfg.action == "stop":
            raise DriftAlarm(self.fired)
