"""The critic benchmark section: registered in `make bench`, its table from rows, its command line."""
from __future__ import annotations

import pytest


def test_registered_and_table(bench, capsys):
    assert "critic" in [key for key, _, _ in bench["run_all"].sections()]
    rows = [{"variant": v, "layout": "ep2", "wall_s": w, "cpu_s": w, "wall_ratio": w / 0.5, "cpu_ratio": w / 0.5,
             "mem_mb": m, "mem_ratio": m / 70.0, "batch": 16, "seq": 128, "micro": 4, "rounds": 3, "load": 1.0}
            for v, w, m in (("grpo", 0.5, 70.0), ("gae", 0.9, 98.0))]
    text = bench["critic"].format_table(rows)
    assert "| gae | 0.900 | 0.900 | 1.80 | 1.80 | 98 | 1.40 |" in text
    with pytest.raises(SystemExit) as e:
        bench["critic"].main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out
