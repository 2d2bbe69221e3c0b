"""Package exports that load with their module on first use (PEP 562).

A component's `config.py` is read by `moe_rl.config` to validate a run before anything
starts; importing it runs its package's `__init__`, which would otherwise pull in torch
(and, through the package's other modules, much more) just to check a YAML file.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any], list[str]]:
    """`__getattr__` and `__all__` for `package`, whose names are `{module: (name, ...)}`."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__, sorted(module_of)
