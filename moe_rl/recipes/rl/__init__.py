"""The RL recipe: `recipe.py` (RLRecipe: build, step, evaluate, state), `step.py` (`rl_step`, the
step top to bottom), `batch.py` (the step's batch on rank 0: rollouts, rewards, advantages, shares),
`critic.py` (the critic's stage of a GAE step)."""
