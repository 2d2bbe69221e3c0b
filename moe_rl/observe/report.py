"""`moe-rl report RUN_DIR`: plots of a run's metrics.jsonl, as PNG files plus an index.md.

    moe-rl report runs/gspo-tiny                  # writes runs/gspo-tiny/report/*.png
    moe-rl report runs/gspo-tiny --out plots/gspo-tiny

The trainer calls `write_report(run_dir)` at the end of a run. A figure whose
metrics are absent (no drift measured, no eval) is skipped with a note in
index.md; only a missing or empty metrics file is an error.

Figures are drawn on matplotlib `Figure` objects with the Agg canvas, never
through pyplot, so writing a report neither needs a display nor changes the
backend of the process that calls it (a notebook keeps its inline plots).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from moe_rl.observe.logging import get_logger
from moe_rl.observe.sinks import METRICS_FILE, latest_history, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["FigureResult", "Metrics", "ReportError", "add_arguments", "build_report", "run", "write_report"]

log = get_logger(__name__)

REPORT_DIR = "report"
_LAYER_KEY = re.compile(r"^(?P<prefix>.+)/layer_(?P<layer>\d+)$")
_DPI = 110


class ReportError(RuntimeError):
    """The run directory has no metrics to report (missing directory or file, no records)."""


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `moe-rl report`."""
    parser.add_argument("run_dir", help="run directory containing metrics.jsonl")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where to write the PNGs and index.md (default: RUN_DIR/report)")


def run(args: argparse.Namespace) -> int:
    """Write the report; exit code 1 with a one-line reason when there is nothing to plot."""
    try:
        results = build_report(args.run_dir, args.out)
    except ReportError as e:
        print(f"moe-rl report: error: {e}", file=sys.stderr)
        return 1
    for r in results:
        print(f"  {r.name:<28} {r.path}" if r.path else f"  {r.name:<28} skipped: {r.skipped}")
    print(f"report: {_index_path(results)}")
    return 0


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class FigureResult:
    """One figure of the report: written to `path`, or skipped for the reason `skipped`."""

    name: str
    about: str
    path: Path | None = None
    skipped: str | None = None


