"""Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA with QK-norm, MoE layers every `decoder_sparse_step`
but the `mlp_only_layers`, a softmax router. The other families build on its reader and its map."""
from __future__ import annotations

from typing import Any

from moe_rl.policy.arch import MoEArch, UnsupportedModel
from moe_rl.policy.families.family import Family, Shard, rope_theta
from moe_rl.policy.families.family import hf_config as named_config


def read(cfg: dict[str, Any]) -> MoEArch:
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0)
    rope_type = (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type not in (None, "default"):
        raise UnsupportedModel(f"rope_type={rope_type!r} is not supported yet (only 'default')")
    heads = int(cfg["num_attention_heads"])
    return MoEArch(
        family="qwen3_moe",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads", heads)),
        kv_channels=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        ffn_hidden_size=int(cfg.get("intermediate_size", 0)),
        num_moe_experts=int(experts) if experts else None,
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]) if experts else None,
        moe_router_topk=int(cfg.get("num_experts_per_tok", 1)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0),
        moe_layers=moe_layers,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hf_architecture="Qwen3MoeForCausalLM",
    )


def weight_map(name: str, layer: int | None, expert: int | None, arch: MoEArch) -> Shard | None:
    """Map a megatron name (layer-relative part, global layer and expert ids) to HF. None = skip."""
    p = f"model.layers.{layer}." if layer is not None else ""
    if layer is None:
        return {
            "embedding.word_embeddings.weight": Shard(("model.embed_tokens.weight",), dim=0),
            "decoder.final_layernorm.weight": Shard(("model.norm.weight",)),
            "output_layer.weight": Shard(("model.embed_tokens.weight" if arch.tie_word_embeddings
                                          else "lm_head.weight",), dim=0),
        }.get(name)
    if expert is not None:
        fc = name
        if fc == "linear_fc1":
            return Shard((f"{p}mlp.experts.{expert}.gate_proj.weight", f"{p}mlp.experts.{expert}.up_proj.weight"),
                         kind="glu", dim=0, group="etp")
        return Shard((f"{p}mlp.experts.{expert}.down_proj.weight",), dim=1, group="etp")
    return {
        "input_layernorm.weight": Shard((f"{p}input_layernorm.weight",)),
        "self_attention.linear_qkv.layer_norm_weight": Shard((f"{p}input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": Shard((f"{p}self_attn.q_proj.weight", f"{p}self_attn.k_proj.weight",
                                                   f"{p}self_attn.v_proj.weight"), kind="qkv", dim=0),
        "self_attention.linear_proj.weight": Shard((f"{p}self_attn.o_proj.weight",), dim=1),
        "self_attention.q_layernorm.weight": Shard((f"{p}self_attn.q_norm.weight",)),
        "self_attention.k_layernorm.weight": Shard((f"{p}self_attn.k_norm.weight",)),
        "pre_mlp_layernorm.weight": Shard((f"{p}post_attention_layernorm.weight",)),
        "mlp.linear_fc1.layer_norm_weight": Shard((f"{p}post_attention_layernorm.weight",)),
        "mlp.router.weight": Shard((f"{p}mlp.gate.weight",)),
        "mlp.linear_fc1.weight": Shard((f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"), kind="glu", dim=0),
        "mlp.linear_fc2.weight": Shard((f"{p}mlp.down_proj.weight",), dim=1),
    }.get(name)


def tiny(c: Any) -> Any:
    """The fresh model of a `TinyMoEConfig` shape: its fields are Qwen3-MoE's config keys."""
    return c.to_hf()


def hf_config(**kw: Any) -> Any:
    """transformers' Qwen3MoeConfig, its architecture named."""
    return named_config("Qwen3Moe", **kw)


# Its tiny test model is the demo's: `TinyMoEConfig`'s defaults (moe_rl/policy/tiny.py).
FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",), read, weight_map, example={},
                hf_config=hf_config, tiny=tiny)
