"""Observability: rank-aware logging, progress display, metric sinks and run reports.

    setup_logging(cfg.log.level, rank, cfg.log.all_ranks, run_dir / "train.log")
    sinks = make_sinks(cfg.log, run_dir, cfg.to_dict(), rank)   # metrics.jsonl, tb/, W&B
    progress = Progress(cfg.train.steps, enabled=rank == 0)
    ...
    write_report(run_dir)                                        # run_dir/report/*.png

`write_report` lives in `moe_rl.observe.report` and is not exported here, so
that importing this package does not import matplotlib.

Names load with their module on first use (`moe_rl.lazy`): `moe_rl.config` reads this
package's `config.py` without importing the rest.
"""
from moe_rl.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "logging": ("get_logger", "setup_logging"),
    "progress": ("Progress",),
    "sinks": ("JsonlSink", "MetricSink", "MultiSink", "TensorBoardSink", "WandbSink", "make_sinks",
              "read_metrics"),
})
