"""Progress: one plain line per step without a terminal, a live view with one."""
from __future__ import annotations

import io

from rich.console import Console

from moe_rl.observe.progress import Progress, format_step_line


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _metrics(step: int) -> dict[str, float]:
    return {"reward/mean": 0.5, "reward/success_rate": 0.25, "drift/volatility": 0.08,
            "perf/tokens_per_s": 1234.0, "perf/step_s": 10.0, "loss/pg_loss": 0.1, "step": step}


def test_plain_mode_prints_one_line_per_step(capsys):
    clock = FakeClock()
    progress = Progress(10, enabled=True, clock=clock)  # captured stdout is not a terminal
    assert not progress.live
    with progress:
        for step in (1, 2, 3):
            progress.status("rollout")
            progress.status("train")  # phases print nothing in plain mode
            progress.update(step, _metrics(step))
            clock.now += 10.0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/10")
    for text in ("reward 0.500", "success 25.0%", "vol 0.080", "1,234 tok/s", "10.0 s/step"):
        assert text in lines[2]
    # first step: ETA from its own step time (9 x 10 s); later: measured 10 s per step
    assert lines[0].endswith("ETA 0:01:30")
    assert lines[2].endswith("ETA 0:01:10")


def test_disabled_progress_prints_nothing(capsys):
    progress = Progress(5, enabled=False)
    progress.status("rollout")
    progress.update(1, _metrics(1))
    progress.close()
    assert capsys.readouterr().out == ""


def test_line_skips_missing_and_shows_non_finite_metrics():
    line = format_step_line(4, 8, {"reward/mean": float("nan"), "eval/success_rate": 0.5}, None)
    assert line == "step 4/8 | reward nan | eval 50.0%"


def test_live_view_renders_numbers_and_phase():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with Progress(4, console=console, clock=FakeClock()) as progress:
        assert progress.live
        progress.status("sync")
        progress.update(2, _metrics(2))
    out = buf.getvalue()
    assert "step 2/4" in out and "reward 0.500" in out and "[sync]" in out and "50%" in out


def test_dpo_line_shows_loss_and_reward_accuracy():
    metrics = {"loss/dpo": 0.6270, "dpo/reward_accuracy": 0.6667, "eval/reward_accuracy": 0.8267,
               "perf/tokens_per_s": 4536.0, "perf/step_s": 0.09}
    line = format_step_line(12, 200, metrics, None)
    assert line == "step 12/200 | loss 0.627 | acc 66.7% | eval acc 82.7% | 4,536 tok/s | 0.1 s/step"
