"""Test helpers: the multi-process runner, tiny model checkpoints, free ports (nothing in the product
imports this package; the helpers themselves live where the product uses them)."""
from functools import partial
from typing import Any, Callable

from moe_rl.dist import spawn
from moe_rl.dist.ports import free_port, free_ports
from moe_rl.dist.spawn import RankFailed
from moe_rl.policy.families.registry import make_example
from moe_rl.policy.tiny import TinyMoEConfig, make_tiny_qwen3_moe

# Each family's tiny test model (`make_tiny_<family>(out_dir, seed=0, init_std=..., **overrides)`: its
# `example` shape in moe_rl/policy/families/<family>.py, with `overrides`).
make_tiny_qwen2_moe = partial(make_example, "qwen2_moe")
make_tiny_mixtral = partial(make_example, "mixtral")
make_tiny_glm4_moe = partial(make_example, "glm4_moe")
make_tiny_deepseek_v3 = partial(make_example, "deepseek_v3")
make_tiny_qwen3_next = partial(make_example, "qwen3_next")
make_tiny_qwen3_5_moe = partial(make_example, "qwen3_5_moe")

__all__ = ["RankFailed", "TinyMoEConfig", "free_port", "free_ports", "make_tiny_deepseek_v3", "make_tiny_glm4_moe",
           "make_tiny_mixtral", "make_tiny_qwen2_moe", "make_tiny_qwen3_5_moe", "make_tiny_qwen3_moe",
           "make_tiny_qwen3_next", "run_ranks"]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`moe_rl.dist.spawn.run_ranks` with the ranks forked from a server that imported megatron-core
    and transformers once: ~5 s of CPU less per rank, most of a short multi-process test."""
    return spawn.run_ranks(fn, world_size, *args, start_method="forkserver", **kwargs)
