"""The DPO benchmark section: its command line, its table, and its place in `make bench`."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "tools" / "bench"


@pytest.fixture(scope="module")
def modules():
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name) for name in ("common", "dpo_step", "run_all")}
    finally:
        sys.path.remove(str(BENCH))


def test_help_table_and_section(modules, capsys):
    with pytest.raises(SystemExit) as e:
        modules["dpo_step"].main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out
    row = {"layout": "ep2", "rl_s": 0.5, "dpo_s": 0.4, "ratio": 1.25, "cpu_ratio": 1.2, "tokens": 2048, "load": 1.0,
           "shape": modules["common"].BASE, "batch": 16, "seq": 128, "micro": 4, "rounds": 3}
    text = modules["dpo_step"].format_table([row])
    assert "| ep2 | 0.500 | 0.400 | 4096 | 5120 | 1.250 | 1.200 |" in text
    assert "dpo" in [key for key, _, _ in modules["run_all"].sections()]
