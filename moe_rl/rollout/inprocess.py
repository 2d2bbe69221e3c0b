"""The rollout engine inside trainer rank 0 (`rollout.engine=inprocess`).

The same `LocalEngine` that `moe-rl serve` puts behind SGLang's HTTP API, called
directly: requests and results stay Python objects (no HTTP, no JSON, no base64
routes), and with `rollout.weight_sync=tensor` new weights are copied tensor by
tensor into its model instead of written to and read from disk. For small CPU runs
(the demo, CI, debugging a recipe), where these costs are most of a rollout.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moe_rl.policy.compat import native
from moe_rl.rollout.engine import GenerateRequest, GenerateResult
from moe_rl.rollout.local_engine import LocalEngine


class InProcessEngine(LocalEngine):
    """`LocalEngine` in the trainer's process: it generates outside the CPU redirect that
    the policy installs there (`moe_rl.policy.compat.native`: the engine names no CUDA
    device, and the redirect costs every torch call a detour through Python)."""

    def generate(self, requests: list[GenerateRequest]) -> list[list[GenerateResult]]:
        with native():
            return super().generate(requests)

    def update_weights_from_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                                    version: str | int | None = None) -> None:
        # The pairs come from the policy's export (megatron code, which needs the redirect):
        # drawn here, copied in outside it.
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        with native():
            super().update_weights_from_tensors(items, version)


def inprocess_engine(cfg: Any, hf_dir: str | Path) -> LocalEngine:
    """The engine of `rollout.engine=inprocess` for the checkpoint `hf_dir` (`cfg`: a RunConfig).

    Built with `moe-rl serve`'s defaults (fp32, scaled log-probs, seed 0), except that a
    step's samples (`data.prompts_per_step` x `rollout.n_samples`) decode as one batch: each
    batch costs a forward per new token whatever its size, and small models have room.
    """
    import torch

    return InProcessEngine(hf_dir, device="cuda" if torch.cuda.is_available() else "cpu",
                           max_batch=cfg.data.prompts_per_step * cfg.rollout.n_samples)
