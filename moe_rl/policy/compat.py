"""Run megatron-core on CPU + gloo.

megatron-core has no supported CPU path: it assumes a CUDA device in a handful of
places (buffer allocation, RNG trackers, stream sync, optimizer type checks). None of
those assumptions matter for the maths, so on a machine without CUDA we redirect them
to the CPU. Nothing here edits megatron's source files; everything is a runtime
redirection that is active only when `torch.cuda.is_available()` is False. On a GPU
`activate()` does nothing; only `define_missing_te_gemm` (a megatron bug without
transformer-engine, not a CPU matter) is applied there too.

Each piece below says which megatron call site needs it. The list was established
against megatron-core 0.16.1 by running TP/PP/EP/DP layouts with DDP and the optimizer.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False
_CPU = torch.device("cpu")

# Tensor.type() names that megatron's optimizers assert on (`param.type() ==
# 'torch.cuda.FloatTensor'`, clip_grads, distrib_optimizer): report the CUDA name.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def is_cuda_device(device: Any) -> bool:
    """Whether torch reads `device` (a torch.device, "cuda..." string or bare index) as a CUDA device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "cuda:<int>" to torch (megatron passes
    # torch.cuda.current_device()). Booleans are ints too: leave them alone.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Map every CUDA device argument to the CPU.

    Needed for `device=torch.cuda.current_device()` / `device="cuda"` literals in
    megatron's memory buffers, DDP buckets, p2p shape exchange and pipeline schedules,
    and for `.cuda()` / `.to("cuda")` calls on tensors.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_CPU if (i > 0 and is_cuda_device(a) and not isinstance(a, int)) else a
                         for i, a in enumerate(args))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


@contextmanager
def native() -> Iterator[None]:
    """Run a block without the CUDA-to-CPU redirect: for code that names no CUDA device
    (the model's forward, the in-process rollout engine).

    The redirect is a `TorchFunctionMode`, so every torch call under it, tensor methods
    and `len(tensor)` included, takes a detour through Python (about 1-2 us each): a tenth
    of a tiny model's RL step. Only compat's own mode is suspended, and only where it is
    the innermost one: a mode pushed on top of it (the test device guard, which must see
    every op) keeps both in place. Without compat active this does nothing.
    """
    # torch has no public way to read or pop the mode stack; these two are what its own
    # `TorchFunctionMode.__torch_function__` implementations use.
    stack = torch.overrides._get_current_function_mode_stack()
    if not stack or not isinstance(stack[-1], _CudaToCpu):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """megatron's `get_default_causal_mask` (a `device="cuda"` literal), on the CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _noop(name: str) -> Any:
    """A fresh no-op per patched name: torch.compile's trace rules reject one function
    object registered under two torch names."""
    def noop(*_args: Any, **_kwargs: Any) -> None:
        return None

    noop.__name__ = noop.__qualname__ = f"cpu_{name}"
    return noop


class _NullStream:
    """Stands in for `torch.cuda.current_stream()`; megatron only waits on it or syncs it."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        pass

    def wait_event(self, _event: Any) -> None:
        pass

    def record_event(self, _event: Any = None) -> None:
        pass


def activate() -> bool:
    """Install the CPU redirections if CUDA is absent. Idempotent. Returns True if active."""
    global _ACTIVE
    if _ACTIVE:
        return True
    if torch.cuda.is_available():
        return False

    # Buffers, schedules and `.cuda()` calls: see _CudaToCpu. Entered for the life of
    # the process (and the thread that activates it, which is the training thread).
    _CudaToCpu().__enter__()

    # Allocation sites call torch.cuda.current_device() and pass the result as a device.
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
    torch.cuda.set_device = _noop("set_device")  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 0  # type: ignore[assignment]

    # RNG: model_parallel_cuda_manual_seed and CudaRNGStatesTracker save, seed and
    # restore "the CUDA generator"; on CPU the CPU generator plays that part.
    torch.cuda.get_rng_state = _cpu_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = _set_cpu_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = _set_cpu_rng_state

    # Stream and device synchronisation used around p2p and optimizer steps: CPU
    # ops are synchronous, so these are no-ops.
    torch.cuda.synchronize = _noop("synchronize")  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    torch.cuda.empty_cache = _noop("empty_cache")  # type: ignore[assignment]

    # The unfused softmax builds its causal mask with a `device="cuda"` literal; the model's
    # forward runs outside the redirect (`native`), so the name it calls is redirected.
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = _cpu_causal_mask

    # The backward runs megatron's autograd functions and DDP's gradient hooks: no CUDA device
    # named there (allocations ask torch.cuda.current_device(), redirected above), so it runs
    # outside the redirect like the forward, without the mode's detour on each of its ops (a
    # tiny model's update took 4% less in one interleaved A/B). The schedule's `custom_backward`
    # (deallocate_pipeline_outputs) calls the autograd engine directly, which runs the backward
    # under the caller's modes.
    from megatron.core.pipeline_parallel import schedules

    schedules.backward_step = native()(schedules.backward_step)  # a contextmanager decorates, fresh per call

    define_missing_te_gemm()
    _ACTIVE = True
    return True


def define_missing_te_gemm() -> None:
    """megatron-core 0.16.x references `te_general_gemm` in the router's fp32 GEMM even
    when transformer-engine is not installed (NameError, on CPU and GPU alike). None
    selects the plain torch path that the same function already has. Needed on any
    machine without transformer-engine, so it is applied on GPU too."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mla_without_te() -> None:
    """Without transformer-engine, megatron-core 0.16.1's `extensions/transformer_engine.py` still
    imports (its `te` a stand-in object), so `multi_latent_attention.HAVE_TE` is True and MLA's
    `isinstance(self.linear_proj, TELinear)` raises TypeError. Tell MLA the truth. Needed on any
    machine without transformer-engine (DeepSeek-V3's attention), on GPU too."""
    import megatron.core.transformer.multi_latent_attention as mla

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        mla.HAVE_TE = False


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's `l2norm`: x / sqrt(sum(x^2) + eps) over `dim`."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def gated_delta_net_without_fla() -> bool:
    """megatron-core 0.16.1's `ssm/gated_delta_net.py` needs flash-linear-attention (Triton kernels)
    for Qwen3-Next's linear attention: `GatedDeltaNet.__init__` raises ImportError without it
    (`HAVE_FLA`), its forward calls fla's `l2norm` on q and k unconditionally, and fla's
    `chunk_gated_delta_rule` unless `deterministic_mode`. Without fla, give it torch stand-ins: the
    l2norm above and megatron's own `torch_chunk_gated_delta_rule` (the same chunked recurrence,
    in torch). The causal convolution already falls back to `nn.Conv1d` without causal-conv1d.
    Applied only where fla does not import (CPU, or a GPU without it); returns True if applied."""
    import megatron.core.ssm.gated_delta_net as gdn

    if gdn.HAVE_FLA and getattr(gdn, "chunk_gated_delta_rule", None) is not gdn.torch_chunk_gated_delta_rule:
        return False  # the real kernels
    gdn.HAVE_FLA = True
    gdn.l2norm = _l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    return True


def is_active() -> bool:
    """True once the CPU redirections are installed in this process."""
    return _ACTIVE

