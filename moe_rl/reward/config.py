"""The `reward` section of the run config.

The `check_*(cfg)` rules take the whole `RunConfig` (`moe_rl.config`, which imports this
module: hence `Any`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from moe_rl.configurable import ranged




@dataclass
class RewardConfig:
    """How responses are scored."""

    name: str = "auto"
    """Registry name, or `module:function`; auto = the reward that matches the data (toy task or math)."""
    max_failure_frac: float = ranged(0.1, ge=0.0, le=1.0)
    """Share of samples whose reward may raise (scored 0) before the step fails."""


def check_reward(cfg: Any) -> Iterator[str]:
    name = cfg.reward.name
    module, sep, function = name.partition(":")
    if not name.strip() or (sep and not (module.strip() and function.strip())):
        yield f"reward.name: {name!r} must be a registry name or module:function"
