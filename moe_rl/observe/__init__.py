"""Observability: rank-aware logging, progress display, metric sinks and run reports.

    setup_logging(cfg.log.level, rank, cfg.log.all_ranks, run_dir / "train.log")
    sinks = make_sinks(cfg.log, run_dir, cfg.to_dict(), rank)   # metrics.jsonl, tb/, W&B
    progress = Progress(cfg.train.steps, enabled=rank == 0)
    ...
    write_report(run_dir)                                        # run_dir/report/*.png

`write_report` lives in `moe_rl.observe.report` and is not imported here, so
that importing this package does not import matplotlib.
"""
from moe_rl.observe.logging import get_logger, setup_logging
from moe_rl.observe.progress import Progress
from moe_rl.observe.sinks import (JsonlSink, MetricSink, MultiSink, TensorBoardSink, WandbSink, make_sinks,
                                  read_metrics)

__all__ = [
    "JsonlSink", "MetricSink", "MultiSink", "Progress", "TensorBoardSink", "WandbSink", "get_logger",
    "make_sinks", "read_metrics", "setup_logging",
]
