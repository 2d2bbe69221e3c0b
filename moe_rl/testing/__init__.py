"""Test helpers shipped with the package: multi-process runner and tiny model checkpoints."""
from moe_rl.ports import free_port, free_ports
from moe_rl.testing.dist import RankFailed, run_ranks
from moe_rl.testing.tiny import TinyMoEConfig, make_tiny_qwen3_moe

__all__ = ["RankFailed", "TinyMoEConfig", "free_port", "free_ports", "make_tiny_qwen3_moe", "run_ranks"]