class _Skip(Exception):
    """Raised by a figure builder when the metrics it needs are absent."""


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the report of `run_dir` into `out_dir` (default `run_dir/report`).

    Returns the paths written: the PNG figures, then index.md. Skipped figures
    are listed in index.md and logged. Raises ReportError when `run_dir` or its
    metrics.jsonl is missing or holds no records.
    """
    results = build_report(run_dir, out_dir)
    for r in results:
        if r.skipped:
            log.info("report: %s skipped: %s", r.name, r.skipped)
    return [r.path for r in results if r.path is not None]


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[FigureResult]:
    """Like `write_report`, but returns every figure with its outcome; index.md comes last."""
    run_dir = Path(run_dir)
    metrics = _load(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    name = run_dir.resolve().name  # "." names the run too
    results = [_draw(spec, metrics, out, name) for spec in _FIGURES]
    index = out / "index.md"
    index.write_text(_index_markdown(name, metrics, results), encoding="utf-8")
    return results + [FigureResult("index.md", "this list", path=index)]


def _index_path(results: list[FigureResult]) -> Path | None:
    return next((r.path for r in results if r.name == "index.md"), None)


def _load(run_dir: Path) -> Metrics:
    if not run_dir.is_dir():
        raise ReportError(f"run directory not found: {run_dir}")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"no {METRICS_FILE} in {run_dir} (has the run finished a step yet?)")
    records = latest_history(read_metrics(path))  # a restarted run: the attempts' current history
    if not records:
        raise ReportError(f"{path} holds no metric records")
    return Metrics(records)


def _draw(spec: _FigureSpec, metrics: Metrics, out: Path, run_name: str) -> FigureResult:
    try:
        fig = spec.build(metrics)
    except _Skip as reason:
        # A figure left over from an earlier report would no longer match the metrics.
        (out / spec.name).unlink(missing_ok=True)
        return FigureResult(spec.name, spec.about, skipped=str(reason))
    fig.suptitle(f"{run_name}: {spec.title}", fontsize=12)
    path = out / spec.name
    _save(fig, path)
    return FigureResult(spec.name, spec.about, path=path)


def _save(fig: Figure, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # attach the Agg canvas: no display, no pyplot state
    fig.savefig(path, dpi=_DPI)


def _index_markdown(run_name: str, metrics: Metrics, results: list[FigureResult]) -> str:
    steps = metrics.steps
    lines = [f"# Report: {run_name}", "",
             f"{len(steps)} steps ({int(steps[0])} to {int(steps[-1])}) from `{METRICS_FILE}`.", "",
             "## Figures", ""]
    lines += [f"- [{r.name}]({r.name}): {r.about}" for r in results if r.path]
    skipped = [r for r in results if r.skipped]
    if skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- {r.name}: {r.skipped}" for r in skipped]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Metrics as series
# --------------------------------------------------------------------------

class Metrics:
    """metrics.jsonl records as per-key series over steps.

    If a step appears more than once (a run resumed from an earlier checkpoint
    re-does steps), its last record wins: that is the run that continued.
    """

    def __init__(self, records: Sequence[dict[str, Any]]):
        by_step: dict[int, dict[str, Any]] = {}
        for i, record in enumerate(records):
            step = record.get("step", i)
            by_step[int(step)] = record
        self.records = [by_step[s] for s in sorted(by_step)]
        self.steps = np.array(sorted(by_step), dtype=float)
        self.keys = {k for r in self.records for k in r if k not in ("step", "time")}

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the records that hold a number for `key`; non-finite values as NaN."""
        pairs = [(s, _finite_or_nan(r[key])) for s, r in zip(self.steps, self.records)
                 if _is_number(r.get(key))]
        if not pairs:
            return np.empty(0), np.empty(0)
        steps, values = zip(*pairs)
        return np.array(steps, dtype=float), np.array(values, dtype=float)

    def has(self, key: str) -> bool:
        return len(self.series(key)[0]) > 0

    def layers(self, prefix: str) -> dict[int, str]:
        """Layer index -> key, for keys `<prefix>/layer_NN`, in layer order."""
        found = {}
        for key in self.keys:
            m = _LAYER_KEY.match(key)
            if m and m.group("prefix") == prefix:
                found[int(m.group("layer"))] = key
        return dict(sorted(found.items()))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_or_nan(value: float) -> float:
    # inf would break autoscaling; drawing it as a gap shows the bad step as well.
    return float(value) if math.isfinite(value) else math.nan


# --------------------------------------------------------------------------
# Drawing helpers
# --------------------------------------------------------------------------

