"""Metric sinks: where each step's flat dict of metrics goes.

    sink = make_sinks(cfg.log, run_dir, cfg.to_dict(), rank)   # no-op on ranks other than 0
    sink.log(step, {"reward/mean": 0.4, "drift/volatility": 0.08})
    sink.close()

`metrics.jsonl` is the run's record of truth: one JSON object per line with
"step", "time" (unix seconds), "attempt" (1 for the first start in this run
directory, +1 for each restart) and the metrics, appended, flushed and fsynced
after every line, so a crash loses at most the line being written.
`read_metrics` reads it back and tolerates that half-written last line;
`latest_history` keeps the records of the run as it stands: a restart that goes
back to step s (resuming an older checkpoint, or none) supersedes every earlier
record from step s on.

Non-finite floats: JSON has no NaN or infinity, and Python's `json` module
would write the non-standard tokens `NaN` / `Infinity`, which many readers
reject. A NaN (a value the step does not have, or a loss that went bad: the
health gates say which) is written as JSON null, what pandas, jq and DuckDB
read as missing; an infinity as the string "Infinity" or "-Infinity", so an
overflowing grad norm stays distinguishable from a missing one.
`read_metrics` turns the strings back into floats and keeps null as None
(files of earlier versions wrote the string "NaN": read as NaN).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, runtime_checkable

from moe_rl.observe.logging import get_logger

if TYPE_CHECKING:
    from moe_rl.observe.config import LogConfig

__all__ = [
    "JsonlSink", "MetricSink", "MultiSink", "TensorBoardSink", "WandbSink", "latest_history", "make_sinks",
    "read_metrics", "wandb_available",
]

log = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@runtime_checkable
class MetricSink(Protocol):
    """Receives one flat dict of metrics per step."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` for `step`."""

    def close(self) -> None:
        """Flush and release files or connections; the sink is not used afterwards."""


# --------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------

class JsonlSink:
    """Appends one JSON line per step to `path` (see the module docstring for the format)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = _ends_without_newline(self.path)
        before = read_metrics(self.path) if self.path.exists() else []
        self.attempt = 1 + max((int(r.get("attempt", 1)) for r in before), default=0)
        self._file = open(self.path, "a", encoding="utf-8")
        if needs_newline:
            # A resumed run after a crash: end the half-written line, so the
            # first new record is not glued onto it and lost with it.
            self._file.write("\n")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record: dict[str, Any] = {"step": int(step), "time": round(time.time(), 3), "attempt": self.attempt}
        for key, value in metrics.items():
            if key not in record:
                record[key] = _json_value(key, value)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        # fsync: a killed node (not just a killed process) keeps every finished step.
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def latest_history(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the run as it stands, in step order: a record of step s supersedes the
    records before it (in file order) of steps >= s, which a restart has gone back over."""
    kept: list[dict[str, Any]] = []
    for record in records:
        step = record.get("step")
        while kept and step is not None and kept[-1].get("step", -1) >= step:
            kept.pop()
        kept.append(record)
    return kept


def _ends_without_newline(path: Path) -> bool:
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _json_value(key: str, value: Any) -> Any:
    """A JSON-safe scalar: tensors/numpy scalars unwrapped, NaN as None (null), infinities as strings."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # 0-d torch tensor or numpy scalar
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    raise TypeError(f"metric {key!r}: {type(value).__name__} is not a scalar (number, bool or string)")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file, in file order, non-finite strings turned back into floats.

    A line that is not valid JSON is skipped: the last line may be half-written
    by a crash, and a resumed run appends after such a line. Skipped lines in
    the middle of the file are reported with a warning. Raises FileNotFoundError.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records, bad = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad.append(number)
            continue
        if isinstance(record, dict):
            records.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v
                            for k, v in record.items()})
    if [n for n in bad if n != len(lines)]:
        log.warning("%s: skipped unreadable lines %s (interrupted writes)", path, bad)
    return records


# --------------------------------------------------------------------------
# TensorBoard
# --------------------------------------------------------------------------

class TensorBoardSink:
    """Writes every numeric metric as a TensorBoard scalar under its key (e.g. `reward/mean`)."""

    def __init__(self, log_dir: str | Path):
        # Imported here: tensorboard is only needed when this sink is used.
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in metrics.items():
            number = _as_number(value)
            if key != "step" and number is not None:
                self._writer.add_scalar(key, number, global_step=int(step))
        # Steps are seconds apart: flushing each one costs nothing and makes
        # a live TensorBoard current.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _as_number(value: Any) -> float | None:
    """float(value) for numbers (bools included), None for strings and other non-numbers."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, (int, float)):
        return float(value)
    return None


