"""The report's critic figure: drawn when a run logged critic metrics, skipped with a reason otherwise."""
from __future__ import annotations

from moe_rl.observe.report import write_report
from moe_rl.observe.sinks import JsonlSink


def _run(run_dir, critic: bool):
    sink = JsonlSink(run_dir / "metrics.jsonl")
    for step in range(1, 9):
        m = {"reward/mean": 0.1 * step}
        if critic:
            m |= {"critic/value_loss": 0.5 / step, "critic/explained_variance": 1 - 1 / step,
                  "critic/value_mean": 0.1 * step, "critic/return_mean": 0.11 * step}
        sink.log(step, m)
    sink.close()
    return run_dir


def test_critic_figure_only_with_critic_metrics(tmp_path):
    with_critic = write_report(_run(tmp_path / "gae", critic=True))
    assert "critic.png" in {p.name for p in with_critic}
    assert (tmp_path / "gae" / "report" / "critic.png").stat().st_size > 0
    without = write_report(_run(tmp_path / "grpo", critic=False))
    assert "critic.png" not in {p.name for p in without}
    assert "- critic.png: no critic/value_loss" in (tmp_path / "grpo" / "report" / "index.md").read_text()
