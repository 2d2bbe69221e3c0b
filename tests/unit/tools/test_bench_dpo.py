"""The DPO benchmark section: its command line, its table, and its place in `make bench`."""
from __future__ import annotations

import pytest


def test_help_table_and_section(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench["dpo_step"].main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out
    row = {"layout": "ep2", "rl_s": 0.5, "dpo_s": 0.4, "ratio": 1.25, "cpu_ratio": 1.2, "tokens": 2048, "load": 1.0,
           "shape": bench["common"].BASE, "batch": 16, "seq": 128, "micro": 4, "rounds": 3}
    text = bench["dpo_step"].format_table([row])
    assert "| ep2 | 0.500 | 0.400 | 4096 | 5120 | 1.250 | 1.200 |" in text
    assert "dpo" in [key for key, _, _ in bench["run_all"].sections()]
