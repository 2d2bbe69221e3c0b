"""The `train` and `model` sections as the policy sees them; the driver's stop on a drift alarm."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.recipes.build import optim_config

DEMO = Path(__file__).resolve().parents[3] / "launch" / "configs" / "tiny_cpu.yaml"


def test_warmup_and_run_length_count_rl_steps():
    """The scheduler steps once per optimizer update: `train.warmup_steps` RL steps of 4 updates
    each are 4x as many scheduler steps, like `train.steps`."""
    cfg = load_config(str(DEMO), ["train.steps=10", "train.warmup_steps=3", "algo.num_minibatches=4"])
    optim = optim_config(cfg, cfg.algo.num_minibatches)
    assert (optim.warmup_steps, optim.total_steps) == (12, 40)


def test_aux_loss_coef_defaults_to_the_checkpoint_and_takes_an_override():
    assert load_config(str(DEMO)).model.moe_aux_loss_coef is None
    assert load_config(str(DEMO), ["model.moe_aux_loss_coef=0.001"]).model.moe_aux_loss_coef == 0.001
    with pytest.raises(ConfigError, match="moe_aux_loss_coef"):
        load_config(str(DEMO), ["model.moe_aux_loss_coef=-1"])


class _DriftingRecipe:
    """A recipe whose routes churn more each step: `drift/volatility` = 0.1 * step, no model to train."""

    rank = 0

    def __init__(self, cfg):
        self.cfg, self.finished = cfg, False

    def draws(self):
        return {}

    def step(self, step):
        return {"drift/volatility": 0.1 * step, "drift/volatility/layer_01": 0.05 * step,
                "drift/volatility/layer_03": 0.15 * step}

    def eval_due(self, step):
        return False

    def models(self):
        return {}

    def state_dict(self):
        return {"seen": "state"}

    def close(self):
        pass

    def finish(self, out):
        self.finished = True


@pytest.fixture
def process_state():
    """train_rank sets the process's signal handlers and the moe_rl logger: give them back after."""
    import signal

    logger = logging.getLogger("moe_rl")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
    yield
    for s, h in handlers.items():
        signal.signal(s, h)
    for handler in list(logger.handlers):
        if handler not in saved[0]:
            logger.removeHandler(handler)
            handler.close()
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_stop_alarm_checkpoints_the_step_and_exits_4(tmp_path, monkeypatch, process_state):
    """drift.alarm.action=stop: the first step past the threshold is logged (health/alarms 1), checkpointed,
    named in the log, and train_rank returns exit status 4 without running the steps after it. The
    checkpoint from before the alarm stays, though train.keep_last=1, and the log names it."""
    import json

    from moe_rl.drift.alarm import EXIT_DRIFT_ALARM
    from moe_rl.train import driver
    from moe_rl.train.checkpoint import latest_checkpoint

    cfg = load_config(str(DEMO), ["drift.alarm.volatility=0.25", "drift.alarm.action=stop", "train.steps=6",
                                  "train.save_every=1", "train.keep_last=1", "log.tensorboard=false", "log.progress=false",
                                  "log.report=false", f"log.run_dir={tmp_path}"])
    recipe = _DriftingRecipe(cfg)
    monkeypatch.setattr(driver, "build_recipe", lambda *_: recipe)
    code = driver.train_rank(cfg, str(tmp_path))
    assert code == EXIT_DRIFT_ALARM == 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["health/alarms"]) for r in rows] == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert latest_checkpoint(tmp_path).name == "step_000003"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert torch.load(tmp_path / "checkpoints" / "step_000003" / "rank_00000.pt", weights_only=False)["step"] == 3
    assert not recipe.finished  # no HF export of a stopped run
    error = next(line for line in (tmp_path / "train.log").read_text().splitlines() if " ERROR " in line)
    assert "drift/volatility = 0.3 is above drift.alarm.volatility = 0.25 at step 3, worst layer 03" in error
    assert "checkpoint of step 3 saved" in error and "exit 4" in error
    assert "the last checkpoint from before it is step_000002" in error


