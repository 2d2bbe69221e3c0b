"""Argument checks shared by the algo modules: one message format everywhere."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def require(ok: bool, where: str, name: str, value: Any, rule: str) -> None:
    """Raise `ValueError("<where>: <name> must be <rule>, got <value>")` unless `ok`."""
    if not ok:
        raise ValueError(f"{where}: {name} must be {rule}, got {value!r}")


def require_choice(value: str, choices: Iterable[str], where: str, name: str) -> None:
    """Raise a `ValueError` naming the bad choice and listing the valid ones."""
    choices = sorted(choices)
    if value not in choices:
        raise ValueError(f"{where}: unknown {name} {value!r}; choose one of {', '.join(choices)}")
