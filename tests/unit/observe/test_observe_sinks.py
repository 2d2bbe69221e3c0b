"""Metric sinks: JSONL round trip (non-finite values, crash-truncated lines), TensorBoard, W&B, rank 0 only."""
from __future__ import annotations

import json
import logging
import math
import sys
import types

import numpy as np
import pytest
import torch

from moe_rl.config import LogConfig
from moe_rl.observe.sinks import JsonlSink, MetricSink, MultiSink, TensorBoardSink, make_sinks, read_metrics


def _strict_json(line: str) -> dict:
    """json.loads that refuses the non-standard NaN / Infinity tokens."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(line, parse_constant=refuse)


def test_jsonl_round_trip_with_non_finite_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    assert isinstance(sink, MetricSink)
    sink.log(1, {"reward/mean": 0.5, "loss/pg_loss": float("nan"), "perf/grad_norm": float("inf"),
                 "loss/min": float("-inf"), "count": 3, "flag": True, "t": torch.tensor(0.25),
                 "n": np.float32(1.5), "note": "ok"})
    sink.log(2, {"reward/mean": 0.75, "step": 99})  # the step argument wins over a "step" metric
    sink.close()

    lines = path.read_text().splitlines()
    assert len(lines) == 2
    raw = [_strict_json(line) for line in lines]  # valid JSON, no NaN/Infinity tokens
    assert raw[0]["loss/pg_loss"] is None and raw[0]["perf/grad_norm"] == "Infinity"  # NaN: JSON null
    assert "time" in raw[0]

    first, second = read_metrics(path)
    assert first["step"] == 1 and second["step"] == 2
    assert first["loss/pg_loss"] is None
    assert first["perf/grad_norm"] == math.inf and first["loss/min"] == -math.inf
    assert first["reward/mean"] == 0.5 and first["count"] == 3 and first["flag"] is True
    assert first["t"] == 0.25 and first["n"] == 1.5 and first["note"] == "ok"


def test_jsonl_rejects_non_scalar_metric(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(TypeError, match="per_layer"):
        sink.log(1, {"per_layer": [0.1, 0.2]})
    sink.close()


def test_truncated_last_line_is_skipped_and_resume_appends_cleanly(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (1, 2, 3):
        sink.log(step, {"reward/mean": step / 10})
    sink.close()
    with open(path, "a") as f:  # a crash in the middle of writing step 4
        f.write('{"step": 4, "reward/me')

    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]

    resumed = JsonlSink(path)  # the resumed run must not glue its first line onto the broken one
    resumed.log(4, {"reward/mean": 0.4})
    resumed.close()
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["reward/mean"] == 0.4


def test_read_metrics_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "nope.jsonl")


def test_tensorboard_sink_writes_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for step in (1, 2):
        sink.log(step, {"reward/mean": 0.1 * step, "note": "skipped", "step": step})
    sink.close()
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["reward/mean"]
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2)]


def test_make_sinks_writes_only_on_rank_0(tmp_path):
    cfg = LogConfig(tensorboard=True)
    other = make_sinks(cfg, tmp_path / "run1", {}, rank=1)
    other.log(1, {"reward/mean": 0.5})
    other.close()
    assert not (tmp_path / "run1").exists()

    sink = make_sinks(cfg, tmp_path / "run0", {}, rank=0)
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    assert read_metrics(tmp_path / "run0" / "metrics.jsonl")[0]["reward/mean"] == 0.5
    assert list((tmp_path / "run0" / "tb").glob("events.out.tfevents.*"))


def test_make_sinks_without_tensorboard(tmp_path):
    make_sinks(LogConfig(tensorboard=False), tmp_path, {}, rank=0).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


@pytest.fixture
def sink_warnings():
    """Warnings of the sinks module, collected whatever the moe_rl logger's propagation is."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("moe_rl.observe.sinks")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_wandb_requested_but_not_installed_warns(tmp_path, monkeypatch, sink_warnings):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    sink = make_sinks(LogConfig(tensorboard=False, wandb=True), tmp_path, {}, rank=0)
    sink.log(1, {"reward/mean": 1.0})
    sink.close()
    assert len(sink.sinks) == 1  # JSONL only
    assert any("pip install wandb" in r.getMessage() for r in sink_warnings)


