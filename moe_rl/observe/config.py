"""The `log` section of the run config: run name, sinks, console.

The `check_*(cfg)` rules take the whole `RunConfig` (`moe_rl.config`, which imports this
module: hence `Any`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from moe_rl.configurable import choice


LOG_LEVELS = ("debug", "info", "warning")


@dataclass
class LogConfig:
    """Run directory, metric sinks and console output."""

    name: str = "run"
    """Run name; used in the run directory and W&B."""
    run_dir: str | None = None
    """Where metrics, config and checkpoints go; None = runs/<name>-<timestamp>."""
    tensorboard: bool = True
    """Write TensorBoard event files (local, no account needed)."""
    wandb: bool = False
    """Log to Weights & Biases; off because it needs network access and an account."""
    wandb_project: str = "moe_rl"
    """W&B project when `wandb` is on."""
    report: bool = True
    """Write the report (`report/index.md` and its figures) when the run ends; off, `moe-rl report
    RUN_DIR` writes it later from `metrics.jsonl`."""
    progress: bool = True
    """Live progress display on rank 0; turn off for batch logs without a terminal."""
    all_ranks: bool = False
    """Log from every rank instead of rank 0 only (debugging hangs)."""
    level: str = choice("info", LOG_LEVELS)
    """Console log level."""


def check_log(cfg: Any) -> Iterator[str]:
    name = cfg.log.name
    if not name.strip() or "/" in name:
        yield f"log.name: {name!r} must be non-empty and without '/' (it names a directory)"
    if cfg.log.wandb and not cfg.log.wandb_project.strip():
        yield "log.wandb_project: '' must be set when log.wandb=true"