# --------------------------------------------------------------------------
# Weights & Biases
# --------------------------------------------------------------------------

def wandb_available() -> bool:
    """True when the optional `wandb` package can be imported."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


class WandbSink:
    """Logs to a Weights & Biases run.

    `mode` is passed to `wandb.init`: "online", "offline" (writes under `dir`,
    no network; upload later with `wandb sync`) or "disabled"; None lets wandb
    decide (the WANDB_MODE environment variable, then its settings).
    Raises ImportError with an install hint when wandb is not installed.
    """

    def __init__(self, project: str, name: str, config: Mapping[str, Any] | None = None,
                 dir: str | Path | None = None, mode: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("W&B logging needs the wandb package: pip install wandb") from e
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, name=name, config=dict(config or {}),
                               dir=None if dir is None else str(dir), mode=mode)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        data = {k: v for k, v in metrics.items() if k != "step" and _as_number(v) is not None}
        self._run.log(data, step=int(step))

    def close(self) -> None:
        self._run.finish()


# --------------------------------------------------------------------------
# Fan-out and construction from the config
# --------------------------------------------------------------------------

class MultiSink:
    """Sends each step to several sinks; with no sinks it does nothing (ranks other than 0)."""

    def __init__(self, sinks: Iterable[MetricSink] = ()):
        self.sinks: list[MetricSink] = list(sinks)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        # Every sink gets the step even if an earlier one fails; then the first error is raised.
        _call_all([lambda s=s: s.log(step, metrics) for s in self.sinks])

    def close(self) -> None:
        _call_all([s.close for s in self.sinks])


def _call_all(calls: list) -> None:
    errors = []
    for call in calls:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - re-raised below after the others ran
            errors.append(e)
    if errors:
        raise errors[0]


def make_sinks(log_cfg: LogConfig, run_dir: str | Path, config_dict: Mapping[str, Any] | None,
               rank: int) -> MultiSink:
    """The sinks `log_cfg` asks for, writing into `run_dir`; an empty MultiSink on ranks other than 0.

    Always `run_dir/metrics.jsonl`; `run_dir/tb/` when `log_cfg.tensorboard`;
    W&B when `log_cfg.wandb` (a warning, not an error, when wandb is missing or
    cannot start: the JSONL file still records the run).
    """
    if rank != 0:
        return MultiSink()  # metrics are reduced to rank 0 before logging; one writer per file
    run_dir = Path(run_dir)
    sinks: list[MetricSink] = [JsonlSink(run_dir / METRICS_FILE)]
    if log_cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / TB_DIR))
    if log_cfg.wandb:
        wandb_sink = _try_wandb(log_cfg, run_dir, config_dict)
        if wandb_sink is not None:
            sinks.append(wandb_sink)
    return MultiSink(sinks)


def _try_wandb(log_cfg: LogConfig, run_dir: Path,
               config_dict: Mapping[str, Any] | None) -> WandbSink | None:
    if not wandb_available():
        log.warning("log.wandb=true but the wandb package is not installed (pip install wandb); "
                    "W&B logging is off for this run, metrics still go to %s", run_dir / METRICS_FILE)
        return None
    try:
        return WandbSink(log_cfg.wandb_project, log_cfg.name, config_dict, dir=run_dir)
    except Exception as e:  # noqa: BLE001 - a side channel must not stop a long run (no network, no login)
        log.warning("W&B could not start (%s: %s); W&B logging is off for this run. "
                    "Set WANDB_MODE=offline to log without network.", type(e).__name__, e)
        return None