def _fake_wandb(fail: bool = False) -> types.ModuleType:
    module = types.ModuleType("wandb")
    module.runs = []

    class Run:
        def __init__(self, **kwargs):
            self.kwargs, self.logged, self.finished = kwargs, [], False

        def log(self, data, step):
            self.logged.append((step, data))

        def finish(self):
            self.finished = True

    def init(**kwargs):
        if fail:
            raise RuntimeError("no network")
        module.runs.append(Run(**kwargs))
        return module.runs[-1]

    module.init = init
    return module


def test_wandb_sink_logs_numbers_offline(tmp_path, monkeypatch):
    fake = _fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = LogConfig(name="exp", tensorboard=False, wandb=True, wandb_project="proj")
    sink = make_sinks(cfg, tmp_path, {"algo": {"loss": "gspo"}}, rank=0)
    sink.log(3, {"reward/mean": 0.5, "note": "text", "step": 3})
    sink.close()
    (run,) = fake.runs
    assert run.kwargs["project"] == "proj" and run.kwargs["name"] == "exp"
    assert run.kwargs["config"] == {"algo": {"loss": "gspo"}} and run.kwargs["dir"] == str(tmp_path)
    assert run.logged == [(3, {"reward/mean": 0.5})] and run.finished


def test_wandb_that_cannot_start_warns(tmp_path, monkeypatch, sink_warnings):
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(fail=True))
    sink = make_sinks(LogConfig(tensorboard=False, wandb=True), tmp_path, {}, rank=0)
    assert len(sink.sinks) == 1
    assert any("W&B could not start" in r.getMessage() for r in sink_warnings)


def test_multisink_reaches_every_sink_before_raising():
    class Broken:
        def log(self, step, metrics):
            raise OSError("disk full")

        def close(self):
            pass

    class Keep:
        def __init__(self):
            self.seen = []

        def log(self, step, metrics):
            self.seen.append(step)

        def close(self):
            pass

    keep = Keep()
    multi = MultiSink([Broken(), keep])
    with pytest.raises(OSError, match="disk full"):
        multi.log(1, {"a": 1.0})
    assert keep.seen == [1]


def test_restart_without_checkpoint_supersedes_the_crashed_attempts_steps(tmp_path):
    """Steps 1-4, a crash with no checkpoint, a restart from step 1 that reached step 3, then a
    restart resuming a checkpoint of step 2: the run as it stands is steps 1, 2 (attempt 2), 3 (attempt 3)."""
    from moe_rl.observe.sinks import latest_history

    path = tmp_path / "metrics.jsonl"
    for steps in ([1, 2, 3, 4], [1, 2, 3], [3]):
        sink = JsonlSink(path)
        for s in steps:
            sink.log(s, {"reward/mean": float(s)})
        sink.close()
    records = read_metrics(path)
    assert [r["attempt"] for r in records] == [1] * 4 + [2] * 3 + [3]
    history = latest_history(records)
    assert [(r["step"], r["attempt"]) for r in history] == [(1, 2), (2, 2), (3, 3)]


def test_report_reads_the_current_history(tmp_path):
    from moe_rl.observe.report import _load

    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps({"step": s, "reward/mean": float(s), "attempt": a})
                              for s, a in ((1, 1), (2, 1), (3, 1), (1, 2), (2, 2))) + "\n")
    metrics = _load(tmp_path)
    assert [r["attempt"] for r in metrics.records] == [2, 2]


def test_metrics_files_of_earlier_versions_read_their_nan_strings_as_nan(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss/pg_loss": "NaN", "perf/grad_norm": "Infinity"}\n')
    (first,) = read_metrics(path)
    assert math.isnan(first["loss/pg_loss"]) and first["perf/grad_norm"] == math.inf
