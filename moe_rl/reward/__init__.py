"""Rewards: the registry, the math answer checker, the toy-task reward and the batch runner.

    fn = get_reward(cfg.reward.name, data=cfg.data.train)   # "auto" -> "toy" or "math"
    runner = RewardRunner(fn, cfg.reward.max_failure_frac)
    rewards = runner.score(prompts, completion_texts, completion_ids)
"""
from moe_rl.reward.registry import RewardFn, get_reward, known_rewards, register_reward, resolve_reward_name
from moe_rl.reward.math_answer import answers_match, extract_final_answer, math_verify, parse_number
from moe_rl.reward.toy import toy_exact_match
from moe_rl.reward.runner import RewardFailure, RewardRunner

__all__ = [
    "RewardFailure", "RewardFn", "RewardRunner", "answers_match", "extract_final_answer", "get_reward",
    "known_rewards", "math_verify", "parse_number", "register_reward", "resolve_reward_name",
    "toy_exact_match",
]
