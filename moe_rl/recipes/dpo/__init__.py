"""The DPO recipe: `recipe.py` (DPORecipe) and `step.py` (`dpo_step` over preference pairs,
the reference log-probs and their cache)."""
