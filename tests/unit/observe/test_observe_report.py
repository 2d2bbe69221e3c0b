"""`moe-rl report`: figures from a synthetic metrics.jsonl, graceful skips, CLI exit codes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.observe.report import Metrics, write_report
from moe_rl.observe.sinks import JsonlSink

N_STEPS, N_LAYERS = 20, 4


def _write_run(run_dir: Path, n_steps: int = N_STEPS, layers: int = N_LAYERS, full: bool = True) -> Path:
    sink = JsonlSink(run_dir / "metrics.jsonl")
    for step in range(1, n_steps + 1):
        m = {"reward/mean": 0.2 + 0.03 * step, "reward/success_rate": min(1.0, 0.05 * step)}
        if full:
            m.update({"loss/clip_frac_high": 0.01, "loss/pg_loss": 0.02 * math.sin(step),
                      "train/grad_norm": 1.0 + 0.1 * step, "drift/volatility": 0.1,
                      "drift/rollout_mismatch": 0.05, "drift/volatility/exact_match": 0.7, "drift/logp_k3": 1e-4, "drift/logp_abs_diff": 0.01,
                      "perf/tokens_per_s": 1000.0, "perf/step_s": 5.0})
            m.update({f"drift/volatility/layer_{i:02d}": 0.02 * (i + 1) for i in range(layers)})
            if step % 5 == 0:
                m["eval/success_rate"] = 0.04 * step
            if step == 7:
                m["loss/pg_loss"] = float("nan")  # a bad step must not break the plot
        sink.log(step, m)
    sink.close()
    return run_dir


@pytest.fixture(scope="module")
def full_report(tmp_path_factory):
    run_dir = _write_run(tmp_path_factory.mktemp("run"))
    return run_dir, write_report(run_dir)


def test_report_writes_every_figure(full_report):
    import matplotlib.image

    run_dir, paths = full_report
    names = {p.name for p in paths}
    assert {"reward.png", "volatility_heatmap.png", "drift.png", "loss.png", "perf.png", "index.md"} <= names
    assert paths[-1].name == "index.md"
    for p in paths:
        assert p.parent == run_dir / "report" and p.stat().st_size > 0
    image = matplotlib.image.imread(run_dir / "report" / "volatility_heatmap.png")
    height, width, channels = image.shape
    assert width > height > 100 and channels in (3, 4)  # a wide layer x step map


def test_index_lists_figures_and_notes_skips(full_report):
    run_dir, _ = full_report
    index = (run_dir / "report" / "index.md").read_text()
    assert "[volatility_heatmap.png](volatility_heatmap.png)" in index
    assert "20 steps (1 to 20)" in index
    # no per-layer rollout mismatch in this run: that heatmap is skipped with a reason
    assert "rollout_mismatch_heatmap.png: no drift/rollout_mismatch/layer_NN metrics" in index


def test_index_names_the_moe_layers_shown_and_the_dense_ones_left_out(full_report, tmp_path):
    run_dir, _ = full_report
    index = (run_dir / "report" / "index.md").read_text()
    assert "Per-layer figures: MoE layers 0, 1, 2, 3 (HF decoder-layer indices)." in index  # no config.json
    dense_first = _write_run(tmp_path / "glm")
    (dense_first / "init_model").mkdir()
    (dense_first / "init_model" / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
    write_report(dense_first)
    index = (dense_first / "report" / "index.md").read_text()
    assert "MoE layers 0, 1, 2, 3 (HF decoder-layer indices); dense layers 4, 5 route nothing" in index


def test_missing_keys_skip_plots(tmp_path):
    run_dir = _write_run(tmp_path / "run", n_steps=5, full=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "loss.png").write_bytes(b"from an older report")
    paths = write_report(run_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "loss.png").exists()  # a stale figure would not match the metrics
    assert [p.name for p in paths] == ["reward.png", "index.md"]
    index = (tmp_path / "out" / "index.md").read_text()
    for skipped in ("volatility_heatmap.png", "drift.png", "loss.png", "perf.png"):
        assert f"- {skipped}: no " in index


def test_metrics_layers_and_resumed_steps():
    records = [{"step": 1, "a": 1.0},
               {"step": 2, "a": float("inf"), "drift/volatility/layer_10": 0.1, "drift/volatility/layer_2": 0.2},
               {"step": 1, "a": 5.0}]  # step 1 redone after a resume: the later record wins
    m = Metrics(records)
    assert list(m.layers("drift/volatility")) == [2, 10]
    steps, values = m.series("a")
    assert steps.tolist() == [1.0, 2.0] and values[0] == 5.0 and math.isnan(values[1])


def test_cli_report_exit_codes(tmp_path, capsys):
    run_dir = _write_run(tmp_path / "run", n_steps=3, full=False)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "reward.png").stat().st_size > 0
    assert "skipped" in capsys.readouterr().out

    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "run directory not found" in capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (empty / "metrics.jsonl").write_text("")
    assert main(["report", str(empty)]) == 2
    assert "no metric records" in capsys.readouterr().err


def test_report_of_crashed_run_with_truncated_line(tmp_path):
    run_dir = _write_run(tmp_path, n_steps=4, full=False)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "reward/mean": 0.9})[:12])
    assert [p.name for p in write_report(run_dir)] == ["reward.png", "index.md"]


def test_report_of_a_dpo_run(tmp_path):
    """A run without RL metrics: preference and probe-volatility figures, RL figures skipped, no crash."""
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in range(1, 11):
        m = {"loss/dpo": 0.69 - 0.03 * step, "dpo/reward_accuracy": 0.05 * step, "dpo/reward_margin": 0.1 * step,
             "dpo/chosen_reward": 0.05 * step, "dpo/rejected_reward": -0.05 * step, "perf/grad_norm": 1.0,
             "drift/probe_volatility": 0.1, "perf/tokens_per_s": 2000.0}
        m.update({f"drift/probe_volatility/layer_{i:02d}": 0.02 * (i + 1) for i in range(N_LAYERS)})
        if step % 5 == 0:
            m["eval/reward_accuracy"] = 0.08 * step
        sink.log(step, m)
    sink.close()
    names = {p.name for p in write_report(tmp_path)}
    assert {"preference.png", "probe_volatility_heatmap.png", "drift.png", "loss.png", "perf.png"} <= names
    assert "reward.png" not in names and "volatility_heatmap.png" not in names
    index = (tmp_path / "report" / "index.md").read_text()
    assert "reward.png" in index  # listed as skipped, with its reason


def test_drift_by_staleness_is_token_weighted_over_the_run(tmp_path):
    from moe_rl.observe.report import staleness_curve

    def row(step, k, mismatch, logp, n):
        return {f"drift/rollout_mismatch_by_staleness/{k}": mismatch, f"drift/logp_by_staleness/{k}/abs_diff": logp,
                f"drift/rollout_mismatch_by_staleness/{k}/num_tokens": n}

    records = [{"step": 1, **row(1, 0, 0.0, 0.0, 100), **row(1, 1, float("nan"), float("nan"), 0)},
               {"step": 2, **row(2, 0, 0.1, 0.2, 100), **row(2, 1, 0.3, 0.4, 300)},
               {"step": 3, **row(3, 1, 0.5, 0.6, 100)}]
    records[1]["drift/volatility_by_staleness/1"], records[2]["drift/volatility_by_staleness/1"] = 0.2, 0.4
    records[2]["drift/volatility_by_staleness/2"] = float("nan")  # not measured yet: left out
    curve = staleness_curve(Metrics(records))
    assert curve[0] == pytest.approx((0.05, 0.1, 200)) and curve[1] == pytest.approx((0.35, 0.45, 400))
    from moe_rl.observe.report import volatility_curve

    assert volatility_curve(Metrics(records)) == pytest.approx({0: 0.0, 1: 0.3})
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for r in records:
        sink.log(r["step"], {k: v for k, v in r.items() if k != "step"})
    sink.close()
    written = {p.name for p in write_report(tmp_path)}
    assert "staleness.png" in written


def test_drift_by_turn_is_token_weighted_over_the_run_and_drawn(tmp_path):
    from moe_rl.observe.report_drift import turn_curve

    def row(t, vol, mismatch, logp, n, n_mismatch):
        return {f"drift/volatility_by_turn/{t}": vol, f"drift/volatility_by_turn/{t}/num_tokens": n,
                f"drift/rollout_mismatch_by_turn/{t}": mismatch,
                f"drift/rollout_mismatch_by_turn/{t}/num_tokens": n_mismatch, f"drift/logp_by_turn/{t}/abs_diff": logp}

    records = [{"step": 1, **row(0, 0.1, 0.0, 1e-7, 100, 100), **row(1, float("nan"), float("nan"), float("nan"), 0, 0)},
               {"step": 2, **row(0, 0.3, 0.2, 3e-7, 300, 100), **row(1, 0.5, 0.4, 5e-7, 50, 50)}]
    curve = turn_curve(Metrics(records))
    assert curve[0] == pytest.approx({"volatility": 0.25, "mismatch": 0.1, "logp": 2.5e-7})
    assert curve[1] == pytest.approx({"volatility": 0.5, "mismatch": 0.4, "logp": 5e-7})  # the empty step left out
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for r in records:
        sink.log(r["step"], {k: v for k, v in r.items() if k != "step"})
    sink.close()
    assert "turns.png" in {p.name for p in write_report(tmp_path)}


def test_the_reward_band_of_a_0_1_reward_stays_inside_0_and_1():
    """mean ± std of a 0/1 reward runs past 0 and 1 (mean 0.1, std 0.3); drawn within the step's min
    and max, the band ends at them."""
    import numpy as np

    from moe_rl.observe.report_train import reward_figure

    records = [{"step": s, "reward/mean": p, "reward/std": math.sqrt(p * (1 - p)), "reward/min": 0.0,
                "reward/max": 1.0} for s, p in ((1, 0.1), (2, 0.5), (3, 0.9))]
    fig = reward_figure(Metrics(records))
    (band,) = fig.axes[0].collections
    ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
    assert ys.min() == pytest.approx(0.0) and ys.max() == pytest.approx(1.0)
    without = reward_figure(Metrics([{k: v for k, v in r.items() if k not in ("reward/min", "reward/max")}
                                     for r in records]))  # older runs: the band as it was
    ys = np.concatenate([p.vertices[:, 1] for p in without.axes[0].collections[0].get_paths()])
    assert ys.min() < -0.1 and ys.max() > 1.1


@pytest.mark.parametrize("measured", [4, 40])
def test_heatmap_ticks_sit_on_the_steps_drift_was_measured_at(measured):
    from moe_rl.observe.report_drift import heatmap_figure

    records = [{"step": s, "drift/volatility/layer_01": 0.1, "drift/volatility/layer_02": 0.2}
               for s in range(5, 5 * measured + 1, 5)]
    fig = heatmap_figure("drift/volatility", "t", "share", "zero")(Metrics(records))
    ticks = list(fig.axes[0].get_xticks())
    assert set(ticks) <= set(range(5, 5 * measured + 1, 5)) and 2 <= len(ticks) <= 10, ticks
    if measured == 4:
        assert ticks == [5, 10, 15, 20]


def test_side_by_side_panels_keep_their_legends_inside_and_their_labels_on_the_figure():
    """staleness.png and turns.png: two panels side by side; a legend outside the left one pushed the
    right one away (a wide gap) and clipped the x-labels. Each legend is inside its axes, every
    x-label inside the figure, and the gap between the panels under a tenth of the width."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from moe_rl.observe.report_drift import staleness_figure, turns_figure

    stale = [{"step": s, f"drift/rollout_mismatch_by_staleness/{k}": 0.1 * k, f"drift/logp_by_staleness/{k}/abs_diff": 0.01,
              f"drift/rollout_mismatch_by_staleness/{k}/num_tokens": 10, f"drift/volatility_by_staleness/{k}": 0.05 * k}
             for s in (1, 2) for k in (0, 1, 2)]
    turns = [{"step": 1}]
    for t in (0, 1):
        turns[0] |= {f"drift/volatility_by_turn/{t}": 0.1, f"drift/volatility_by_turn/{t}/num_tokens": 10,
                     f"drift/rollout_mismatch_by_turn/{t}": 0.0, f"drift/rollout_mismatch_by_turn/{t}/num_tokens": 10,
                     f"drift/logp_by_turn/{t}/abs_diff": 1e-7}
    for fig in (staleness_figure(Metrics([{k: v for r in stale if r["step"] == s for k, v in r.items()}
                                          for s in (1, 2)])), turns_figure(Metrics(turns))):
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer, whole = canvas.get_renderer(), fig.bbox
        left, right = fig.axes[0], fig.axes[1]
        legend = left.get_legend()
        assert legend is not None
        inside = legend.get_window_extent(renderer)
        box = left.get_window_extent(renderer)
        assert box.x0 <= inside.x0 and inside.x1 <= box.x1 + 1, (inside, box)
        for ax in fig.axes:
            label = ax.xaxis.label.get_window_extent(renderer)
            assert whole.x0 <= label.x0 and label.x1 <= whole.x1 and label.y0 >= whole.y0, ax.get_xlabel()
        assert right.get_window_extent(renderer).x0 - box.x1 < 0.1 * whole.width