def _new_figure(panels: int, ncols: int = 1, width: float = 9.0, height: float = 2.8) -> tuple[Figure, list[Axes]]:
    """A figure with `panels` axes; one column shares the step axis and labels it once, at the bottom."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    nrows = math.ceil(panels / ncols)
    fig = Figure(figsize=(width, 0.6 + height * nrows), layout="constrained")
    # In a grid an empty last cell would leave the panel above it without step
    # labels, so only a single column shares (and labels once) the step axis.
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=ncols == 1).ravel().tolist()
    for ax in axes[panels:]:
        ax.set_visible(False)  # an unused cell of the grid
    for i, ax in enumerate(axes[:panels]):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if ncols > 1 or i == panels - 1:
            ax.set_xlabel("step")
    return fig, axes[:panels]


def _lines(ax: Axes, metrics: Metrics, curves: Sequence[tuple[str, str]], ylabel: str,
           title: str, logy: bool = False) -> None:
    """Plot each (key, label) present in `metrics` on `ax`, with labels, grid and a legend."""
    for key, label in curves:
        steps, values = metrics.series(key)
        if len(steps):
            ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=label)
    if logy and _spans_decades(ax):
        ax.set_yscale("log")
    _decorate(ax, ylabel, title)


def _decorate(ax: Axes, ylabel: str, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:  # one curve is named by the title
        # Outside the axes, on the right: a legend inside would hide curves.
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _spans_decades(ax: Axes) -> bool:
    """True when the plotted values are positive and span more than a factor 20: a log axis reads better."""
    ys = [np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()]
    values = np.concatenate(ys) if ys else np.empty(0)
    values = values[np.isfinite(values)]
    return values.size > 0 and bool((values > 0).all()) and values.max() > 20 * values.min()


def _present(metrics: Metrics, curves: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, label) for k, label in curves if metrics.has(k)]


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------

def _reward_figure(m: Metrics) -> Figure:
    has_reward, has_success = m.has("reward/mean"), m.has("reward/success_rate")
    has_eval = m.has("eval/success_rate")
    if not (has_reward or has_success or has_eval):
        raise _Skip(f"no reward/mean, reward/success_rate or eval/success_rate metrics in {METRICS_FILE}")
    has_rate = has_success or has_eval
    fig, axes = _new_figure(int(has_reward) + int(has_rate))
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
    _decorate(ax, "reward", "Reward per step (mean over the step's samples)")


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
    _decorate(ax, "success rate", "Success rate (train samples; eval set as points)")


def _heatmap_figure(prefix: str, title: str, cbar_label: str) -> Callable[[Metrics], Figure]:
    """A builder of a layer × step heatmap from the `<prefix>/layer_NN` keys."""

    def build(m: Metrics) -> Figure:
        layers = m.layers(prefix)
        if not layers:
            raise _Skip(f"no {prefix}/layer_NN metrics in {METRICS_FILE}")
        steps, grid = _layer_grid(m, layers)
        fig, (ax,) = _new_figure(1, height=max(3.0, min(0.22 * len(layers), 9.0)))
        _heatmap(fig, ax, steps, list(layers), grid, cbar_label)
        ax.set_title(title, fontsize=10)
        return fig

    return build


def _layer_grid(m: Metrics, layers: dict[int, str]) -> tuple[np.ndarray, np.ndarray]:
    """Steps that have any layer value, and a [layer, step] array with NaN where a value is missing."""
    per_layer = {layer: dict(zip(*m.series(key))) for layer, key in layers.items()}
    steps = np.array(sorted({s for values in per_layer.values() for s in values}), dtype=float)
    grid = np.array([[values.get(s, np.nan) for s in steps] for values in per_layer.values()])
    return steps, grid


def _heatmap(fig: Figure, ax: Axes, steps: np.ndarray, layers: list[int], grid: np.ndarray,
             cbar_label: str) -> None:
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    # grey cells: steps where a layer was not measured
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    # Cell edges halfway between steps: drift may be measured every k steps, or irregularly.
    mesh = ax.pcolormesh(_edges(steps), _edges(np.array(layers, dtype=float)),
                         np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, shading="flat")
    fig.colorbar(mesh, ax=ax, label=cbar_label)
    ax.set_ylabel("MoE layer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(len(layers), 16)))


def _edges(centres: np.ndarray) -> np.ndarray:
    if len(centres) == 1:
        return np.array([centres[0] - 0.5, centres[0] + 0.5])
    mids = (centres[1:] + centres[:-1]) / 2
    return np.concatenate([[2 * centres[0] - mids[0]], mids, [2 * centres[-1] - mids[-1]]])


def _drift_figure(m: Metrics) -> Figure:
    # (curves, y label, title, log scale): one panel per quantity with its own units
    exact = _first_present(m, ("drift/volatility/exact_match", "drift/exact_match"),
                           "exact top-k set match, between updates")
    panels = [
        (_present(m, [("drift/volatility", "step's tokens, across the step's updates (volatility)"),
                      ("drift/volatility_per_update", "probe set, per optimizer update"),
                      ("drift/probe_volatility", "probe set, between probes"),
                      ("drift/rollout_mismatch", "rollout engine vs trainer (mismatch)")]) + exact
         + _present(m, [("drift/volatility/tokens_changed_any_layer", "tokens changed in any layer")]),
         "share", "Expert routes: share of top-k experts changed", False),
        (_present(m, [("drift/logp_k3", "k3 KL"), ("drift/logp_abs_diff", "mean |Δ log p|")]),
         "mismatch", "Log-prob mismatch, rollout engine vs trainer", True),
        (_present(m, [("drift/logp_ratio_outside", "p_train / p_rollout outside [1/2, 2]")]),
         "share of tokens", "Tokens whose probability ratio is outside [1/2, 2]", False),
        (_present(m, [("drift/load_change", "expert load change")]),
         "total variation", "Expert load change between steps", False),
        (_present(m, [("drift/route_margin", "k-th minus (k+1)-th router logit")]),
         "logit margin", "Routing confidence: low margins are where routes flip", False),
        (_present(m, [("drift/route_gate_mass", "softmax mass of the top-k experts")]),
         "share", "Routing confidence: top-k gate mass", False),
    ]
    panels = [p for p in panels if p[0]]
    if not panels:
        raise _Skip(f"no drift/volatility, drift/probe_volatility, drift/rollout_mismatch or drift/logp_* metrics "
                    f"in {METRICS_FILE}")
    fig, axes = _new_figure(len(panels))
    for ax, (curves, ylabel, title, logy) in zip(axes, panels):
        _lines(ax, m, curves, ylabel, title, logy=logy)
    return fig


def _first_present(m: Metrics, keys: Sequence[str], label: str) -> list[tuple[str, str]]:
    """[(key, label)] for the first of several alternative names that the run logged, else []."""
    return next(([(k, label)] for k in keys if m.has(k)), [])


def _loss_figure(m: Metrics) -> Figure:
    clip = sorted(k for k in m.keys if "clip_frac" in k)
    grad = sorted(k for k in m.keys if k.endswith("grad_norm"))
    others = sorted(k for k in m.keys if k.startswith("loss/") and k not in clip and k not in grad)
    if not (clip or grad or others):
        raise _Skip(f"no loss/* or *grad_norm metrics in {METRICS_FILE}")
    panels: list[tuple[list[tuple[str, str]], str, str, bool]] = []
    if clip:
        panels.append(([(k, k) for k in clip], "fraction of tokens", "Clip fractions", False))
    panels += [([(k, k)], k.split("/", 1)[-1], k, False) for k in others]
    if grad:
        panels.append(([(k, k) for k in grad], "norm", "Gradient norm", True))
    ncols = 1 if len(panels) == 1 else 2
    fig, axes = _new_figure(len(panels), ncols=ncols, width=11.0 if ncols == 2 else 9.0)
    for ax, (curves, ylabel, title, logy) in zip(axes, panels):
        _lines(ax, m, curves, ylabel, title, logy=logy)
    return fig


def _preference_figure(m: Metrics) -> Figure:
    """DPO: reward accuracy (train per step, held-out pairs as points), then the implicit rewards."""
    from matplotlib.ticker import PercentFormatter

    if not (m.has("dpo/reward_accuracy") or m.has("eval/reward_accuracy")):
        raise _Skip(f"no dpo/reward_accuracy or eval/reward_accuracy metrics in {METRICS_FILE}")
    rewards = _present(m, [("dpo/reward_margin", "margin"), ("dpo/chosen_reward", "chosen"),
                           ("dpo/rejected_reward", "rejected"), ("eval/reward_margin", "eval margin")])
    fig, axes = _new_figure(1 + bool(rewards))
    steps, values = m.series("eval/reward_accuracy")
    if len(steps):
        axes[0].scatter(steps, values, color="tab:red", zorder=3, label="held-out pairs")
    _lines(axes[0], m, _present(m, [("dpo/reward_accuracy", "train pairs")]), "accuracy",
           "Reward accuracy: chosen reward > rejected reward (held-out pairs as points)")
    axes[0].set_ylim(-0.03, 1.03)
    axes[0].yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    if rewards:
        _lines(axes[1], m, rewards, "β · log(π / π_ref)", "Implicit rewards (means over the step's pairs)")
    return fig


def _perf_figure(m: Metrics) -> Figure:
    tps = _present(m, [("perf/tokens_per_s", "tokens/s")])
    step = _present(m, [("perf/step_s", "step time")])
    if not (tps or step):
        raise _Skip(f"no perf/tokens_per_s or perf/step_s metrics in {METRICS_FILE}")
    panels = [(c, y, t) for c, y, t in ((tps, "tokens / s", "Throughput"),
                                         (step, "seconds", "Wall time per step")) if c]
    fig, axes = _new_figure(len(panels))
    for ax, (curves, ylabel, title) in zip(axes, panels):
        _lines(ax, m, curves, ylabel, title)
    return fig


def _critic_figure(m: Metrics) -> Figure:
    """Value loss and explained variance over steps (algo.advantage=gae runs), value and return means."""
    loss = _present(m, [("critic/value_loss", "value loss")])
    ev = _present(m, [("critic/explained_variance", "explained variance")])
    if not (loss or ev):
        raise _Skip(f"no critic/value_loss or critic/explained_variance metrics in {METRICS_FILE} (no critic)")
    means = _present(m, [("critic/value_mean", "value mean"), ("critic/return_mean", "return mean")])
    panels = [(c, y, t, log) for c, y, t, log in (
        (loss, "loss", "Critic value loss", True), (ev, "1 - Var(R - V) / Var(R)", "Explained variance", False),
        (means, "value", "Values and returns", False)) if c]
    fig, axes = _new_figure(len(panels))
    for ax, (curves, ylabel, title, logy) in zip(axes, panels):
        _lines(ax, m, curves, ylabel, title, logy=logy)
    return fig


_BY_STALENESS = re.compile(r"^drift/rollout_mismatch_by_staleness/(\d+)$")


def staleness_curve(m: Metrics) -> dict[int, tuple[float, float, float]]:
    """k -> (route mismatch, mean |Δ log p|, tokens), each a token-weighted mean over the steps that
    measured it (`drift/rollout_mismatch_by_staleness/k`, `drift/logp_by_staleness/k/abs_diff`)."""
    out = {}
    for k in sorted(int(g.group(1)) for g in map(_BY_STALENESS.match, m.keys) if g):
        route, n = (f"drift/rollout_mismatch_by_staleness/{k}", f"drift/rollout_mismatch_by_staleness/{k}/num_tokens")
        rows = [(r[route], r.get(f"drift/logp_by_staleness/{k}/abs_diff"), r[n]) for r in m.records
                if _is_number(r.get(route)) and _is_number(r.get(n)) and math.isfinite(r[route]) and r[n] > 0]
        total = sum(w for _, _, w in rows)
        if total:
            logp = [(v, w) for _, v, w in rows if _is_number(v) and math.isfinite(v)]
            out[k] = (sum(v * w for v, _, w in rows) / total,
                      sum(v * w for v, w in logp) / sum(w for _, w in logp) if logp else math.nan, total)
    return out


_VOLATILITY_BY_STALENESS = re.compile(r"^drift/volatility_by_staleness/(\d+)$")


def volatility_curve(m: Metrics) -> dict[int, float]:
    """k -> the mean over the run of `drift/volatility_by_staleness/k` (the trainer's probe-set routes
    k versions apart); 0 at k = 0."""
    out = {}
    for k in sorted(int(g.group(1)) for g in map(_VOLATILITY_BY_STALENESS.match, m.keys) if g):
        values = [r[f"drift/volatility_by_staleness/{k}"] for r in m.records
                  if _is_number(r.get(f"drift/volatility_by_staleness/{k}"))
                  and math.isfinite(r[f"drift/volatility_by_staleness/{k}"])]
        if values:
            out[k] = sum(values) / len(values)
    return {0: 0.0, **out} if out else {}


def _staleness_figure(m: Metrics) -> Figure:
    """How far the routes and log-probs of the trained tokens moved, by versions of staleness."""
    curve, volatility = staleness_curve(m), volatility_curve(m)
    if not curve:
        raise _Skip(f"no drift/rollout_mismatch_by_staleness/k metrics in {METRICS_FILE} (algo.max_staleness=0, "
                    "or no engine routes)")
    ks = list(curve)
    fig, axes = _new_figure(2, ncols=2, width=9.0, height=3.2)
    if volatility:
        axes[0].plot(list(volatility), list(volatility.values()), marker="s", label="trainer vs trainer (probe set)")
    for ax, i, ylabel, title in ((axes[0], 0, "mismatch (1 − overlap / k)", "Routes by staleness"),
                                 (axes[1], 1, "mean |Δ log p|", "Log-prob mismatch")):
        ax.plot(ks, [curve[k][i] for k in ks], marker="o", label="engine vs trainer (trained tokens)")
        ax.set_xticks(ks)
        ax.set_xlabel("staleness: versions behind the trained weights")
        _decorate(ax, ylabel, title)
    return fig


@dataclass(frozen=True)
class _FigureSpec:
    name: str
    title: str
    about: str
    build: Callable[[Metrics], Figure]


_FIGURES = (
    _FigureSpec("reward.png", "reward",
                "reward mean per step (± std band if logged) and train success rate; eval success rate as points.",
                _reward_figure),
    _FigureSpec("volatility_heatmap.png", "routed-expert volatility",
                "volatility per MoE layer (rows) and step (columns): share of each token's top-k experts "
                "that changed across the step's policy updates.",
                _heatmap_figure("drift/volatility", "Routed-expert volatility between updates, per layer",
                                "volatility (1 − overlap / k)")),
    _FigureSpec("probe_volatility_heatmap.png", "probe-set volatility",
                "volatility per MoE layer and step on a fixed probe set: share of each token's top-k experts "
                "that changed since the previous probe.",
                _heatmap_figure("drift/probe_volatility", "Routed-expert volatility on the probe set, per layer",
                                "volatility (1 − overlap / k)")),
    _FigureSpec("preference.png", "preference (DPO)",
                "DPO reward accuracy on the step's pairs and on held-out pairs, and the implicit rewards.",
                _preference_figure),
    _FigureSpec("rollout_mismatch_heatmap.png", "rollout vs trainer routes",
                "route mismatch per MoE layer and step between the rollout engine and the trainer.",
                _heatmap_figure("drift/rollout_mismatch", "Route mismatch, rollout engine vs trainer, per layer",
                                "mismatch (1 − overlap / k)")),
    _FigureSpec("drift.png", "drift",
                "routes over steps (mean volatility, rollout route mismatch, exact-match rate); log-prob "
                "mismatch (k3 KL, mean |Δ log p|, share of ratios outside [1/2, 2]); expert load change.",
                _drift_figure),
    _FigureSpec("staleness.png", "drift by staleness",
                "route and log-prob mismatch between the engine and the trainer on the trained tokens, by how "
                "many weight versions older than the trained ones the weights that generated them were "
                "(algo.max_staleness >= 1), token-weighted over the run; with the trainer's own route "
                "volatility on the probe set between weights k versions apart.",
                _staleness_figure),
    _FigureSpec("loss.png", "loss",
                "clip fractions, each loss/* term (e.g. pg_loss) and the gradient norm over steps.",
                _loss_figure),
    _FigureSpec("perf.png", "throughput",
                "tokens per second and wall time per step.",
                _perf_figure),
    _FigureSpec("critic.png", "critic",
                "the critic's value loss and explained variance (before each step's updates) over steps, "
                "with the mean value and return; only for runs with a critic (algo.advantage=gae).",
                _critic_figure),
)
