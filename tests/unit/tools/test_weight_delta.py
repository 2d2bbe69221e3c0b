"""tools/bench/weight_delta.py's accounting on hand-checkable examples (no RL run): the tensor kinds
of Qwen3-MoE / Qwen2-MoE / DeepSeek-style HF names, bit-exact bf16 change counts, the bytes of
each delta encoding, the per-expert token counts, and the rank correlation."""
from __future__ import annotations

import math

import pytest
import torch


def test_tensor_kinds(bench):
    wd = bench["weight_delta"]
    kinds = {
        "model.layers.0.self_attn.q_proj.weight": "attention",
        "model.layers.0.self_attn.k_norm.weight": "attention",
        "model.layers.3.self_attn.o_proj.weight": "attention",
        "model.layers.1.mlp.gate.weight": "router",
        "model.layers.1.mlp.gate.e_score_correction_bias": "router",
        "model.layers.1.mlp.shared_expert.down_proj.weight": "shared expert",
        "model.layers.1.mlp.shared_expert_gate.weight": "shared expert",
        "model.layers.2.mlp.experts.7.gate_proj.weight": "routed experts",
        "model.layers.2.mlp.experts.12.down_proj.weight": "routed experts",
        "model.embed_tokens.weight": "embeddings and lm_head",
        "lm_head.weight": "embeddings and lm_head",
        "model.layers.0.input_layernorm.weight": "layer norms",
        "model.layers.0.post_attention_layernorm.weight": "layer norms",
        "model.norm.weight": "layer norms",
        "model.layers.0.mlp.gate_proj.weight": "dense mlp",
    }
    assert {n: wd.tensor_kind(n) for n in kinds} == kinds
    assert set(kinds.values()) <= set(wd.KINDS)
    assert wd.expert_of("model.layers.2.mlp.experts.12.down_proj.weight") == (2, 12)
    assert wd.expert_of("model.layers.2.mlp.gate.weight") is None


def test_changed_elements_are_bf16_bits(bench):
    wd = bench["weight_delta"]
    prev = torch.tensor([1.0, 0.02, -0.5, 0.0]).bfloat16()
    # 1.0 + 1e-6 rounds back to 1.0 in bf16 (spacing 2^-7 above 1); 0.02 -> 0.021 moves; -0 != +0 in bits
    cur = torch.tensor([1.0 + 1e-6, 0.021, -0.5, -0.0]).bfloat16()
    assert wd.changed_elements(prev, cur) == 2
    assert wd.changed_elements(prev, prev.clone()) == 0
    with pytest.raises(ValueError):
        wd.changed_elements(prev, cur.float())


def test_push_bytes_and_step_summary(bench):
    wd = bench["weight_delta"]
    # 100 elements: full 200 B; 10 changed -> elements 60 B < whole 200 B; 50 changed -> 300 B > 200 B
    assert wd.push_bytes(100, 0) == {"full": 200, "tensor": 0, "element": 0, "best": 0}
    assert wd.push_bytes(100, 10) == {"full": 200, "tensor": 200, "element": 60, "best": 60}
    assert wd.push_bytes(100, 50) == {"full": 200, "tensor": 200, "element": 300, "best": 200}
    numel = {"a": 100, "b": 100, "c": 200}
    changed = {"a": 0, "b": 10, "c": 200}
    s = wd.step_summary(numel, changed, numel)
    assert s["changed"] == pytest.approx(210 / 400)
    assert s["unchanged_tensors"] == pytest.approx(1 / 3)
    assert s["tensor_bytes"] == pytest.approx((200 + 400) / 800)     # b and c whole
    assert s["element_bytes"] == pytest.approx(6 * 210 / 800)
    assert s["best_bytes"] == pytest.approx((60 + 400) / 800)        # b as elements, c whole


def test_route_counter_counts_tokens_that_reach_the_loss(bench):
    wd = bench["weight_delta"]
    counter = wd.RouteCounter.__new__(wd.RouteCounter)  # no policy: only the counting
    from moe_rl.drift.metrics import expert_load

    counter._load, counter.experts, counter.last = expert_load, 3, [False, True]  # 2 MoE layers, the 2nd last
    counter.reset()
    # two sequences of lengths 4 and 3 -> 3 and 2 routed rows; routes [B=2, T-1=3, L=2, K=1]
    routes = torch.tensor([[[[0], [1]], [[1], [1]], [[2], [2]]],
                           [[[0], [0]], [[2], [1]], [[0], [0]]]])  # row 2 of sequence 1 is padding
    loss_mask = torch.tensor([[0, 1, 0], [0, 1, 0]])  # one loss row each (row 1)
    counter.count(routes, torch.tensor([4, 3]), loss_mask, torch.tensor([0.5, 0.0]))  # 2nd: no gradient
    assert counter.routed.tolist() == [[2, 1, 2], [1, 3, 1]]
    # layer 0: sequence 0's rows up to its loss row (0, 1); layer 1 (last): its loss row alone
    assert counter.gradient.tolist() == [[1, 1, 0], [0, 1, 0]]


def test_spearman(bench):
    wd = bench["weight_delta"]
    assert wd.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert wd.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert wd._ranks([5, 1, 5, 2]) == [3.5, 1.0, 3.5, 2.0]
    assert math.isnan(wd.spearman([1, 2, 3], [7, 7, 7]))
