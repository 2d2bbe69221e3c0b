"""The report's routing figures: per-layer heatmaps (volatility, rollout mismatch), drift over steps,
and drift by staleness."""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Callable

import numpy as np

from moe_rl.observe.report_draw import (METRICS_FILE, Metrics, Skip, decorate, first_present, is_number, lines,
                                       new_figure, present)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["drift_figure", "heatmap_figure", "staleness_curve", "staleness_figure", "volatility_curve"]


def heatmap_figure(prefix: str, title: str, cbar_label: str, zero_note: str) -> Callable[[Metrics], Figure]:
    """A builder of a layer × step heatmap from the `<prefix>/layer_NN` keys: a share in [0, 1], so the
    colour scale starts at 0; a map that is 0 in every measured cell says so with `zero_note` under its title."""

    def build(m: Metrics) -> Figure:
        layers = m.layers(prefix)
        if not layers:
            raise Skip(f"no {prefix}/layer_NN metrics in {METRICS_FILE}")
        steps, grid = _layer_grid(m, layers)
        fig, (ax,) = new_figure(1, height=max(3.0, min(0.22 * len(layers), 9.0)))
        _heatmap(fig, ax, steps, list(layers), grid, cbar_label)
        measured = grid[np.isfinite(grid)]
        all_zero = measured.size > 0 and not measured.any()
        ax.set_title(f"{title}\n{zero_note}" if all_zero else title, fontsize=10)
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
    # From 0 (no expert changed) up: the largest value, or 0.1 for a map of zeros (else the colour
    # scale of a constant map would be centred on it, with negative shares below).
    finite = grid[np.isfinite(grid)]
    vmax = float(finite.max()) if finite.size and finite.max() > 0 else 0.1
    mesh = ax.pcolormesh(_edges(steps), _edges(np.array(layers, dtype=float)),
                         np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=vmax, shading="flat")
    fig.colorbar(mesh, ax=ax, label=cbar_label)
    ax.set_ylabel("MoE layer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(len(layers), 16)))
    # ticks on measured steps (drift every k steps: 5, 10, 15, not a locator's 6, 12, 18), at most ~10
    ax.set_xticks(steps[::max(1, math.ceil(len(steps) / 10))])


def _edges(centres: np.ndarray) -> np.ndarray:
    if len(centres) == 1:
        return np.array([centres[0] - 0.5, centres[0] + 0.5])
    mids = (centres[1:] + centres[:-1]) / 2
    return np.concatenate([[2 * centres[0] - mids[0]], mids, [2 * centres[-1] - mids[-1]]])


def drift_figure(m: Metrics) -> Figure:
    # (curves, y label, title, log scale): one panel per quantity with its own units
    exact = first_present(m, ("drift/volatility/exact_match", "drift/exact_match"),
                           "exact top-k set match, between updates")
    panels = [
        (present(m, [("drift/volatility", "step's tokens, across the step's updates (volatility)"),
                      ("drift/volatility_per_update", "probe set, per optimizer update"),
                      ("drift/probe_volatility", "probe set, between probes"),
                      ("drift/rollout_mismatch", "rollout engine vs trainer (mismatch)")]) + exact
         + present(m, [("drift/volatility/tokens_changed_any_layer", "tokens changed in any layer")]),
         "share", "Expert routes: share of top-k experts changed", False),
        (present(m, [("drift/logp_k3", "k3 KL"), ("drift/logp_abs_diff", "mean |Δ log p|")]),
         "mismatch", "Log-prob mismatch, rollout engine vs trainer", True),
        (present(m, [("drift/logp_ratio_outside", "p_train / p_rollout outside [1/2, 2]")]),
         "share of tokens", "Tokens whose probability ratio is outside [1/2, 2]", False),
        (present(m, [("drift/load_change", "expert load change")]),
         "total variation", "Expert load change between steps", False),
        (present(m, [("drift/route_margin", "k-th minus (k+1)-th router logit")]),
         "logit margin", "Routing confidence: low margins are where routes flip", False),
        (present(m, [("drift/route_gate_mass", "softmax mass of the top-k experts")]),
         "share", "Routing confidence: top-k gate mass", False),
    ]
    panels = [p for p in panels if p[0]]
    if not panels:
        raise Skip(f"no drift/volatility, drift/probe_volatility, drift/rollout_mismatch or drift/logp_* metrics "
                    f"in {METRICS_FILE}")
    fig, axes = new_figure(len(panels))
    for ax, (curves, ylabel, title, logy) in zip(axes, panels):
        lines(ax, m, curves, ylabel, title, logy=logy)
    return fig


_BY_STALENESS = re.compile(r"^drift/rollout_mismatch_by_staleness/(\d+)$")


def staleness_curve(m: Metrics) -> dict[int, tuple[float, float, float]]:
    """k -> (route mismatch, mean |Δ log p|, tokens), each a token-weighted mean over the steps that
    measured it (`drift/rollout_mismatch_by_staleness/k`, `drift/logp_by_staleness/k/abs_diff`)."""
    out = {}
    for k in sorted(int(g.group(1)) for g in map(_BY_STALENESS.match, m.keys) if g):
        route, n = (f"drift/rollout_mismatch_by_staleness/{k}", f"drift/rollout_mismatch_by_staleness/{k}/num_tokens")
        rows = [(r[route], r.get(f"drift/logp_by_staleness/{k}/abs_diff"), r[n]) for r in m.records
                if is_number(r.get(route)) and is_number(r.get(n)) and math.isfinite(r[route]) and r[n] > 0]
        total = sum(w for _, _, w in rows)
        if total:
            logp = [(v, w) for _, v, w in rows if is_number(v) and math.isfinite(v)]
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
                  if is_number(r.get(f"drift/volatility_by_staleness/{k}"))
                  and math.isfinite(r[f"drift/volatility_by_staleness/{k}"])]
        if values:
            out[k] = sum(values) / len(values)
    return {0: 0.0, **out} if out else {}


