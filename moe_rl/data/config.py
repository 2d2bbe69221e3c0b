"""The `data` section of the run config: prompt sources, keys, lengths, prompts per step.

The `check_*(cfg)` rules take the whole `RunConfig` (`moe_rl.config`, which imports this
module: hence `Any`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from moe_rl.configurable import ranged


DATA_SUFFIXES = (".jsonl", ".parquet")


@dataclass
class DataConfig:
    """Prompt datasets."""

    train: str = "toy:add-easy"
    """Training prompts: a .jsonl or .parquet file, or `toy:<task>` (built in, no download)."""
    eval: str | None = "toy:add-easy-eval"
    """Evaluation prompts in the same forms; None = no evaluation."""
    prompts_per_step: int = ranged(8, ge=1)
    """Prompts per RL step; each yields `rollout.n_samples` responses."""
    shuffle_seed: int = 0
    """Seed of the data order, separate from the model seed so either can change alone."""
    prompt_key: str = "prompt"
    """Record field holding the prompt."""
    answer_key: str = "answer"
    """Record field holding the reference answer passed to the reward."""
    max_prompt_len: int = ranged(256, ge=1)
    """Prompts longer than this many tokens are skipped, not truncated (truncation changes the task)."""


def _data_source_problem(key: str, spec: str) -> str | None:
    if spec.startswith("toy:"):
        return None if spec[4:].strip() else f"{key}: {spec!r} must name a task, e.g. toy:add-easy"
    if spec.endswith(DATA_SUFFIXES):
        return None
    return f"{key}: {spec!r} must be a {' or '.join(DATA_SUFFIXES)} file or toy:<task>"


def check_data(cfg: Any) -> Iterator[str]:
    for key, spec in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        problem = spec is not None and _data_source_problem(key, spec)
        if problem:
            yield problem
