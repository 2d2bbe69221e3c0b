"""The modules every trainer rank imports before its first step, imported here in one place.

`moe_rl.dist.spawn.run_ranks(..., start_method="forkserver")` (the tests' `moe_rl.testing.run_ranks`)
starts its ranks from a fork server that imports this module once;
a rank started from a fresh interpreter would import megatron-core (which imports torch's compiler
stack for its fused kernels) and transformers itself, ~5 s of CPU per rank, most of a short
multi-process job such as a layout check.
"""
import megatron.core  # noqa: F401
import megatron.core.dist_checkpointing  # noqa: F401
import megatron.core.distributed  # noqa: F401
import megatron.core.models.gpt  # noqa: F401
import megatron.core.optimizer  # noqa: F401
import megatron.core.pipeline_parallel.schedules  # noqa: F401
import megatron.core.transformer.moe.moe_layer  # noqa: F401
import transformers  # noqa: F401
