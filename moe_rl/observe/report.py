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
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moe_rl.observe.logging import get_logger
from moe_rl.observe.report_draw import Metrics, Skip
from moe_rl.observe.report_drift import (drift_figure, heatmap_figure, staleness_curve, staleness_figure, turns_figure,
                                        volatility_curve)
from moe_rl.observe.report_health import AlarmSettings, health_figure, health_lines, read_alarm_settings
from moe_rl.observe.report_train import (bookkeeping_table, critic_figure, loss_figure, perf_figure,
                                        preference_figure, reward_figure)
from moe_rl.observe.sinks import METRICS_FILE, latest_history, read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["FigureResult", "Metrics", "ReportError", "add_arguments", "build_report", "run", "staleness_curve",
           "volatility_curve", "write_report"]

log = get_logger(__name__)

REPORT_DIR = "report"
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
    """Write the report; exit code 2 with a one-line reason when there is nothing to plot."""
    try:
        results = build_report(args.run_dir, args.out)
    except ReportError as e:
        print(f"moe-rl report: error: {e}", file=sys.stderr)
        return 2
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


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the report of `run_dir` into `out_dir` (default `run_dir/report`).

    Returns the paths written: the PNG figures, then index.md. Skipped figures
    are listed in index.md and logged. Raises ReportError when `run_dir` or its
    metrics.jsonl is missing or holds no records.
    """
    results = build_report(run_dir, out_dir)
    for r in results:
        if r.skipped:
            log.debug("report: %s skipped: %s", r.name, r.skipped)  # index.md lists them
    return [r.path for r in results if r.path is not None]


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[FigureResult]:
    """Like `write_report`, but returns every figure with its outcome; index.md comes last."""
    run_dir = Path(run_dir)
    metrics = _load(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    name = run_dir.resolve().name  # "." names the run too
    alarms = read_alarm_settings(run_dir)
    results = [_draw(spec, metrics, out, name) for spec in (_health_spec(alarms), *_FIGURES)]
    index = out / "index.md"
    index.write_text(_index_markdown(name, metrics, results, _layers_line(run_dir, metrics),
                                     health_lines(metrics, alarms)), encoding="utf-8")
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
    except Skip as reason:
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


def _layers_line(run_dir: Path, metrics: Metrics) -> str:
    """Which decoder layers the per-layer figures show (the MoE layers, by HF index) and which they
    leave out (dense layers route nothing), from the run's initial model's config.json when it has one."""
    moe = sorted({i for prefix in ("drift/volatility", "drift/rollout_mismatch", "drift/probe_volatility")
                  for i in metrics.layers(prefix)})
    if not moe:
        return ""
    line = f"Per-layer figures: MoE layers {', '.join(map(str, moe))} (HF decoder-layer indices)"
    try:
        total = int(json.loads((run_dir / "init_model" / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return line + "."
    dense = [i for i in range(total) if i not in moe]
    if not dense:
        return line + "."
    said = f"dense layer {dense[0]} routes" if len(dense) == 1 else f"dense layers {', '.join(map(str, dense))} route"
    return f"{line}; {said} nothing and {'is' if len(dense) == 1 else 'are'} left out."


def _index_markdown(run_name: str, metrics: Metrics, results: list[FigureResult], layers: str = "",
                    health: list[str] | None = None) -> str:
    steps = metrics.steps
    lines = [f"# Report: {run_name}", "",
             f"{len(steps)} steps ({int(steps[0])} to {int(steps[-1])}) from `{METRICS_FILE}`.", ""]
    if health:  # what a reader should look at first
        lines += ["## MoE health ([health.png](health.png))", "", *health, ""]
    lines += [layers, ""] if layers else []
    lines += ["## Figures", ""]
    lines += [f"- [{r.name}]({r.name}): {r.about}" for r in results if r.path]
    skipped = [r for r in results if r.skipped]
    if skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- {r.name}: {r.skipped}" for r in skipped]
    table = bookkeeping_table(metrics)
    if table:
        lines += ["", "## Bookkeeping", "",
                  "Series that say how large each step was rather than how it went; not plotted.", ""] + table
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _FigureSpec:
    name: str
    title: str
    about: str
    build: Callable[[Metrics], Figure]


def _health_spec(alarms: AlarmSettings) -> _FigureSpec:
    """The first figure: its builder draws the run's own alarm thresholds (from its config.yaml)."""
    return _FigureSpec("health.png", "MoE health",
                       "read first: R3 coverage, engine-vs-trainer route flips and the tokens masked for them, "
                       "expert-load violation, and the steps past each drift.alarm threshold the run set.",
                       health_figure(alarms))


