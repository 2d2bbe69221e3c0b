"""Test helpers: the multi-process runner, tiny model checkpoints, free ports (nothing in the product
imports this package; the helpers themselves live where the product uses them)."""
from moe_rl.dist.ports import free_port, free_ports
from moe_rl.dist.spawn import RankFailed, run_ranks
from moe_rl.policy.tiny import (TinyMoEConfig, make_tiny_deepseek_v3, make_tiny_glm4_moe, make_tiny_mixtral, make_tiny_qwen2_moe,
                               make_tiny_qwen3_5_moe, make_tiny_qwen3_moe, make_tiny_qwen3_next)

__all__ = ["RankFailed", "TinyMoEConfig", "free_port", "free_ports", "make_tiny_deepseek_v3", "make_tiny_glm4_moe", "make_tiny_mixtral", "make_tiny_qwen2_moe", "make_tiny_qwen3_5_moe", "make_tiny_qwen3_moe", "make_tiny_qwen3_next", "run_ranks"]
