"""Routed experts in two grouped matmuls on CPU, in place of megatron's per-expert loop.

Without transformer-engine, megatron-core 0.16.1 runs a layer's routed experts as `SequentialMLP`: a
Python loop over the local experts, each an `MLP` whose two parallel linear layers go through their
own autograd Functions, so one MoE layer costs ~8 x (2 Functions + 6 ops) forward and again backward
whatever the token count. Its grouped paths need a GPU (`TEGroupedMLP`: transformer-engine;
`GroupedMLP`: the CUDA `grouped_gemm` package, bf16 only). torch's `grouped_mm` runs on CPU, so this
module is `SequentialMLP` itself (the same parameters, state dict, sharded state dict, checkpoints and
weight names) with a forward that stacks the local experts' weights and runs all of them in two grouped
matmuls. It takes that path only where its math is exactly the loop's (the `MLP` branch without fused
kernels, quantisation or biases, on CPU, with dims `grouped_mm` accepts); elsewhere it is the loop.
It pays only where that Python cost dominates, small experts and few tokens (the bounds below), which
is where CPU runs live: the demo's 8-expert layer over one update's ~2,300 routed tokens in half the
loop's time, a ~20% shorter RL step (tools/bench/experts.py).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

_ALIGN = 16  # bytes: grouped_mm wants every row stride a multiple of 16 bytes
# Where the grouped path pays (tools/bench/experts.py, 1 thread): it saves the loop's fixed Python and
# autograd cost per expert, and pays a copy of every local expert weight (the stack) each pass and
# somewhat slower matmuls. So it wins on small experts and few tokens only: a tiny 8-expert layer at
# 2,304 routed tokens takes 0.5x the loop's time, at 16,384 tokens 1.0x; 16 experts of hidden 256 and
# FFN 512 take 1.8-2.0x at 32 tokens (the 24 MB stack). Above either bound, the loop runs.
_MAX_STACKED = 1 << 20  # elements of all local expert weights
_MAX_FC1_MACS = 1 << 24  # multiply-adds of one call's first matmul (routed tokens x hidden x fc1 width)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: grouped_mm's backward refuses the
    stride-0 (expanded) gradients a sum or mean downstream can produce."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedExperts(SequentialMLP):
    """`SequentialMLP` whose forward runs the local experts in two `grouped_mm`s where it can."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grouped = grouped_supported(self)

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        fc1_macs = hidden.shape[0] * hidden.shape[1] * self.local_experts[0].linear_fc1.weight.shape[0]
        if not self.grouped or hidden.device.type != "cpu" or fc1_macs > _MAX_FC1_MACS:
            return super().forward(hidden, tokens_per_expert, probs)
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: scale the input, then probs of 1
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        # each expert's rows are contiguous in the permuted input; offs are their cumulative ends
        offs = torch.cumsum(torch.as_tensor(tokens_per_expert, device=hidden.device), 0).to(torch.int32)
        experts = self.local_experts
        fc1 = torch.stack([e.linear_fc1.weight for e in experts]).transpose(1, 2)  # [E, in, out]
        fc2 = torch.stack([e.linear_fc2.weight for e in experts]).transpose(1, 2)
        inter = self._activation(F.grouped_mm(hidden, fc1, offs=offs))
        inter = (inter * probs.unsqueeze(-1)).to(inter.dtype)  # MLP's per_token_scale
        return _ContiguousGrad.apply(F.grouped_mm(inter, fc2, offs=offs)), None

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """`MLP.forward`'s unfused activation: GLU (with its clamp and linear offset) or plain."""
        cfg = self.config
        if not cfg.gated_linear_unit:
            return cfg.activation_func(x)
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (val := cfg.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)


def grouped_supported(experts: SequentialMLP) -> bool:
    """Whether the grouped forward computes exactly what the loop does for this config: more than one
    local expert, `MLP`'s unfused activation branch, no biases (the loop adds them per expert), no fp8
    or fp4 padding, no deferred or fused weight-gradient accumulation, no latent projection, dims
    `grouped_mm` accepts, and experts small enough that stacking their weights each pass pays.
    Expert-parallel and expert-TP layouts are local matmuls in the loop too (their communication is
    the token dispatcher's), so they take the grouped path as well."""
    cfg = experts.config
    if not hasattr(F, "grouped_mm") or experts.num_local_experts < 2:
        return False
    if (cfg.fp8 or cfg.fp4 or cfg.add_bias_linear or cfg.use_te_activation_func or cfg.bias_activation_fusion
            or cfg.gradient_accumulation_fusion or getattr(cfg, "delay_wgrad_compute", False)
            or getattr(cfg, "moe_latent_size", None) is not None):
        return False
    first = experts.local_experts[0]
    w1, w2 = first.linear_fc1.weight, first.linear_fc2.weight
    if sum(p.numel() for p in experts.parameters()) > _MAX_STACKED:
        return False
    return all(d * w1.element_size() % _ALIGN == 0 for d in (*w1.shape, *w2.shape))
