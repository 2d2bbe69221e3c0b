"""The report's "MoE health" figure, the one a user reads first: is routing replay applied (R3
coverage), do the engine and the trainer route alike (route flips, tokens masked for them), is the
expert load balanced (load violation), and where the run's `drift.alarm` thresholds were crossed.

Thresholds come from the run's resolved `config.yaml`; the steps past them are found from the
metrics themselves, so the report marks where an alarm would have fired whatever `drift.alarm.action`
was (warn or stop), beside the `health/alarms` the run logged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from moe_rl.drift.alarm import HEALTH_ALARMS, crossed
from moe_rl.drift.config import ALARM_METRICS
from moe_rl.observe.report_draw import METRICS_FILE, Metrics, Skip, decorate, new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["HEALTH_KEYS", "AlarmSettings", "health_figure", "health_lines", "read_alarm_settings"]

COVERAGE = ("replay/coverage", "replay/coverage_prompt")
MASKED = "correction/route_masked_frac"
FLIPS = "drift/rollout_mismatch"
LOAD_VIO = "drift/load_max_vio"
HEALTH_KEYS = (*COVERAGE, MASKED, FLIPS, LOAD_VIO, HEALTH_ALARMS)
_ALARM = "tab:red"


@dataclass(frozen=True)
class AlarmSettings:
    """The run's `drift.alarm`: thresholds by field name, the action, and why they are unknown if they are."""

    thresholds: dict[str, float] = field(default_factory=dict)
    action: str = "warn"
    note: str = ""


def read_alarm_settings(run_dir: Path) -> AlarmSettings:
    """`drift.alarm` of the run's config.yaml; an unreadable or older config gives no thresholds and a note."""
    import yaml

    path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return AlarmSettings(note=f"no config.yaml in {run_dir}: alarm thresholds unknown")
    except (OSError, yaml.YAMLError) as e:
        return AlarmSettings(note=f"config.yaml unreadable ({type(e).__name__}): alarm thresholds not drawn")
    alarm = ((cfg or {}).get("drift") or {}).get("alarm") if isinstance(cfg, dict) else None
    if not isinstance(alarm, dict):
        return AlarmSettings()
    found = {name: float(alarm[name]) for name in ALARM_METRICS
             if isinstance(alarm.get(name), (int, float)) and not isinstance(alarm.get(name), bool)}
    return AlarmSettings(found, str(alarm.get("action", "warn")))


def past_threshold(m: Metrics, name: str, threshold: float) -> np.ndarray:
    """The steps whose metric of alarm `name` is past `threshold` (where that alarm would have fired)."""
    key, side = ALARM_METRICS[name]
    steps, values = m.series(key)
    return np.array([s for s, v in zip(steps, values) if crossed(float(v), threshold, side)], dtype=float)


def health_figure(settings: AlarmSettings) -> Callable[[Metrics], Figure]:
    """A builder of the health figure for a run with these alarm settings."""

    def build(m: Metrics) -> Figure:
        if not any(m.has(k) for k in HEALTH_KEYS):
            raise Skip(f"no {', '.join(HEALTH_KEYS)} in {METRICS_FILE} (drift off, or not an RL run)")
        own = [name for name in settings.thresholds if name not in ("rollout_mismatch", "load_max_vio")]
        fig, axes = new_figure(4 + len(own), height=2.2)
        _coverage(axes[0], m)
        _curves(axes[1], m, [(FLIPS, "engine vs trainer routes (share of top-k that differ)"),
                             (MASKED, "tokens masked for their route flips (route_mask)")],
                settings, "share", f"Route flips, engine vs trainer ({FLIPS}), and tokens masked for them")
        _curves(axes[2], m, [(LOAD_VIO, "max over layers of max expert load / mean load − 1")],
                settings, "max_vio", f"Expert-load violation ({LOAD_VIO}: 0 = balanced)")
        for ax, name in zip(axes[3:-1], own):
            key = ALARM_METRICS[name][0]
            _curves(ax, m, [(key, key)], settings, key.split("/")[-1], f"Alarm metric {key}")
        _alarms(axes[-1], m, settings)
        return fig

    return build


def _not_measured(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"not measured: {what}", transform=ax.transAxes, ha="center", va="center",
            fontsize=9, color="grey")


def _coverage(ax: Axes, m: Metrics) -> None:
    drawn = False
    for key, label in zip(COVERAGE, ("response tokens", "prompt tokens")):
        steps, values = m.series(key)
        if len(steps):
            ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=label)
            drawn = True
    if drawn:
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_ylim(min(0.0, ax.get_ylim()[0]), 1.05)
    else:
        _not_measured(ax, f"no {COVERAGE[0]} in {METRICS_FILE}\n(R3 off, or a version that does not log it)")
    decorate(ax, "share replayed", "R3 coverage: tokens whose updates replayed an engine route (1 = all)")


