"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; also Kimi-K2 and Moonlight, which share its class):
multi-latent attention with interleaved RoPE (plain or YaRN), `first_k_dense_replace` dense layers,
shared experts and a sigmoid router with a selection bias, group-limited top-k and
`routed_scaling_factor`. Multi-token-prediction layers (`num_nextn_predict_layers`) are not read: RL
trains the decoder layers."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from moe_rl.policy.arch import MLADims, MoEArch, UnsupportedModel
from moe_rl.policy.families import glm4_moe, qwen3_moe
from moe_rl.policy.families.family import Family, Shard, rope_theta, sigmoid_router
from moe_rl.policy.families.family import hf_config as named_config


def read(cfg: dict[str, Any]) -> MoEArch:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not cfg.get("rope_interleave", True):
        raise UnsupportedModel("DeepSeek-V3 with rope_interleave=false is not supported (released checkpoints "
                               "interleave, as megatron's multi-latent attention does)")
    yarn: tuple[tuple[str, float], ...] = ()
    if rope_type == "yarn":
        if params.get("truncate", True) is False or params.get("attention_factor") is not None:
            raise UnsupportedModel("YaRN with truncate=false or an explicit attention_factor has no megatron-core "
                                   "counterpart")
        if float(params.get("mscale") or 1.0) != 1.0 and not params.get("mscale_all_dim"):
            raise UnsupportedModel("YaRN with mscale != 1 and no mscale_all_dim is scaled otherwise by megatron-core")
        yarn = (("rotary_scaling_factor", float(params["factor"])),
                ("original_max_position_embeddings", int(params["original_max_position_embeddings"])),
                ("beta_fast", float(params.get("beta_fast") or 32)), ("beta_slow", float(params.get("beta_slow") or 1)),
                ("mscale", float(params.get("mscale") or 1.0)), ("mscale_all_dim", float(params.get("mscale_all_dim") or 0)))
    elif rope_type not in (None, "default"):
        raise UnsupportedModel(f"DeepSeek-V3 with rope_type={rope_type!r} is not supported (default or yarn)")
    experts, heads = int(cfg["n_routed_experts"]), int(cfg["num_attention_heads"])
    dense = min(int(cfg.get("first_k_dense_replace", 0)), int(cfg["num_hidden_layers"]))
    mla = MLADims(q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
                  kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                  qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]), yarn=yarn)
    arch = qwen3_moe.read({**cfg, "num_experts": experts, "decoder_sparse_step": 1, "num_key_value_heads": heads,
                           "head_dim": mla.v_head_dim, "mlp_only_layers": list(range(dense)),
                           "rope_parameters": {"rope_theta": rope_theta(cfg)}, "rope_scaling": None})
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    return replace(arch, family="deepseek_v3", qk_layernorm=False, mla=mla, hf_architecture="DeepseekV3ForCausalLM",
                   shared_expert_size=int(cfg.get("n_shared_experts") or 0) * arch.moe_ffn_hidden_size or None,
                   extra={"mtp_layers": mtp} if mtp else {}, **sigmoid_router(cfg, experts, arch.moe_router_topk))


def weight_map(name: str, layer: int | None, expert: int | None, arch: MoEArch) -> Shard | None:
    """GLM-4.5's MoE names (shared experts, the router's selection bias) with multi-latent attention.
    Each HF tensor is one megatron tensor: `kv_a_proj_with_mqa`'s rows are [latent; RoPE] in both,
    `kv_b_proj`'s per head [k; v], `q_b_proj`'s per head [no-RoPE; RoPE]. The down projections are
    column-parallel in the local spec (split by rows, gathered inside MLA) and replicated in
    transformer-engine's, whose up projections also hold the latents' norms."""
    from moe_rl.policy.perf import use_transformer_engine

    if layer is None or expert is not None:
        return glm4_moe.weight_map(name, layer, expert, arch)
    a = f"model.layers.{layer}.self_attn."
    down = None if use_transformer_engine() else 0
    attention = {
        "self_attention.linear_q_down_proj.weight": Shard((f"{a}q_a_proj.weight",), dim=down),
        "self_attention.q_layernorm.weight": Shard((f"{a}q_a_layernorm.weight",)),
        "self_attention.linear_q_up_proj.layer_norm_weight": Shard((f"{a}q_a_layernorm.weight",)),
        "self_attention.linear_q_up_proj.weight": Shard((f"{a}q_b_proj.weight",), dim=0),
        "self_attention.linear_q_proj.weight": Shard((f"{a}q_proj.weight",), dim=0),  # q_lora_rank None
        "self_attention.linear_kv_down_proj.weight": Shard((f"{a}kv_a_proj_with_mqa.weight",), dim=down),
        "self_attention.kv_layernorm.weight": Shard((f"{a}kv_a_layernorm.weight",)),
        "self_attention.linear_kv_up_proj.layer_norm_weight": Shard((f"{a}kv_a_layernorm.weight",)),
        "self_attention.linear_kv_up_proj.weight": Shard((f"{a}kv_b_proj.weight",), dim=0),
    }
    if name in attention:
        return attention[name]
    return glm4_moe.weight_map(name, layer, expert, arch)


def hf_config(**kw: Any) -> Any:
    """transformers' DeepseekV3Config, its architecture named, without multi-token-prediction layers."""
    return named_config("DeepseekV3", **({"num_nextn_predict_layers": 0} | kw))


def tiny(c: Any) -> Any:
    """MLA widths from head_dim; experts in 2 groups, 1 kept when top-2."""
    groups = 2 if c.num_experts % 2 == 0 and c.num_experts_per_tok == 2 else 1
    return hf_config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
        first_k_dense_replace=1, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads, q_lora_rank=c.hidden_size // 2, kv_lora_rank=c.head_dim,
        qk_nope_head_dim=c.head_dim // 2, qk_rope_head_dim=max(2, c.head_dim // 4 // 2 * 2),
        v_head_dim=c.head_dim // 2, n_routed_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        n_group=groups, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})


# Multi-latent attention (a query bottleneck of 24, a key/value latent of 16, per head 8 dims without
# RoPE and 4 with it, values of 8), a dense first layer, a shared expert, 8 experts top-4 in 4 groups
# of which 2 are kept (4 // 2 = 2: megatron ranks groups by their top-2 as HF does), a drawn selection
# bias and routed_scaling_factor 2.5. Every 2-rank layout divides it.
TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=32, moe_intermediate_size=16,
            num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", ("deepseek_v3",), read, weight_map, example=TINY,
                hf_config=hf_config, tiny=tiny)
