"""The `drift` section of the run config: what expert-activation volatility is measured, how often."""
from __future__ import annotations

from dataclasses import dataclass

from moe_rl.configurable import ranged




@dataclass
class DriftConfig:
    """Routing drift measurement (expert volatility, train-rollout mismatch)."""

    enabled: bool = True
    """Measure drift; on, since it is a cheap extra forward on a small probe set."""
    probe_size: int = ranged(16, ge=1)
    """Fixed probe sequences whose routes are compared before and after each update."""
    probe_every: int = ranged(1, ge=1)
    """Measure on the probe set every N steps."""
    step_tokens: bool = True
    """Also measure on the step's own training tokens (the volatility that replay removes)."""
    every: int = ranged(1, ge=1)
    """Measure step-token drift every N steps: each measurement costs one extra forward pass."""
    per_update: bool = False
    """Also measure probe-set volatility across each optimizer update (`drift/volatility_per_update`,
    the per-gradient-update figure of the GSPO paper); costs one probe forward per update."""
