"""Environments for multi-turn rollouts: the model acts, the environment answers with tokens.

`base.py` is the interface (`Environment`, `Turn`), `registry.py` finds one by name
(`rollout.env=calculator` or `rollout.env=my_pkg.envs:MyEnv`), `toy.py` holds the built-in toy
environments, which speak in token ids as the toy tasks do. The episode loop that drives them
is `moe_rl/rollout/episodes.py`.
"""
from moe_rl.env.base import Environment, Turn
from moe_rl.env.registry import make_env, register_env

__all__ = ["Environment", "Turn", "make_env", "register_env"]
