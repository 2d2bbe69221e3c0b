"""The bench tests' shared fixture: the scripts of tools/bench, importable by module name."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

BENCH = Path(__file__).resolve().parents[3] / "tools" / "bench"


class BenchModules:
    """`bench["critic"]` is tools/bench/critic.py, imported on first use."""

    def __getitem__(self, name: str) -> ModuleType:
        return importlib.import_module(name)


@pytest.fixture(scope="module")
def bench() -> Iterator[BenchModules]:
    sys.path.insert(0, str(BENCH))  # the scripts import each other (`from common import ...`)
    try:
        yield BenchModules()
    finally:
        sys.path.remove(str(BENCH))
