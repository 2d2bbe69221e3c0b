"""The report's training figures: reward and success rate, losses and gradient norm, DPO preference
accuracy, step time and throughput, the critic."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from moe_rl.observe.report_draw import METRICS_FILE, Metrics, Skip, decorate, lines, new_figure, present

__all__ = ["bookkeeping_table", "critic_figure", "is_bookkeeping", "loss_figure", "perf_figure", "phase_keys",
           "preference_figure", "reward_figure"]

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def reward_figure(m: Metrics) -> Figure:
    has_reward, has_success = m.has("reward/mean"), m.has("reward/success_rate")
    has_eval = m.has("eval/success_rate")
    if not (has_reward or has_success or has_eval):
        raise Skip(f"no reward/mean, reward/success_rate or eval/success_rate metrics in {METRICS_FILE}")
    has_rate = has_success or has_eval
    fig, axes = new_figure(int(has_reward) + int(has_rate))
    if has_reward:
        _reward_panel(axes[0], m)
    if has_rate:
        _success_panel(axes[-1], m)
    return fig


def _reward_panel(ax: Axes, m: Metrics) -> None:
    steps, mean = m.series("reward/mean")
    ax.plot(steps, mean, marker="." if len(steps) < 40 else None, label="reward mean")
    std_steps, std = m.series("reward/std")
    if len(std_steps) == len(steps) and np.array_equal(std_steps, steps):
        low, high = mean - std, mean + std
        # within the step's min and max: a 0/1 reward's band ends at 0 and 1, not past them
        min_steps, lowest = m.series("reward/min")
        if np.array_equal(min_steps, steps):
            low = np.maximum(low, lowest)
        max_steps, highest = m.series("reward/max")
        if np.array_equal(max_steps, steps):
            high = np.minimum(high, highest)
        ax.fill_between(steps, low, high, alpha=0.2, label="± std over samples (within the step's min and max)")
    decorate(ax, "reward", "Reward per step (mean over the step's samples)")


def _success_panel(ax: Axes, m: Metrics) -> None:
    from matplotlib.ticker import PercentFormatter

    steps, values = m.series("reward/success_rate")
    if len(steps):
        ax.plot(steps, values, marker="." if len(steps) < 40 else None, label="train success rate")
    eval_steps, eval_values = m.series("eval/success_rate")
    if len(eval_steps):
        ax.scatter(eval_steps, eval_values, color="tab:red", zorder=3, label="eval success rate")
    ax.set_ylim(-0.03, 1.03)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    decorate(ax, "success rate", "Success rate (train samples; eval set as points)")


# Series that say how big a step was, not how well it went: a table in index.md, never a panel.
_BOOKKEEPING = re.compile(r"(^|/)(num_\w+|adv_mean|adv_std|lr|weight_version|failures|partial_frac|response_len"
                          r"|staleness(_mean|_max)?)$|^adv/")
# Loss terms with a name a reader knows; any other loss/* series gets a panel titled by its key.
_LOSS_TITLES = {"loss/pg_loss": "Policy loss", "loss/kl_loss": "KL penalty loss", "loss/ntp_loss": "Next-token loss",
                "loss/dpo": "Preference loss (DPO)"}


def is_bookkeeping(key: str) -> bool:
    """Whether `key` is a bookkeeping series (counts, the advantages' normalised moments, lr, versions)."""
    return bool(_BOOKKEEPING.search(key))


def bookkeeping_table(m: Metrics) -> list[str]:
    """Markdown rows (header first) of first / last / min / max for each bookkeeping series; [] if none."""
    keys = sorted(k for k in m.keys if is_bookkeeping(k) and "/layer_" not in k and m.has(k))
    rows = ["| series | first | last | min | max |", "|---|---:|---:|---:|---:|"]
    for key in keys:
        values = m.series(key)[1]
        finite = values[np.isfinite(values)]
        low, high = (finite.min(), finite.max()) if finite.size else (np.nan, np.nan)
        rows.append(f"| `{key}` | " + " | ".join(_number(v) for v in (values[0], values[-1], low, high)) + " |")
    return rows if keys else []


def _number(v: float) -> str:
    return f"{v:.4g}"


def loss_figure(m: Metrics) -> Figure:
    """What a run is judged by: loss terms, clip fractions, the importance ratio, KL and entropy, grad norm."""
    keys = sorted(k for k in m.keys if not is_bookkeeping(k) and m.has(k))
    clip = [k for k in keys if "clip_frac" in k]
    ratio = [k for k in keys if k.startswith("loss/") and ("ratio" in k or "tis_weight" in k) and k not in clip]
    kl = [k for k in keys if k.startswith("loss/") and ("kl" in k or "entropy" in k)]
    grad = [k for k in keys if k.endswith("grad_norm")]
    terms = [k for k in keys if k.startswith("loss/") and k not in clip + ratio + kl + grad]
    if not (clip or ratio or kl or grad or terms):
        raise Skip(f"no loss/* or *grad_norm metrics in {METRICS_FILE}")
    panels: list[tuple[list[tuple[str, str]], str, str, bool]] = []
    panels += [([(k, k)], "loss", f"{_LOSS_TITLES.get(k, k)} ({k})" if k in _LOSS_TITLES else k, False)
               for k in terms]
    if clip:
        panels.append(([(k, k.split("/", 1)[-1]) for k in clip], "fraction", "Clip fractions", False))
    if ratio:
        panels.append(([(k, k.split("/", 1)[-1]) for k in ratio], "π / π_old",
                       "Importance ratio over the step's tokens (1 = unchanged policy)", False))
    if kl:
        one = "Entropy" if "entropy" in kl[0] else "KL"
        title = "KL and entropy" if len(kl) > 1 else f"{one} ({kl[0]})"  # one curve: say which
        panels.append(([(k, k.split("/", 1)[-1]) for k in kl], "nats", title, True))
    if grad:
        panels.append(([(k, k) for k in grad], "norm", "Gradient norm (before clipping)", True))
    ncols = 1 if len(panels) == 1 else 2
    fig, axes = new_figure(len(panels), ncols=ncols, width=11.0 if ncols == 2 else 9.0)
    for ax, (curves, ylabel, title, logy) in zip(axes, panels):
        lines(ax, m, curves, ylabel, title, logy=logy)
        if curves[0][0] in ratio:
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    return fig


def preference_figure(m: Metrics) -> Figure:
    """DPO: reward accuracy (train per step, held-out pairs as points), then the implicit rewards."""
    from matplotlib.ticker import PercentFormatter

    if not (m.has("dpo/reward_accuracy") or m.has("eval/reward_accuracy")):
        raise Skip(f"no dpo/reward_accuracy or eval/reward_accuracy metrics in {METRICS_FILE}")
    rewards = present(m, [("dpo/reward_margin", "margin"), ("dpo/chosen_reward", "chosen"),
                           ("dpo/rejected_reward", "rejected"), ("eval/reward_margin", "eval margin")])
    fig, axes = new_figure(1 + bool(rewards))
    steps, values = m.series("eval/reward_accuracy")
    if len(steps):
        axes[0].scatter(steps, values, color="tab:red", zorder=3, label="held-out pairs")
    lines(axes[0], m, present(m, [("dpo/reward_accuracy", "train pairs")]), "accuracy",
           "Reward accuracy: chosen reward > rejected reward (held-out pairs as points)")
    axes[0].set_ylim(-0.03, 1.03)
    axes[0].yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    if rewards:
        lines(axes[1], m, rewards, "β · log(π / π_ref)", "Implicit rewards (means over the step's pairs)")
    return fig


def phase_keys(m: Metrics) -> list[str]:
    """The step's `perf/<phase>_s` series (not the total `perf/step_s`, nor rates `*_per_s`), in logged order."""
    first = {k: next(i for i, r in enumerate(m.records) if k in r) for k in m.keys}
    phases = [k for k in m.keys if k.startswith("perf/") and k.endswith("_s") and not k.endswith("_per_s")
              and k != "perf/step_s" and m.has(k)]
    return sorted(phases, key=lambda k: (first[k], list(m.records[first[k]]).index(k)))


def perf_figure(m: Metrics) -> Figure:
    """Throughput, then the step time split by phase (stacked bars; the measured total as a line)."""
    tps = present(m, [("perf/tokens_per_s", "tokens/s")])
    step = present(m, [("perf/step_s", "step total")])
    phases = phase_keys(m)
    if not (tps or step or phases):
        raise Skip(f"no perf/tokens_per_s or perf/*_s metrics in {METRICS_FILE}")
    fig, axes = new_figure(int(bool(tps)) + int(bool(step or phases)), height=3.2)
    if tps:
        lines(axes[0], m, tps, "tokens / s", "Throughput")
    if phases:
        _phase_bars(axes[-1], m, phases)
    if step:
        steps, values = m.series("perf/step_s")
        axes[-1].plot(steps, values, color="black", marker="." if len(steps) < 40 else None, label="step total")
    if step or phases:
        decorate(axes[-1], "seconds", "Wall time per step, by phase (stacked)" if phases else "Wall time per step")
    return fig


def _phase_bars(ax: Axes, m: Metrics, phases: list[str]) -> None:
    steps = m.steps
    bottom = np.zeros(len(steps))
    for key in phases:
        values = dict(zip(*m.series(key)))
        height = np.array([values.get(s, 0.0) for s in steps])
        height = np.where(np.isfinite(height), height, 0.0)
        ax.bar(steps, height, bottom=bottom, width=0.8, label=key[len("perf/"):-len("_s")])
        bottom += height


def critic_figure(m: Metrics) -> Figure:
    """Value loss and explained variance over steps (algo.advantage=gae runs), value and return means."""
    loss = present(m, [("critic/value_loss", "value loss")])
    ev = present(m, [("critic/explained_variance", "explained variance")])
    if not (loss or ev):
        raise Skip(f"no critic/value_loss or critic/explained_variance metrics in {METRICS_FILE} (no critic)")
    means = present(m, [("critic/value_mean", "value mean"), ("critic/return_mean", "return mean")])
    panels = [(c, y, t, log) for c, y, t, log in (
        (loss, "loss", "Critic value loss", True), (ev, "1 - Var(R - V) / Var(R)", "Explained variance", False),
        (means, "value", "Values and returns", False)) if c]
    fig, axes = new_figure(len(panels))
    for ax, (curves, ylabel, title, logy) in zip(axes, panels):
        lines(ax, m, curves, ylabel, title, logy=logy)
    return fig
