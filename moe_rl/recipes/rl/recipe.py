"""The RL recipe: `rl_step` (moe_rl/recipes/rl/step.py) over a run of policy, rollout engine, rewards,
weight sync and, for GAE, a critic."""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from moe_rl.algo.config import staleness_bound
from moe_rl.config import RunConfig, replay_mode
from moe_rl.recipes.base import Recipe
from moe_rl.recipes.build import build_run
from moe_rl.recipes.rl.batch import evaluate
from moe_rl.recipes.rl.step import rl_step, sync_weights

log = logging.getLogger("moe_rl")


class RLRecipe(Recipe):
    def __init__(self, run: Any, eval_set: Any = None, servers: Any = None) -> None:
        super().__init__(run, eval_set)
        self.servers = servers  # the rollout servers rank 0 launched (None: none, or not rank 0)

    @classmethod
    def build(cls, cfg: RunConfig, out: Path, rank: int) -> RLRecipe:
        if cfg.algo.replay == "auto":
            log.info("algo.replay=auto: %s (%d optimizer updates per rollout batch%s)", replay_mode(cfg.algo),
                     cfg.algo.num_minibatches,
                     f", up to {staleness_bound(cfg.algo)} weight versions stale" if staleness_bound(cfg.algo) else "")
        built = build_run(cfg, out, rank)
        return cls(built["run"], built["eval"], built["servers"])

    def step(self, step: int) -> dict[str, float]:
        return rl_step(self.run, step)

    def evaluate(self, step: int) -> dict[str, float]:
        return evaluate(self.run, self.eval_set, step)

    def models(self) -> dict[str, Any]:
        return super().models() | ({"critic": self.run.critic} if self.run.critic is not None else {})

    def state_dict(self) -> dict[str, Any]:
        r = self.run
        state = super().state_dict() | {"rewards": r.rewards.state_dict()}
        ahead = r.rollouts.sampler_state()
        if ahead is not None:  # batches asked for but not trained: a resumed run asks for them again
            state["sampler"] = ahead
        return state

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        super().load_state_dict(state, path)
        self.run.rewards.load_state_dict(state["rewards"])

    def resumed(self) -> None:
        sync_weights(self.run)  # the engine starts from the initial weights: give it the resumed ones

    def draws(self) -> dict[str, Any]:
        return super().draws() | {"rewards": copy.deepcopy(self.run.rewards.state_dict())}

    def undo_draws(self, before: dict[str, Any]) -> None:
        super().undo_draws(before)
        self.run.rewards.load_state_dict(before["rewards"])
        self.run.rollouts.reset(self.run.sampler)  # asynchronous: the failed step's batch and those after it again

    def close(self) -> None:
        r = self.run
        r.rollouts.close()
        if r.weight_sync is not None:
            r.weight_sync.close()  # leave the nccl update group before its servers stop
        if r.engine is not None:
            r.engine.close()
        if self.servers is not None:
            self.servers.stop()
