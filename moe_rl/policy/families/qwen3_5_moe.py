"""Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`): Qwen3-Next's layers, the delta net's input
projections stored apart, every layer MoE with a router that always renormalises its top-k softmax
probabilities (the config has no `decoder_sparse_step`, `mlp_only_layers` or `norm_topk_prob`), and
multimodal RoPE (`mrope_section`, `mrope_interleaved`), which at text positions (its three position
components equal) is plain RoPE on the rotary dims."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from moe_rl.policy.arch import MoEArch
from moe_rl.policy.families import qwen3_next
from moe_rl.policy.families.family import Family, Shard


def read(cfg: dict[str, Any]) -> MoEArch:
    return replace(qwen3_next.read({**cfg, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                                    "intermediate_size": 0}, "Qwen3.5-MoE"),
                   family="qwen3_5_moe", hf_architecture="Qwen3_5MoeForCausalLM")


def weight_map(name: str, layer: int | None, expert: int | None, arch: MoEArch) -> Shard | None:
    """Qwen3-Next's map but for the delta net's input projections (it saves `model.layers.*`), stored
    apart: in_proj_qkv ([q | k | v], each key- or value-head major, the conv's channel order too),
    in_proj_z (per value head), in_proj_b and in_proj_a (one row per value head); their concatenation is
    megatron's in_proj as it is."""
    if name == "self_attention.in_proj.weight" and expert is None:
        la = f"model.layers.{layer}.linear_attn."
        return Shard(tuple(f"{la}in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")), kind="gdn_in", dim=0)
    return qwen3_next.weight_map(name, layer, expert, arch)


def hf_config(**kw: Any) -> Any:
    """transformers' Qwen3_5MoeTextConfig, its architecture `Qwen3_5MoeForCausalLM` named."""
    import transformers

    cfg = transformers.Qwen3_5MoeTextConfig(**kw)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    return cfg


# Unlike Qwen3-Next's: layers 0, 1, 2 gated delta net (2 key heads of 8, 6 value heads of 6: three
# value heads per key head), layer 3 gated full attention (6 heads of 16 over 2 query groups, RoPE on
# half of each head through multimodal RoPE's sections [2, 1, 1], interleaved); 6 experts top-3 (the
# router always renormalises) and a gated shared expert in every layer; a vocabulary of 112. Every
# 2-rank layout divides it.
TINY = dict(vocab_size=112, hidden_size=44, moe_intermediate_size=12, shared_expert_intermediate_size=20,
            num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=3,
            layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})

# init_std 0.1, not 0.2: at 0.2 HF's own fp32 forward differs from its fp64 forward by up to 6e-4 in
# log p on 72-token sequences (the delta net's output norm rescales near-zero heads), so no fp32
# comparison could hold 1e-4; at 0.1 by at most 1.5e-5. No fresh model (`tiny`): its text config is
# used through `model.hf_path`.
FAMILY = Family("qwen3_5_moe", "Qwen3_5MoeForCausalLM", ("qwen3_5_moe_text",), read, weight_map, example=TINY,
                hf_config=hf_config, init_std=0.1, perturb=qwen3_next.DRAWN, linear_attention=True)
