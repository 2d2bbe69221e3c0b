"""Shared fixtures: tiny HF checkpoints built once per session."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (4 layers, 4 experts, top-2) saved with transformers."""
    from moe_rl.testing import make_tiny_qwen3_moe

    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
