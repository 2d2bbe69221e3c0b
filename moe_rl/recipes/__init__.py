"""Training methods as recipes: what one method does per step, apart from the driver
(`moe_rl.train.driver`), which runs any recipe the same way (resume, step, eval, sinks,
checkpoint, stop). `train.mode` picks one, once, here.

    recipe = build_recipe(cfg, run_dir, rank)     # RLRecipe or DPORecipe
    metrics = recipe.step(step)
"""
from __future__ import annotations

from pathlib import Path

from moe_rl.config import RunConfig
from moe_rl.recipes.base import Recipe
from moe_rl.recipes.dpo.recipe import DPORecipe
from moe_rl.recipes.rl.recipe import RLRecipe

RECIPES: dict[str, type[Recipe]] = {"rl": RLRecipe, "dpo": DPORecipe}  # by train.mode


def build_recipe(cfg: RunConfig, out: Path, rank: int) -> Recipe:
    """The recipe of `train.mode`, built for this rank (its model, data, engine, ...)."""
    return RECIPES[cfg.train.mode].build(cfg, out, rank)


__all__ = ["RECIPES", "DPORecipe", "RLRecipe", "Recipe", "build_recipe"]
