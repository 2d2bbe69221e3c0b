"""The report's building blocks: metrics.jsonl records as per-key series (`Metrics`), and the
drawing helpers that every figure of `moe_rl.observe.report` uses (panels, curves, legends)."""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from moe_rl.observe.sinks import METRICS_FILE

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["METRICS_FILE", "Metrics", "Skip", "decorate", "first_present", "is_number", "lines", "new_figure",
           "present"]

_LAYER_KEY = re.compile(r"^(?P<prefix>.+)/layer_(?P<layer>\d+)$")


class Skip(Exception):
    """Raised by a figure builder when the metrics it needs are absent."""


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
        pairs = [(s, finite_or_nan(r[key])) for s, r in zip(self.steps, self.records)
                 if is_number(r.get(key))]
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


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_or_nan(value: float) -> float:
    # inf would break autoscaling; drawing it as a gap shows the bad step as well.
    return float(value) if math.isfinite(value) else math.nan


# --------------------------------------------------------------------------
# Drawing helpers
# --------------------------------------------------------------------------

def new_figure(panels: int, ncols: int = 1, width: float = 9.0, height: float = 2.8) -> tuple[Figure, list[Axes]]:
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


def lines(ax: Axes, metrics: Metrics, curves: Sequence[tuple[str, str]], ylabel: str,
           title: str, logy: bool = False) -> None:
    """Plot each (key, label) present in `metrics` on `ax`, with labels, grid and a legend."""
    for key, label in curves:
        steps, values = metrics.series(key)
        if len(steps):
            ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=label)
    if logy and spans_decades(ax):
        ax.set_yscale("log")
    decorate(ax, ylabel, title)


def decorate(ax: Axes, ylabel: str, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:  # one curve is named by the title
        spec = ax.get_subplotspec()
        if spec is not None and spec.get_gridspec().ncols > 1:
            # Side by side, a legend outside one panel would push the next away (a wide gap): inside,
            # where the curves leave room, half transparent.
            ax.legend(fontsize=8, loc="best", framealpha=0.7)
        else:  # one column: outside the axes, on the right, where it hides no curve
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def spans_decades(ax: Axes) -> bool:
    """True when the plotted values are positive and span more than a factor 20: a log axis reads better."""
    ys = [np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()]
    values = np.concatenate(ys) if ys else np.empty(0)
    values = values[np.isfinite(values)]
    return values.size > 0 and bool((values > 0).all()) and values.max() > 20 * values.min()


def present(metrics: Metrics, curves: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, label) for k, label in curves if metrics.has(k)]


def first_present(m: Metrics, keys: Sequence[str], label: str) -> list[tuple[str, str]]:
    """[(key, label)] for the first of several alternative names that the run logged, else []."""
    return next(([(k, label)] for k in keys if m.has(k)), [])
