"""Prompt data: datasets from files or toy tasks, and the per-step sampler.

Names load with their module on first use (`moe_rl.lazy`): `moe_rl.config` reads this
package's `config.py` without importing the rest.
"""
from moe_rl.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "dataset": ("DataError", "Prompt", "PromptDataset", "TokenizerLike", "load_dataset", "load_toy_dataset"),
    "sampler": ("PromptSampler", "seeded_shuffle"),
    "toy": ("TOY_TOKENS", "ToyExample", "ToyTask", "ToyTokenizer", "chance_level", "get_toy_task",
            "make_toy_examples", "register_toy_task", "toy_task_names"),
})