class _CollapsingRecipe(_DriftingRecipe):
    """An asynchronous run's steps that learn for 3 steps, then collapse onto one answer: the entropy
    falls under the floor, every group is uniform, no gradient, success at the one-answer plateau."""

    def step(self, step):
        if step <= 3:
            return {"reward/success_rate": 0.1 * step, "perf/grad_norm": 1.0, "rollout/entropy": 0.9}
        return {"reward/success_rate": 0.5, "perf/grad_norm": 0.0, "rollout/entropy": 0.01}


def test_the_collapse_alarm_of_an_asynchronous_run_stops_it_at_a_checkpoint(tmp_path, monkeypatch, process_state):
    """drift.alarm.collapse_steps is on by default with algo.max_staleness >= 1: with action=stop, the
    step whose window holds enough stalled steps is checkpointed and the run exits 4 naming the collapse."""
    import json

    from moe_rl.drift.alarm import EXIT_DRIFT_ALARM
    from moe_rl.train import driver

    cfg = load_config(str(DEMO), ["algo.max_staleness=2", "drift.alarm.collapse_steps=4", "drift.alarm.action=stop",
                                  "train.steps=12", "train.save_every=0", "log.tensorboard=false", "log.progress=false",
                                  "log.report=false", f"log.run_dir={tmp_path}"])
    monkeypatch.setattr(driver, "build_recipe", lambda *_: _CollapsingRecipe(cfg))
    assert driver.train_rank(cfg, str(tmp_path)) == EXIT_DRIFT_ALARM
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # window of 4 with 2 stalled (steps 4, 5) and mean success below 0.8: it fires at step 5
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["health/stalled_steps"] == 2
    assert (tmp_path / "checkpoints" / "step_000005" / "meta.json").is_file()
    error = next(line for line in (tmp_path / "train.log").read_text().splitlines() if " ERROR " in line)
    assert "collapse: 2 of the last 4 steps stalled below 0.8 success" in error and "exit 4" in error


def test_a_run_ends_with_three_short_lines_its_metrics_report_and_export(tmp_path):
    """The last step's key metrics (the last eval kept), the report's index with how many figures
    it skipped (not a line per figure), and the export command for the newest checkpoint."""
    import json

    from moe_rl.observe.report import build_report
    from moe_rl.observe.sinks import JsonlSink
    from moe_rl.train.driver import end_of_run

    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        sink.log(step, {"reward/mean": 0.25 * step, "reward/success_rate": 0.25 * step, "perf/step_s": 1.5})
    sink.close()
    for step in (2, 3):
        (tmp_path / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step:06d}" / "meta.json").write_text(json.dumps({"step": step}))
    cfg = load_config(str(DEMO), ["train.steps=3"])
    report = build_report(tmp_path)
    shown = [r for r in report if r.name.endswith(".png")]
    skipped = sum(1 for r in shown if r.skipped)
    assert 0 < skipped < len(shown)
    last = {"step": 3, "reward/mean": 0.75, "reward/success_rate": 0.75, "eval/success_rate": 0.5}
    lines = end_of_run(tmp_path, cfg, last, report)
    assert lines == [
        "done: step 3/3 | reward 0.750 | success 75.0% | eval 50.0%",
        f"report: {tmp_path / 'report' / 'index.md'} ({len(shown) - skipped} figures; {skipped} skipped for want "
        "of their metrics, listed there)",
        f"weights as a HF checkpoint: moe-rl export --checkpoint {tmp_path / 'checkpoints' / 'step_000003'} "
        f"--out {tmp_path / 'hf'}",
    ]
    exported = load_config(str(DEMO), ["train.steps=3", "train.export_hf=true"])
    assert end_of_run(tmp_path, exported, last, None)[1:] == [f"weights: {tmp_path / 'hf'} (a HF checkpoint)"]
