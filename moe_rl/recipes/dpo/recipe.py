"""The DPO recipe: `dpo_step` (moe_rl/recipes/dpo/step.py) over preference pairs and their reference
log-probs; no rollout servers, rewards, critic or weight sync."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_rl.config import RunConfig
from moe_rl.recipes.base import Recipe
from moe_rl.recipes.dpo.step import build_dpo_run, dpo_step, evaluate


class DPORecipe(Recipe):
    @classmethod
    def build(cls, cfg: RunConfig, out: Path, rank: int) -> DPORecipe:
        run = build_dpo_run(cfg, out, rank)
        return cls(run, run.eval)

    def step(self, step: int) -> dict[str, float]:
        return dpo_step(self.run, step)

    def evaluate(self, step: int) -> dict[str, float]:
        return evaluate(self.run, self.eval_set, step)

    def state_dict(self) -> dict[str, Any]:
        # "rewards" kept (as None) so checkpoints read the same in every mode
        return super().state_dict() | {"rewards": None}

    def finish(self, out: Path) -> None:
        self.run.policy.export_hf(out / "hf")  # the trained policy as a HF checkpoint (collective)
