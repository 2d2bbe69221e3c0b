"""Fixtures shared by the drift tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one intra-op thread; more only spin against other jobs on a shared box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
