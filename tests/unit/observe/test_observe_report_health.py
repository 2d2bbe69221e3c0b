"""The report's MoE health figure: written first, with and without the coverage and route-mask keys,
the run's alarm thresholds drawn and the steps past them marked whatever the action."""
from __future__ import annotations

import math

import pytest
import yaml

from moe_rl.observe.report import Metrics, build_report
from moe_rl.observe.report_health import (AlarmSettings, health_figure, health_lines, past_threshold,
                                         read_alarm_settings)
from moe_rl.observe.sinks import JsonlSink


def _records(n: int = 8, concurrent: bool = False) -> list[dict]:
    rows = []
    for step in range(1, n + 1):
        r = {"step": step, "reward/mean": 0.1 * step, "drift/rollout_mismatch": 0.01 * step,
             "drift/load_max_vio": 0.2 * step, "drift/volatility": 0.02 * step, "drift/route_margin": 1.0 / step,
             "health/alarms": float(step >= 6)}
        if step == 4:
            r["drift/load_max_vio"] = math.nan  # a step with no tokens: drawn as a gap, never past a threshold
        if concurrent:
            r |= {"replay/coverage": 1.0 if step != 3 else 0.9, "replay/coverage_prompt": 1.0,
                  "correction/route_masked_frac": 0.005 * step}
        rows.append(r)
    return rows


def _run(tmp_path, records, alarm: dict | None):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for r in records:
        sink.log(r["step"], {k: v for k, v in r.items() if k != "step"})
    sink.close()
    if alarm is not None:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"drift": {"enabled": True, "alarm": alarm}}))
    return build_report(tmp_path)


def _texts(fig) -> str:
    return " | ".join([ax.get_title() for ax in fig.axes] + [t.get_text() for ax in fig.axes for t in ax.texts]
                      + [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
                      + [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()])


ALARM = {"volatility": 0.1, "rollout_mismatch": None, "logp_k3": None, "load_max_vio": 1.0, "route_margin": 0.2,
         "action": "warn"}


def test_health_is_the_first_figure_and_first_in_index_without_the_concurrent_keys(tmp_path):
    results = _run(tmp_path, _records(), ALARM)
    assert results[0].name == "health.png" and results[0].path.stat().st_size > 0
    index = (tmp_path / "report" / "index.md").read_text()
    assert index.index("## MoE health") < index.index("## Figures")
    assert index.index("[health.png](health.png)") < index.index("[reward.png](reward.png)")
    assert "- R3 coverage (`replay/coverage`): not measured" in index
    assert "masked (`correction/route_masked_frac`): not measured" in index
    assert "- expert-load violation (`drift/load_max_vio`): max 1.6 (step 8)" in index
    # the report finds the crossings itself: action=warn, still marked
    assert "alarm `drift.alarm.volatility` (drift/volatility above 0.1, action=warn): past at steps 6, 7, 8" in index
    assert "alarm `drift.alarm.route_margin` (drift/route_margin below 0.2, action=warn): past at steps 6, 7, 8" \
        in index
    assert "alarm `drift.alarm.load_max_vio` (drift/load_max_vio above 1, action=warn): past at steps 6, 7, 8" in index

    text = _texts(health_figure(read_alarm_settings(tmp_path))(Metrics(_records())))
    assert "not measured: no replay/coverage in metrics.jsonl" in text
    assert "not measured: correction/route_masked_frac" in text
    assert "drift.alarm.load_max_vio = 1 (above)" in text and "drift.alarm.route_margin = 0.2 (below)" in text
    assert "Alarm metric drift/volatility" in text and "Alarm metric drift/route_margin" in text
    assert "drift/volatility > 0.1" in text and "drift/route_margin < 0.2" in text and "health/alarms logged (size: count)" in text


def test_health_draws_coverage_and_masked_fraction_when_logged(tmp_path):
    _run(tmp_path, _records(concurrent=True), ALARM)
    index = (tmp_path / "report" / "index.md").read_text()
    assert "- R3 coverage (`replay/coverage`): min 0.9 (step 3)" in index
    assert "masked (`correction/route_masked_frac`): max 0.04 (step 8)" in index
    fig = health_figure(read_alarm_settings(tmp_path))(Metrics(_records(concurrent=True)))
    text = _texts(fig)
    assert "not measured" not in text
    coverage = fig.axes[0]
    assert [line.get_label() for line in coverage.get_lines()][:2] == ["response tokens", "prompt tokens"]
    flips = fig.axes[1]
    assert {line.get_label() for line in flips.get_lines()} >= {
        "engine vs trainer routes (share of top-k that differ)", "tokens masked for their route flips (route_mask)"}


def test_steps_past_a_threshold_are_found_from_the_metrics():
    m = Metrics(_records())
    assert past_threshold(m, "load_max_vio", 1.0).tolist() == [6.0, 7.0, 8.0]  # 1.0 itself is not past; NaN never
    assert past_threshold(m, "route_margin", 0.2).tolist() == [6.0, 7.0, 8.0]  # a floor: strictly below
    assert past_threshold(m, "logp_k3", 0.0).tolist() == []                    # not logged: nothing to mark


@pytest.mark.parametrize("config", [None, "drift: [unclosed\n", {"drift": {"enabled": True}}])
def test_no_thresholds_known_still_writes_the_figure(tmp_path, config):
    """Without config.yaml, with an unreadable one, or with one from before drift.alarm: no threshold, a note."""
    if isinstance(config, str):
        (tmp_path / "config.yaml").write_text(config)
    elif config is not None:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    settings = read_alarm_settings(tmp_path)
    assert settings.thresholds == {}
    text = _texts(health_figure(settings)(Metrics(_records())))  # drawn all the same
    note = {None: "no config.yaml", str: "config.yaml unreadable", dict: "no drift.alarm threshold set"}
    said = note[type(config) if config is not None else None]
    assert said in text
    assert any(line.startswith("- alarms: ") and said in line for line in health_lines(Metrics(_records()), settings))


def test_a_run_without_health_metrics_skips_the_figure(tmp_path):
    results = _run(tmp_path, [{"step": 1, "reward/mean": 0.1}], {"action": "warn"})
    assert results[0].name == "health.png" and results[0].skipped.startswith("no replay/coverage")
    assert "## MoE health" not in (tmp_path / "report" / "index.md").read_text()
    assert AlarmSettings().thresholds == {}
