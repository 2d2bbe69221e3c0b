"""`compat.native`: a block runs outside the CPU redirect, and only where that is safe.

Runs in a spawned process (`run_ranks`), as every test that activates compat: its
redirect stays on for the life of the process that activates it.
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.testing import run_ranks


def _redirected(device: str) -> str:
    """Where a tensor asked for on `device` lands, or the error's type."""
    try:
        return torch.zeros(1, device=device).device.type
    except (AssertionError, RuntimeError) as e:
        return type(e).__name__


def _native_in_a_fresh_process() -> dict:
    from torch.overrides import TorchFunctionMode

    from moe_rl.policy import compat

    class Counting(TorchFunctionMode):  # a mode above compat's, as the device guard's: it sees every op
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    compat.activate()
    out = {"before": _redirected("cuda")}
    with compat.native():
        out["inside"] = _redirected("cuda")
    out["after"] = _redirected("cuda")
    with Counting():
        with compat.native():
            out["under_another_mode"] = _redirected("cuda")
            torch.ones(2).sum()
    out["other_mode_calls"] = Counting.calls
    out["backward_modes"] = _modes_in_megatrons_backward()
    return out


def _modes_in_megatrons_backward() -> list[str]:
    """The torch-function modes active inside the autograd backward of megatron's schedule (its
    `custom_backward`, which calls the engine directly: the backward runs under the caller's modes)."""
    from megatron.core.pipeline_parallel import schedules

    seen: list[str] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.extend(type(m).__name__ for m in torch.overrides._get_current_function_mode_stack())
            return g * 2

    x = torch.ones(3, requires_grad=True)

    class Config:  # the fields backward_step reads
        timers = grad_scale_func = None
        deallocate_pipeline_outputs = True

    schedules.backward_step(None, Probe.apply(x).sum(), None, None, Config())
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    return seen


@pytest.fixture(scope="module")
def probed() -> dict:
    if torch.cuda.is_available():
        pytest.skip("compat redirects only on machines without CUDA")
    return run_ranks(_native_in_a_fresh_process, 1)[0]


def test_native_suspends_the_redirect_for_the_block_only_and_not_under_another_mode(probed):
    out = probed
    assert (out["before"], out["after"]) == ("cpu", "cpu")  # redirected outside the block
    assert out["inside"] != "cpu"  # inside it, a CUDA tensor is refused as on any CPU machine
    assert out["under_another_mode"] == "cpu"  # a mode on top: compat stays, the other mode too
    assert out["other_mode_calls"] >= 3


def test_megatrons_backward_runs_outside_the_redirect(probed):
    """The backward names no CUDA device: it runs without the redirect's per-op detour."""
    assert probed["backward_modes"] == []
