"""What the report's figures show a reader: the loss figure without bookkeeping series (those go to a
table in index.md), heatmaps of shares scaled from 0 with a note on an all-zero map, the step time split
into its phases."""
from __future__ import annotations

from moe_rl.observe.report import Metrics, write_report
from moe_rl.observe.report_drift import heatmap_figure
from moe_rl.observe.report_train import loss_figure, perf_figure, phase_keys
from moe_rl.observe.sinks import JsonlSink

BOOKKEEPING = ("loss/num_seqs", "loss/num_tokens", "loss/adv_mean", "loss/adv_std", "perf/lr")


def _rl_records(n: int = 6, mismatch: float = 0.0) -> list[dict]:
    records = []
    for step in range(1, n + 1):
        r = {"step": step, "loss/pg_loss": 0.01 / step, "loss/clip_frac_high": 0.05, "loss/approx_kl": 1e-3 / step,
             "loss/ratio_mean": 1.0, "loss/ratio_min": 0.8, "loss/ratio_max": 1.3, "loss/num_seqs": 144.0,
             "loss/num_tokens": 144.0 + step, "loss/adv_mean": 1e-8, "loss/adv_std": 0.9, "perf/lr": 1e-3,
             "perf/grad_norm": 0.7, "perf/rollout_s": 0.1, "perf/old_logprobs_s": 0.05, "perf/updates_s": 0.2,
             "perf/step_s": 0.36, "perf/tokens_per_s": 2000.0}
        r.update({f"drift/rollout_mismatch/layer_{i:02d}": mismatch * i for i in range(3)})
        records.append(r)
    return records


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_visible()]


def test_loss_figure_shows_what_a_run_is_judged_by_not_bookkeeping():
    fig = loss_figure(Metrics(_rl_records()))
    titles = " | ".join(_titles(fig))
    for key in BOOKKEEPING:
        assert key not in titles and key.split("/")[-1] not in titles
    assert "Policy loss (loss/pg_loss)" in titles and "Clip fractions" in titles
    assert "Importance ratio" in titles and "KL" in titles and "Gradient norm" in titles
    labels = {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
    assert {"ratio_mean", "ratio_min", "ratio_max"} <= labels and not labels & {"num_seqs", "adv_mean"}


def test_index_has_a_bookkeeping_table(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for r in _rl_records():
        sink.log(r["step"], {k: v for k, v in r.items() if k != "step"})
    sink.close()
    write_report(tmp_path)
    index = (tmp_path / "report" / "index.md").read_text()
    assert "## Bookkeeping" in index and "| series | first | last | min | max |" in index
    assert "| `loss/num_tokens` | 145 | 150 | 145 | 150 |" in index
    for key in BOOKKEEPING:
        assert f"| `{key}` |" in index
    assert "| `loss/pg_loss` |" not in index


def _mismatch_map(records):
    return heatmap_figure("drift/rollout_mismatch", "Route mismatch", "mismatch\n0 = same experts",
                          "0 everywhere: engine and trainer chose the same experts")(Metrics(records))


def test_all_zero_mismatch_map_scales_from_zero_and_says_what_zero_means():
    fig = _mismatch_map(_rl_records(mismatch=0.0))
    mesh = fig.axes[0].collections[0]
    assert mesh.norm.vmin == 0.0 and mesh.norm.vmax > 0.0  # not a −0.1…0.1 scale around the constant
    assert "0 everywhere: engine and trainer chose the same experts" in fig.axes[0].get_title()
    assert "0 = same experts" in fig.axes[1].get_ylabel()  # the colorbar


def test_nonzero_mismatch_map_scales_from_zero_to_its_largest_value():
    fig = _mismatch_map(_rl_records(mismatch=0.1))
    mesh = fig.axes[0].collections[0]
    assert mesh.norm.vmin == 0.0 and abs(mesh.norm.vmax - 0.2) < 1e-12
    assert "0 everywhere" not in fig.axes[0].get_title()


def test_perf_figure_stacks_the_step_phases():
    m = Metrics(_rl_records())
    assert phase_keys(m) == ["perf/rollout_s", "perf/old_logprobs_s", "perf/updates_s"]  # not step_s, not tokens/s
    fig = perf_figure(m)
    phase_ax = next(ax for ax in fig.axes if "by phase" in ax.get_title())
    assert len(phase_ax.containers) == 3  # one bar series per phase
    rollout, old_logprobs, _ = phase_ax.containers
    assert old_logprobs[0].get_y() == rollout[0].get_height()  # stacked on the phase below
    assert "Throughput" in _titles(fig)


def test_perf_figure_without_phases_keeps_the_step_time_line():
    records = [{"step": s, "perf/step_s": 1.0, "perf/tokens_per_s": 10.0} for s in (1, 2)]
    fig = perf_figure(Metrics(records))
    assert _titles(fig) == ["Throughput", "Wall time per step"] and not fig.axes[1].containers
