"""`Run`: everything an RL step needs, built once by the trainer (moe_rl/recipes/build.py) and passed to
every stage of the step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_rl.config import RunConfig
from moe_rl.data.dataset import PromptDataset
from moe_rl.data.sampler import PromptSampler
from moe_rl.policy.policy import Policy
from moe_rl.recipes.rl.batch import RankZeroIntake
from moe_rl.recipes.rl.rollouts import SyncRollouts
from moe_rl.reward.runner import RewardRunner


@dataclass
class Run:
    """Everything a step needs, built once by the trainer."""

    cfg: RunConfig
    policy: Policy
    dataset: PromptDataset
    sampler: PromptSampler
    rewards: RewardRunner
    engine: Any  # RolloutEngine on rank 0 (and on each data-parallel head: rollout.intake=heads), None elsewhere
    weight_sync: Any
    eos_id: int
    rank: int = 0
    weight_version: int = 0
    drift_state: dict[str, Any] = field(default_factory=dict)
    rollouts: Any = field(default_factory=SyncRollouts)  # the step's source of samples: SyncRollouts, or
    # rank 0's AsyncRollouts when algo.max_staleness >= 1 (recipes/rl/async_rollouts.py)
    critic: Any = None  # moe_rl.policy.critic.Critic when algo.advantage=gae
    episodes: Any = None  # the engine's client's EpisodeRunner when rollout.env is set (moe_rl/rollout/episodes.py)
    intake: Any = field(default_factory=RankZeroIntake)  # who receives the step's samples (rollout.intake):
    # rank 0 (recipes/rl/batch.py), or each data-parallel head its own (recipes/rl/heads.py)
