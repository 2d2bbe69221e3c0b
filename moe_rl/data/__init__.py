"""Prompt data: datasets from files or toy tasks, and the per-step sampler."""
from moe_rl.data.dataset import (DataError, Prompt, PromptDataset, TokenizerLike, load_dataset,
                                 load_toy_dataset)
from moe_rl.data.sampler import PromptSampler, seeded_shuffle
from moe_rl.data.toy import (TOY_TOKENS, ToyExample, ToyTask, ToyTokenizer, chance_level, get_toy_task,
                             make_toy_examples, register_toy_task, toy_task_names)

__all__ = [
    "DataError", "Prompt", "PromptDataset", "PromptSampler", "TOY_TOKENS", "TokenizerLike", "ToyExample",
    "ToyTask", "ToyTokenizer", "chance_level", "get_toy_task", "load_dataset", "load_toy_dataset",
    "make_toy_examples", "register_toy_task", "seeded_shuffle", "toy_task_names",
]
