"""The loss benchmark runs and returns one row per loss, baseline first (tiny sizes)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from moe_rl.algo import LOSSES

BENCH = Path(__file__).resolve().parents[3] / "tools" / "bench" / "losses.py"


def test_bench_rows_and_table():
    spec = importlib.util.spec_from_file_location("bench_losses_under_test", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.bench_rows(batch=2, seq_len=16, repeats=1, warmup=0)
    assert rows[0]["loss"] == "plain PG (baseline)" and rows[0]["ratio"] == 1.0
    assert set(LOSSES) <= {r["loss"] for r in rows}
    assert all(r["ms"] > 0 for r in rows)
    table = bench.format_table(rows)
    assert table.count("\n| ") == len(rows) + 1