def staleness_figure(m: Metrics) -> Figure:
    """How far the routes and log-probs of the trained tokens moved, by versions of staleness."""
    curve, volatility = staleness_curve(m), volatility_curve(m)
    if not curve:
        raise Skip(f"no drift/rollout_mismatch_by_staleness/k metrics in {METRICS_FILE} (algo.max_staleness=0, "
                    "or no engine routes)")
    ks = list(curve)
    fig, axes = new_figure(2, ncols=2, width=9.0, height=3.2)
    if volatility:
        axes[0].plot(list(volatility), list(volatility.values()), marker="s", label="trainer vs trainer (probe set)")
    for ax, i, ylabel, title in ((axes[0], 0, "mismatch (1 − overlap / k)", "Routes by staleness"),
                                 (axes[1], 1, "mean |Δ log p|", "Log-prob mismatch")):
        ax.plot(ks, [curve[k][i] for k in ks], marker="o", label="engine vs trainer (trained tokens)")
        ax.set_xticks(ks)
        ax.set_xlabel("staleness: versions behind the trained weights")
        decorate(ax, ylabel, title)
    return fig


_BY_TURN = re.compile(r"^drift/volatility_by_turn/(\d+)$")


def turn_curve(m: Metrics) -> dict[int, dict[str, float]]:
    """Episode turn t -> token-weighted means over the run of the step's volatility, the engine-vs-
    trainer route mismatch and mean |Δ log p| of turn t's tokens (`drift/*_by_turn/t`)."""
    out: dict[int, dict[str, float]] = {}
    for t in sorted(int(g.group(1)) for g in map(_BY_TURN.match, m.keys) if g):
        row = {}
        for name, key in (("volatility", f"drift/volatility_by_turn/{t}"),
                          ("mismatch", f"drift/rollout_mismatch_by_turn/{t}"),
                          ("logp", f"drift/logp_by_turn/{t}/abs_diff")):
            weight = f"drift/volatility_by_turn/{t}/num_tokens" if name != "mismatch" else f"{key}/num_tokens"
            pairs = [(r[key], r[weight]) for r in m.records if is_number(r.get(key)) and is_number(r.get(weight))
                     and math.isfinite(r[key]) and r[weight] > 0]
            total = sum(w for _, w in pairs)
            if total:
                row[name] = sum(v * w for v, w in pairs) / total
        if row:
            out[t] = row
    return out


def turns_figure(m: Metrics) -> Figure:
    """How far routes and log-probs move by episode turn (multi-turn rollouts)."""
    curve = turn_curve(m)
    if not curve:
        raise Skip(f"no drift/volatility_by_turn/t metrics in {METRICS_FILE} (no rollout.env, or drift off)")
    turns = list(curve)
    fig, axes = new_figure(2, ncols=2, width=11.0, height=3.4)
    for name, label in (("volatility", "trainer before vs after the updates"),
                        ("mismatch", "engine vs trainer")):
        if any(name in curve[t] for t in turns):
            axes[0].plot(turns, [curve[t].get(name, math.nan) for t in turns], marker="o", label=label)
    axes[1].plot(turns, [curve[t].get("logp", math.nan) for t in turns], marker="o", label="engine vs trainer")
    for ax, ylabel, title in ((axes[0], "1 − overlap / k", "Routes by episode turn"),
                              (axes[1], "mean |Δ log p|", "Log-prob mismatch by turn")):
        ax.set_xticks(turns)
        ax.set_xlabel("turn of the episode (0 = the first model turn)")
        decorate(ax, ylabel, title)
    return fig
