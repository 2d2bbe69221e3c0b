"""The report's training figures: reward and success rate, losses and gradient norm, DPO preference
accuracy, step time and throughput, the critic."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moe_rl.observe.report_draw import METRICS_FILE, Metrics, Skip, decorate, lines, new_figure, present

__all__ = ["critic_figure", "loss_figure", "perf_figure", "preference_figure", "reward_figure"]

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
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2, label="± std over samples")
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


def loss_figure(m: Metrics) -> Figure:
    clip = sorted(k for k in m.keys if "clip_frac" in k)
    grad = sorted(k for k in m.keys if k.endswith("grad_norm"))
    others = sorted(k for k in m.keys if k.startswith("loss/") and k not in clip and k not in grad)
    if not (clip or grad or others):
        raise Skip(f"no loss/* or *grad_norm metrics in {METRICS_FILE}")
    panels: list[tuple[list[tuple[str, str]], str, str, bool]] = []
    if clip:
        panels.append(([(k, k) for k in clip], "fraction of tokens", "Clip fractions", False))
    panels += [([(k, k)], k.split("/", 1)[-1], k, False) for k in others]
    if grad:
        panels.append(([(k, k) for k in grad], "norm", "Gradient norm", True))
    ncols = 1 if len(panels) == 1 else 2
    fig, axes = new_figure(len(panels), ncols=ncols, width=11.0 if ncols == 2 else 9.0)
    for ax, (curves, ylabel, title, logy) in zip(axes, panels):
        lines(ax, m, curves, ylabel, title, logy=logy)
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


def perf_figure(m: Metrics) -> Figure:
    tps = present(m, [("perf/tokens_per_s", "tokens/s")])
    step = present(m, [("perf/step_s", "step time")])
    if not (tps or step):
        raise Skip(f"no perf/tokens_per_s or perf/step_s metrics in {METRICS_FILE}")
    panels = [(c, y, t) for c, y, t in ((tps, "tokens / s", "Throughput"),
                                         (step, "seconds", "Wall time per step")) if c]
    fig, axes = new_figure(len(panels))
    for ax, (curves, ylabel, title) in zip(axes, panels):
        lines(ax, m, curves, ylabel, title)
    return fig


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