_FIGURES = (
    _FigureSpec("reward.png", "reward",
                "reward mean per step (± std band if logged) and train success rate; eval success rate as points.",
                reward_figure),
    _FigureSpec("volatility_heatmap.png", "routed-expert volatility",
                "volatility per MoE layer (rows) and step (columns): share of each token's top-k experts "
                "that changed across the step's policy updates.",
                heatmap_figure("drift/volatility", "Routed-expert volatility between updates, per layer",
                               "volatility (1 − overlap / k)\n0 = routes unchanged",
                               "0 everywhere: no token's experts changed between updates")),
    _FigureSpec("probe_volatility_heatmap.png", "probe-set volatility",
                "volatility per MoE layer and step on a fixed probe set: share of each token's top-k experts "
                "that changed since the previous probe.",
                heatmap_figure("drift/probe_volatility", "Routed-expert volatility on the probe set, per layer",
                               "volatility (1 − overlap / k)\n0 = routes unchanged",
                               "0 everywhere: no probe token's experts changed between probes")),
    _FigureSpec("preference.png", "preference (DPO)",
                "DPO reward accuracy on the step's pairs and on held-out pairs, and the implicit rewards.",
                preference_figure),
    _FigureSpec("rollout_mismatch_heatmap.png", "rollout vs trainer routes",
                "route mismatch per MoE layer and step between the rollout engine and the trainer "
                "(0 = both chose the same experts; the colour scale starts at 0).",
                heatmap_figure("drift/rollout_mismatch", "Route mismatch, rollout engine vs trainer, per layer",
                               "mismatch (1 − overlap / k)\n0 = same experts",
                               "0 everywhere: engine and trainer chose the same experts")),
    _FigureSpec("drift.png", "drift",
                "routes over steps (mean volatility, rollout route mismatch, exact-match rate); log-prob "
                "mismatch (k3 KL, mean |Δ log p|, share of ratios outside [1/2, 2]); expert load change.",
                drift_figure),
    _FigureSpec("staleness.png", "drift by staleness",
                "route and log-prob mismatch between the engine and the trainer on the trained tokens, by how "
                "many weight versions older than the trained ones the weights that generated them were "
                "(algo.max_staleness >= 1), token-weighted over the run; with the trainer's own route "
                "volatility on the probe set between weights k versions apart.",
                staleness_figure),
    _FigureSpec("turns.png", "drift by episode turn",
                "multi-turn rollouts (rollout.env): the routed-expert volatility of each turn's tokens across the "
                "step's updates, the engine-vs-trainer route mismatch and log-prob mismatch, by turn of the "
                "episode, token-weighted over the run.",
                turns_figure),
    _FigureSpec("loss.png", "loss",
                "the loss terms (e.g. pg_loss, dpo), clip fractions, the importance ratio (mean, min, max), "
                "KL and entropy where logged, and the gradient norm over steps; bookkeeping series (counts, "
                "the normalised advantages' mean and std, lr) are in index.md's bookkeeping table instead.",
                loss_figure),
    _FigureSpec("perf.png", "throughput and step time",
                "tokens per second, and the wall time per step split into its phases (perf/<phase>_s stacked; "
                "the step total as a line).",
                perf_figure),
    _FigureSpec("critic.png", "critic",
                "the critic's value loss and explained variance (before each step's updates) over steps, "
                "with the mean value and return; only for runs with a critic (algo.advantage=gae).",
                critic_figure),
)
