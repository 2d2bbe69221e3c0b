"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): GQA with partial rotary (the first `partial_rotary_factor` of
each head, halves rotated as Llama's), q/k/v biases (`attention_bias`), optional QK-norm,
`first_k_dense_replace` dense layers, `n_shared_experts` always-on experts (no gate) and a sigmoid
router with a selection bias, renormalised top-k and `routed_scaling_factor`."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from moe_rl.policy.arch import MoEArch
from moe_rl.policy.families import qwen3_moe
from moe_rl.policy.families.family import Family, Shard, partial_rotary, plus, qkv_bias, shared_experts, sigmoid_router
from moe_rl.policy.families.family import hf_config as named_config


def read(cfg: dict[str, Any]) -> MoEArch:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(partial_rotary(cfg, params) or 0.5)
    experts = int(cfg["n_routed_experts"])
    dense = int(cfg.get("first_k_dense_replace", 1))
    arch = qwen3_moe.read({**cfg, "num_experts": experts, "decoder_sparse_step": 1,
                           "mlp_only_layers": list(range(min(dense, int(cfg["num_hidden_layers"]))))})
    heads = arch.num_attention_heads
    return replace(arch, family="glm4_moe", qk_layernorm=bool(cfg.get("use_qk_norm", False)),
                   qkv_bias=bool(cfg.get("attention_bias", False)),
                   kv_channels=int(cfg.get("head_dim") or arch.hidden_size // heads), rotary_percent=partial,
                   shared_expert_size=int(cfg.get("n_shared_experts") or 0) * arch.moe_ffn_hidden_size or None,
                   hf_architecture="Glm4MoeForCausalLM", **sigmoid_router(cfg, experts, arch.moe_router_topk))


# q/k/v biases, ungated shared experts (`mlp.shared_experts.*`, DeepSeek's names) and the router's
# selection bias (`mlp.gate.e_score_correction_bias`, megatron's buffer `mlp.router.expert_bias`).
weight_map = plus(qwen3_moe.weight_map, lambda p: qkv_bias(p) | shared_experts(p, "shared_experts") | {
    "mlp.router.expert_bias": Shard((f"{p}mlp.gate.e_score_correction_bias",))})


def hf_config(**kw: Any) -> Any:
    """transformers' Glm4MoeConfig, its architecture named, without multi-token-prediction layers."""
    return named_config("Glm4Moe", **({"num_nextn_predict_layers": 0} | kw))


def tiny(c: Any) -> Any:
    """GLM-4.5 keeps its own layout: the first layer dense, one shared expert, RoPE on half of each
    head, q/k/v biases."""
    return hf_config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
                     num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, n_routed_experts=c.num_experts, n_shared_experts=1,
                     num_experts_per_tok=c.num_experts_per_tok, first_k_dense_replace=1,
                     norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
                     max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                     tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
                     eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
                     rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                                      "partial_rotary_factor": 0.5})


# Unlike the others: head_dim 12 of which RoPE rotates half, q/k/v biases and QK-norm, a dense first
# layer, a shared expert, 6 experts behind a sigmoid router whose selection bias is not zero (the
# tiny models draw it), and routed_scaling_factor 2.5.
TINY = dict(vocab_size=96, hidden_size=40, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_routed_experts=6, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1,
            topk_group=1, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})

FAMILY = Family("glm4_moe", "Glm4MoeForCausalLM", ("glm4_moe",), read, weight_map, example=TINY,
                hf_config=hf_config, tiny=tiny)