def _curves(ax: Axes, m: Metrics, curves: list[tuple[str, str]], settings: AlarmSettings, ylabel: str,
            title: str) -> None:
    """Each present curve, with its alarm threshold dashed and the steps past it marked; absent ones said so."""
    missing = []
    for key, label in curves:
        steps, values = m.series(key)
        if not len(steps):
            missing.append(key)
            continue
        line, = ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=label)
        name = next((n for n, (k, _) in ALARM_METRICS.items() if k == key), None)
        if name in settings.thresholds:
            threshold = settings.thresholds[name]
            ax.axhline(threshold, color=line.get_color(), ls="--", lw=1,
                       label=f"drift.alarm.{name} = {threshold:g} ({ALARM_METRICS[name][1]})")
            past = past_threshold(m, name, threshold)
            ax.plot(past, [dict(zip(steps, values))[s] for s in past], "x", color=_ALARM, ms=8,
                    label="past the threshold" if len(past) else None)
    if len(missing) < len(curves):
        ax.set_ylim(bottom=0)  # shares, violations and margins are >= 0: the axis starts where they do
        drawn = np.concatenate([m.series(k)[1] for k, _ in curves])
        if not np.nan_to_num(drawn).any():
            title += "\n0 at every measured step"
    if len(missing) == len(curves):
        _not_measured(ax, ", ".join(missing))
    elif missing:  # in a corner: the curves that are present keep the middle
        ax.text(0.01, 0.97, "not measured: " + ", ".join(missing), transform=ax.transAxes, va="top",
                fontsize=8, color="grey")
    decorate(ax, ylabel, title)


def _alarms(ax: Axes, m: Metrics, settings: AlarmSettings) -> None:
    """One row per threshold set: the steps it was measured (grey) and past it (red); the logged count on top."""
    rows: list[str] = []
    for name, threshold in settings.thresholds.items():
        key, side = ALARM_METRICS[name]
        y = len(rows)
        ax.plot(m.series(key)[0], [y] * len(m.series(key)[0]), "|", color="lightgrey", ms=8)
        past = past_threshold(m, name, threshold)
        ax.plot(past, [y] * len(past), "x", color=_ALARM, ms=8)
        rows.append(f"{key} {'>' if side == 'above' else '<'} {threshold:g}")
    steps, counts = m.series(HEALTH_ALARMS)
    if len(steps):
        fired = counts > 0
        ax.scatter(steps[fired], [len(rows)] * int(fired.sum()), s=25 + 25 * counts[fired], color=_ALARM,
                   marker="o")
        rows.append(f"{HEALTH_ALARMS} logged (size: count)")
    if rows:
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_ylim(-0.7, len(rows) - 0.3)
    else:
        ax.set_yticks([])
    if not settings.thresholds:
        ax.text(0.5, 0.5 if not rows else 0.15, settings.note or "no drift.alarm threshold set in config.yaml",
                transform=ax.transAxes, ha="center", va="center", fontsize=9, color="grey")
    action = f" (drift.alarm.action={settings.action})" if settings.thresholds else ""
    decorate(ax, "", f"Alarms: steps past a threshold (red){action}")
    ax.grid(axis="y", visible=False)


def health_lines(m: Metrics, settings: AlarmSettings) -> list[str]:
    """index.md's summary of the figure: coverage, flips, load violation, and where alarms fired."""
    if not any(m.has(k) for k in HEALTH_KEYS):
        return []

    def worst(key: str, lowest: bool = False) -> str:
        """The run's worst value of `key` (its min for coverage, else its max) and its step."""
        steps, values = m.series(key)
        finite = np.flatnonzero(np.isfinite(values))
        if not finite.size:
            return "not measured"
        i = finite[np.argmin(values[finite]) if lowest else np.argmax(values[finite])]
        return f"{'min' if lowest else 'max'} {values[i]:.4g} (step {int(steps[i])})"

    out = [f"- R3 coverage (`{COVERAGE[0]}`): {worst(COVERAGE[0], lowest=True)}",
           f"- route flips, engine vs trainer (`{FLIPS}`): {worst(FLIPS)}; masked (`{MASKED}`): {worst(MASKED)}",
           f"- expert-load violation (`{LOAD_VIO}`): {worst(LOAD_VIO)}"]
    for name, threshold in settings.thresholds.items():
        key, side = ALARM_METRICS[name]
        past = [str(int(s)) for s in past_threshold(m, name, threshold)]
        shown = ", ".join(past[:12]) + (f", ... ({len(past)} steps)" if len(past) > 12 else "")
        out.append(f"- alarm `drift.alarm.{name}` ({key} {side} {threshold:g}, action={settings.action}): "
                   + (f"past at steps {shown}" if past else "never crossed"))
    if not settings.thresholds:
        out.append(f"- alarms: {settings.note or 'no drift.alarm threshold set'}")
    return out
