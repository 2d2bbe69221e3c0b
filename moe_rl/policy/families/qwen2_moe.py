"""Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen3-MoE's block with q/k/v biases instead of QK-norm, top-k
probabilities not renormalised by default (norm_topk_prob false), and a shared expert behind a
sigmoid gate (`mlp.shared_expert*`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from moe_rl.policy.arch import MoEArch, UnsupportedModel
from moe_rl.policy.families import qwen3_moe
from moe_rl.policy.families.family import Family, Shard, plus, qkv_bias, shared_experts
from moe_rl.policy.families.family import hf_config as named_config


def read(cfg: dict[str, Any]) -> MoEArch:
    if cfg.get("use_sliding_window"):
        raise UnsupportedModel("Qwen2-MoE with use_sliding_window=true is not supported yet "
                               "(megatron's local spec has no sliding-window attention on CPU)")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return replace(qwen3_moe.read(cfg), family="qwen2_moe", qk_layernorm=False, qkv_bias=True,
                   shared_expert_size=shared or None, shared_expert_gate=bool(shared),
                   hf_architecture="Qwen2MoeForCausalLM")


weight_map = plus(qwen3_moe.weight_map, lambda p: qkv_bias(p) | shared_experts(p, "shared_expert") | {
    "mlp.shared_experts.gate_weight": Shard((f"{p}mlp.shared_expert_gate.weight",))})


def hf_config(**kw: Any) -> Any:
    """transformers' Qwen2MoeConfig, its architecture named."""
    return named_config("Qwen2Moe", **kw)


def tiny(c: Any) -> Any:
    """Its head width is hidden / heads; its shared expert as wide as a routed one."""
    kw = {k: v for k, v in c.__dict__.items() if k not in ("head_dim", "rope_theta")}
    return hf_config(**kw, shared_expert_intermediate_size=c.moe_intermediate_size, use_sliding_window=False,
                     rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})


# Unlike `TinyMoEConfig` (head_dim 10, a dense first layer, a gated shared expert, q/k/v biases,
# top-k not renormalised).
TINY = dict(vocab_size=96, hidden_size=40, intermediate_size=56, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
            mlp_only_layers=[0], decoder_sparse_step=1, max_position_embeddings=256, rope_theta=1e6,
            rms_norm_eps=1e-6, use_sliding_window=False, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)

FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM", ("qwen2_moe",), read, weight_map, example=TINY,
                hf_config=hf_config, tiny=tiny)
