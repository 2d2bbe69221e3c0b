"""The RL recipe, module by module in the order a step's data meets them: `recipe.py` (RLRecipe: build,
step, evaluate, state), `run.py` (`Run`, what a step is given), `step.py` (`rl_step`, the step top to
bottom), `rollouts.py` / `async_rollouts.py` (the step's samples: now, or K steps ahead), `batch.py`
(rank 0: rewards, refills, advantages, each rank's share), `old_pass.py` (pi_old and the routes to
replay), `critic.py` (the critic's stage of a GAE step), `drift_views.py` (the step's drift)."""
