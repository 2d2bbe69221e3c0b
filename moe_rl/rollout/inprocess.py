"""The rollout engine inside trainer rank 0 (`rollout.engine=inprocess`).

The same `LocalEngine` that `moe-rl serve` puts behind SGLang's HTTP API, called
directly: requests and results stay Python objects (no HTTP, no JSON, no base64
routes), and with `rollout.weight_sync=tensor` new weights are copied tensor by
tensor into its model instead of written to and read from disk. For small CPU runs
(the demo, CI, debugging a recipe), where these costs are most of a rollout.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_rl.rollout.local_engine import LocalEngine


def inprocess_engine(cfg: Any, hf_dir: str | Path) -> LocalEngine:
    """The engine of `rollout.engine=inprocess` for the checkpoint `hf_dir` (`cfg`: a RunConfig).

    Built with `moe-rl serve`'s defaults (fp32, scaled log-probs, seed 0), except that a
    step's samples (`data.prompts_per_step` x `rollout.n_samples`) decode as one batch: each
    batch costs a forward per new token whatever its size, and small models have room.
    """
    import torch

    return LocalEngine(hf_dir, device="cuda" if torch.cuda.is_available() else "cpu",
                       max_batch=cfg.data.prompts_per_step * cfg.rollout.n_samples)
