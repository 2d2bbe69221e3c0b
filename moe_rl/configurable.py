"""Field declarations of the config sections: allowed values and ranges live next to each field.

Each component declares its section in its own `config.py` (`moe_rl.policy.config`,
`moe_rl.rollout.config`, `moe_rl.algo.config`, ...) with these helpers; `moe_rl.config`
assembles them into `RunConfig`, loads and validates it.

Conventions for the sections:
- Each field is followed by a docstring: what it means, and why the default.
- Fields with a fixed set of values are `str` fields declared with `choice(...)`;
  the allowed values live in that one call and appear in error messages. Where a
  registry owns the values (the losses, advantage estimators, ... of `moe_rl.algo`),
  the call names the registry with `registry_names(...)`, so adding an entry is one place.
  (omegaconf cannot type a field as `Literal`, and a plain string reads better
  in YAML and in errors than an Enum.)
- Numeric ranges are declared with `ranged(...)` next to the field; rules that
  relate several fields live in small `check_<section>(cfg)` functions beside the section.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence


class ConfigError(ValueError):
    """An invalid config file, key or value. `problems` holds one line per mistake."""

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:  # report every mistake at once, so one run fixes them all
            message = f"{len(self.problems)} config errors:\n" + "\n".join(
                f"  - {p}" for p in self.problems)
        super().__init__(message)


@dataclass(frozen=True)
class _Range:
    """Closed (ge/le) or open (gt/lt) bounds on a number; None means unbounded."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, x: float) -> bool:
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def __str__(self) -> str:
        lo = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        hi = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f">= {self.ge}" if self.ge is not None else f"> {self.gt}"
        return f"<= {self.le}" if self.le is not None else f"< {self.lt}"


@dataclass(frozen=True)
class registry_names:
    """The names of a registry, `module.attr` (a dict or tuple), read when a value is checked.

    Read late because the registries live beside their torch code: `moe_rl.config` stays
    importable without torch, and a validated run loads the registry once (it loads torch anyway).
    """

    module: str
    attr: str
    extra: tuple[str, ...] = ()
    """Values the config accepts beside the registry's (say in a comment who handles them)."""

    def _names(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.attr)) + self.extra

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._names()


def choice(default: str | None, options: tuple[str, ...] | registry_names) -> Any:
    """A string field that must be one of `options` (None allowed only if it is the default)."""
    return field(default=default, metadata={"choices": options})


def ranged(default: float | None, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None) -> Any:
    """A numeric field that must lie in the given bounds (None passes when the type allows it)."""
    return field(default=default, metadata={"range": _Range(ge, gt, le, lt)})
