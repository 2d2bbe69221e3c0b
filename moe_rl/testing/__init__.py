"""Test helpers: the multi-process runner, tiny model checkpoints, free ports (nothing in the product
imports this package; the helpers themselves live where the product uses them)."""
from moe_rl.policy.tiny import TinyMoEConfig, make_tiny_qwen3_moe
from moe_rl.ports import free_port, free_ports
from moe_rl.spawn import RankFailed, run_ranks

__all__ = ["RankFailed", "TinyMoEConfig", "free_port", "free_ports", "make_tiny_qwen3_moe", "run_ranks"]
