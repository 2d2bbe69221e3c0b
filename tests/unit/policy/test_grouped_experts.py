"""`GroupedExperts`: megatron's expert loop (`SequentialMLP`) in two grouped matmuls, the same numbers.

The reference is megatron-core's own `SequentialMLP` holding the same weights: outputs and the
gradients of the input, the routing probabilities and every expert weight agree to fp32 rounding
(1e-5 relative; bf16: 2e-2) on an uneven dispatch with an expert that receives no token. Runs in one
spawned process, as megatron's groups need a default process group.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_rl.testing import run_ranks

# name -> TransformerConfig fields beyond the shared ones; whether the grouped path is expected
CASES = {
    "swiglu": ({}, True),                                                # Qwen3-MoE, DeepSeek-V3, ...
    "gelu": ({"gated_linear_unit": False, "activation_func": F.gelu}, True),
    "clamped_glu": ({"activation_func_clamp_value": 7.0, "glu_linear_offset": 1.0}, True),  # gpt-oss's GLU
    "probs_on_input": ({"moe_router_topk": 1, "moe_router_pre_softmax": True, "moe_apply_probs_on_input": True}, True),
    "bf16": ({"bf16": True, "params_dtype": torch.bfloat16}, True),
    "bias": ({"add_bias_linear": True}, False),         # the loop's own per-expert biases
    "unaligned": ({"moe_ffn_hidden_size": 30}, False),                   # grouped_mm wants 16-byte rows
    "large_experts": ({"moe_ffn_hidden_size": 2048}, False),             # stacking 1.5M weights a pass costs more
}


def _compare_in_a_fresh_process() -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_rl.policy.grouped_experts import GroupedExperts
    from moe_rl.policy.parallel import ParallelLayout, init_distributed

    init_distributed(ParallelLayout())
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    from moe_rl.policy.model import layer_spec

    moe_layer = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                                  moe_ffn_hidden_size=32, add_bias_linear=False, use_cpu_initialization=True)
    out = {"cpu_spec_experts": layer_spec(moe_layer).layer_specs[0].submodules.mlp.submodules.experts.module.__name__}
    for name, (fields, _) in CASES.items():
        base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_ffn_hidden_size=32,
                    moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                    bias_activation_fusion=False, gradient_accumulation_fusion=False, use_cpu_initialization=True)
        cfg = TransformerConfig(**(base | fields))
        subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        torch.manual_seed(0)
        loop = SequentialMLP(4, cfg, subs, pg_collection=pgs)
        grouped = GroupedExperts(4, cfg, subs, pg_collection=pgs)
        grouped.load_state_dict(loop.state_dict())
        dtype = cfg.params_dtype
        tokens = torch.tensor([5, 0, 9, 3])                  # uneven, expert 1 receives nothing
        x = torch.randn(int(tokens.sum()), 64, dtype=dtype)
        probs = torch.rand(int(tokens.sum()))
        res = {"grouped_path": grouped.grouped}
        out[name] = res
        if not grouped.grouped:  # the loop itself runs: nothing to compare
            continue
        for grad_kind in ("dense", "expanded"):
            runs = []
            for module in (loop, grouped):
                module.zero_grad(set_to_none=True)
                xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
                y, _ = module(xi, tokens, pi)
                if grad_kind == "dense":
                    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
                else:                                        # a sum's gradient: stride 0
                    y.float().sum().backward()
                grads = [xi.grad, pi.grad] + [p.grad for p in module.parameters()]
                runs.append([y.detach().float()] + [g.float() for g in grads])
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            res[grad_kind] = max(float((a - b).abs().max() / (b.abs().max() + 1e-12))
                                 for a, b in zip(*runs))
            res[f"{grad_kind}_tol"] = tol
    return out


@pytest.fixture(scope="module")
def compared() -> dict:
    return run_ranks(_compare_in_a_fresh_process, 1, timeout=240)[0]


@pytest.mark.parametrize("case", [c for c, (_, grouped) in CASES.items() if grouped])
def test_grouped_experts_match_megatrons_loop(compared: dict, case: str) -> None:
    res = compared[case]
    assert res["grouped_path"]
    for grad_kind in ("dense", "expanded"):
        assert res[grad_kind] <= res[f"{grad_kind}_tol"], (case, grad_kind, res)


@pytest.mark.parametrize("case", [c for c, (_, grouped) in CASES.items() if not grouped])
def test_configs_the_grouped_path_cannot_compute_exactly_keep_the_loop(compared: dict, case: str) -> None:
    assert not compared[case]["grouped_path"]


def test_the_cpu_layer_spec_builds_grouped_experts(compared: dict) -> None:
    assert compared["cpu_spec_experts"] == "GroupedExperts"
