"""Qwen3-Next (`Qwen3NextForCausalLM`): gated delta net (linear attention) layers and gated
full-attention layers (`layer_types`, or every `full_attention_interval`-th layer full), the full ones
with QK-norm, partial rotary and an output gate; Qwen3-MoE's experts (`decoder_sparse_step`,
`mlp_only_layers`) with a shared expert behind a sigmoid gate; RMSNorms that scale by (1 + w)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from moe_rl.policy.arch import LinearAttentionDims, MoEArch, UnsupportedModel
from moe_rl.policy.families import qwen2_moe, qwen3_moe
from moe_rl.policy.families.family import Family, Shard, partial_rotary
from moe_rl.policy.families.family import hf_config as named_config


def read(cfg: dict[str, Any], name: str = "Qwen3-Next") -> MoEArch:
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise UnsupportedModel(f"{name} layer_types={types!r}: expected {layers} entries, each "
                               "'linear_attention' or 'full_attention'")
    if cfg.get("attention_bias"):
        raise UnsupportedModel(f"{name} with attention_bias=true is not supported (megatron-core's gated "
                               "attention is read without biases here)")
    if (cfg.get("hidden_act") or "silu") != "silu":
        raise UnsupportedModel(f"{name} with hidden_act={cfg['hidden_act']!r} is not supported: megatron-core's "
                               "gated delta net and experts are built with silu")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(partial_rotary(cfg, params) or 0.25)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    if int(head_dim * partial) % 2:
        raise UnsupportedModel(f"{name} partial_rotary_factor={partial} of head_dim={head_dim} rotates an odd "
                               f"number of dims ({int(head_dim * partial)})")
    key_heads, value_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if value_heads % key_heads:
        raise UnsupportedModel(f"{name} linear_num_value_heads={value_heads} is not a multiple of "
                               f"linear_num_key_heads={key_heads}")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if not shared:  # HF builds the shared expert and its gate whatever the width
        raise UnsupportedModel(f"{name} with shared_expert_intermediate_size=0 is not supported")
    linear = LinearAttentionDims(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"), key_heads=key_heads,
        value_heads=value_heads, key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]), conv_kernel=int(cfg["linear_conv_kernel_dim"]))
    arch = qwen3_moe.read({**cfg, "head_dim": head_dim})
    if arch.num_moe_experts is None:
        raise UnsupportedModel(f"{name} with num_experts=0 is not supported")
    return replace(arch, family="qwen3_next", rotary_percent=partial, shared_expert_size=shared,
                   shared_expert_gate=True, linear_attention=linear, attention_output_gate=True,
                   zero_centered_norms=True, hf_architecture="Qwen3NextForCausalLM")


def weight_map(name: str, layer: int | None, expert: int | None, arch: MoEArch) -> Shard | None:
    """Qwen2-MoE's gated shared expert, gated full attention with QK-norm (`qgkv`), and on
    linear-attention layers the gated delta net (`linear_attn.*`). Its RMSNorm weights are HF's w as
    they are: megatron's norms are zero-centred (1 + w), as HF's; the delta net's output norm scales
    by w in both."""
    if layer is None or expert is not None:
        return qwen2_moe.weight_map(name, layer, expert, arch)
    p = f"model.layers.{layer}."
    a, la = f"{p}self_attn.", f"{p}linear_attn."
    found = {
        "self_attention.linear_qkv.weight": Shard((f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight"),
                                                  kind="qgkv", dim=0),
        "self_attention.in_proj.weight": Shard((f"{la}in_proj_qkvz.weight", f"{la}in_proj_ba.weight"),
                                               kind="gdn_in", dim=0),
        "self_attention.in_proj.layer_norm_weight": Shard((f"{p}input_layernorm.weight",)),
        "self_attention.conv1d.weight": Shard((f"{la}conv1d.weight",), kind="gdn_conv", dim=0),
        "self_attention.dt_bias": Shard((f"{la}dt_bias",), dim=0),
        "self_attention.A_log": Shard((f"{la}A_log",), dim=0),
        "self_attention.out_norm.weight": Shard((f"{la}norm.weight",)),
        "self_attention.out_proj.weight": Shard((f"{la}out_proj.weight",), dim=1),
    }.get(name)
    return found or qwen2_moe.weight_map(name, layer, expert, arch)


def hf_config(**kw: Any) -> Any:
    """transformers' Qwen3NextConfig, its architecture named."""
    return named_config("Qwen3Next", **kw)


def tiny(c: Any) -> Any:
    """The delta net at even layers: KV heads as key heads, query heads as value heads, the attention's widths."""
    return hf_config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, shared_expert_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, linear_num_key_heads=c.num_key_value_heads,
        linear_num_value_heads=c.num_attention_heads, linear_key_head_dim=c.head_dim,
        linear_value_head_dim=c.head_dim, linear_conv_kernel_dim=4, num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(c.num_hidden_layers)],
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": 0.25})


# Parameters HF starts at a constant (its (1 + w) norms at w = 0), drawn in the tiny models.
DRAWN = ("norm.weight", "layernorm.weight", ".dt_bias", ".A_log")

# Unlike the others: layers 0 and 2 gated delta net (linear attention: 2 key heads of 6, 4 value
# heads of 10, a conv of 4), 1 and 3 gated full attention (4 heads of 24 over 2 query groups, RoPE on
# a quarter of each head, the output scaled by sigmoid(gate)); every layer MoE with 4 experts top-2
# and a gated shared expert; (1 + w) RMSNorms. Every 2-rank layout divides it.
TINY = dict(vocab_size=96, hidden_size=40, intermediate_size=48, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=6, linear_value_head_dim=10, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})

FAMILY = Family("qwen3_next", "Qwen3NextForCausalLM", ("qwen3_next",), read, weight_map, example=TINY,
                hf_config=hf_config, tiny=tiny, perturb=DRAWN, linear_attention=True)
