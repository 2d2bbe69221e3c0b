"""Tiny Qwen3-MoE (and Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3, Qwen3-Next, Qwen3.5-MoE) checkpoints built with transformers (nothing is downloaded).

The sizes are chosen so every parallel layout the tests use divides them:
4 attention heads and 2 query groups (TP2), 4 layers (PP2 x VPP2), 4 experts (EP2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class TinyMoEConfig:
    """Shape of a tiny Qwen3-MoE model; kwargs map 1:1 onto `transformers.Qwen3MoeConfig`."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.0
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def to_hf(self) -> Any:
        from transformers import Qwen3MoeConfig

        kw = dict(self.__dict__)
        theta = kw.pop("rope_theta")
        cfg = Qwen3MoeConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta})
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        return cfg


def make_tiny_qwen3_moe(out_dir: str | Path, seed: int = 0, config: TinyMoEConfig | None = None,
                        init_std: float = 0.2) -> Path:
    """Create a randomly initialised tiny Qwen3-MoE and `save_pretrained` it to `out_dir` (fp32).

    `init_std` is larger than HF's default (0.02) so that router logits are far apart
    and top-k choices are not decided by float rounding noise.
    """
    from transformers import Qwen3MoeForCausalLM

    cfg = (config or TinyMoEConfig()).to_hf()
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


# A tiny Mixtral's shapes unlike `TinyMoEConfig`'s (6 heads of 8 over 2 query groups, 6 experts top-2,
# 2 layers, no QK-norm), so a conversion that only fits Qwen3's shapes fails; every 2-rank layout
# divides them.
TINY_MIXTRAL = dict(vocab_size=96, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
                    max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


# A tiny Qwen2-MoE, again unlike `TinyMoEConfig` (head_dim 10, a dense first layer, a gated shared
# expert, q/k/v biases, top-k not renormalised).
TINY_QWEN2_MOE = dict(vocab_size=96, hidden_size=40, intermediate_size=56, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                      mlp_only_layers=[0], decoder_sparse_step=1, max_position_embeddings=256, rope_theta=1e6,
                      rms_norm_eps=1e-6, use_sliding_window=False, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)


def make_tiny_qwen2_moe(out_dir: str | Path, seed: int = 0, init_std: float = 0.2, **overrides: Any) -> Path:
    """A randomly initialised tiny Qwen2-MoE (`TINY_QWEN2_MOE`, with `overrides`), saved to `out_dir` (fp32)."""
    return _save(qwen2_moe_config(**(TINY_QWEN2_MOE | overrides)), out_dir, seed, init_std)


def qwen2_moe_config(**kw: Any) -> Any:
    """transformers' Qwen2MoeConfig, its architecture named."""
    return _hf_config("Qwen2Moe", **kw)


# A tiny GLM-4.5, unlike the others: head_dim 12 of which RoPE rotates half, q/k/v biases and QK-norm,
# a dense first layer, a shared expert, 6 experts behind a sigmoid router whose selection bias is not
# zero (`make_tiny_glm4_moe` draws it), and routed_scaling_factor 2.5.
TINY_GLM4_MOE = dict(vocab_size=96, hidden_size=40, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_routed_experts=6, n_shared_experts=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1,
                     topk_group=1, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
                     max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})


def glm4_moe_config(**kw: Any) -> Any:
    """transformers' Glm4MoeConfig, its architecture named, without multi-token-prediction layers."""
    return _hf_config("Glm4Moe", **({"num_nextn_predict_layers": 0} | kw))


def make_tiny_glm4_moe(out_dir: str | Path, seed: int = 0, init_std: float = 0.2, **overrides: Any) -> Path:
    """A randomly initialised tiny GLM-4.5 (`TINY_GLM4_MOE`, with `overrides`), saved to `out_dir` (fp32)."""
    return _save(glm4_moe_config(**(TINY_GLM4_MOE | overrides)), out_dir, seed, init_std)


# A tiny DeepSeek-V3: multi-latent attention (a query bottleneck of 24, a key/value latent of 16, per
# head 8 dims without RoPE and 4 with it, values of 8), a dense first layer, a shared expert, 8 experts
# top-4 in 4 groups of which 2 are kept (4 // 2 = 2: megatron ranks groups by their top-2 as HF does),
# a drawn selection bias and routed_scaling_factor 2.5. Every 2-rank layout divides it.
TINY_DEEPSEEK_V3 = dict(vocab_size=96, hidden_size=48, intermediate_size=32, moe_intermediate_size=16,
                        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def deepseek_v3_config(**kw: Any) -> Any:
    """transformers' DeepseekV3Config, its architecture named, without multi-token-prediction layers."""
    return _hf_config("DeepseekV3", **({"num_nextn_predict_layers": 0} | kw))


def make_tiny_deepseek_v3(out_dir: str | Path, seed: int = 0, init_std: float = 0.2, **overrides: Any) -> Path:
    """A randomly initialised tiny DeepSeek-V3 (`TINY_DEEPSEEK_V3`, with `overrides`), saved to `out_dir` (fp32)."""
    return _save(deepseek_v3_config(**(TINY_DEEPSEEK_V3 | overrides)), out_dir, seed, init_std)


# A tiny Qwen3-Next, unlike the others: layers 0 and 2 gated delta net (linear attention: 2 key heads of
# 6, 4 value heads of 10, a conv of 4), 1 and 3 gated full attention (4 heads of 24 over 2 query groups,
# RoPE on a quarter of each head, the output scaled by sigmoid(gate)); every layer MoE with 4 experts
# top-2 and a gated shared expert; (1 + w) RMSNorms. Every 2-rank layout divides it.
TINY_QWEN3_NEXT = dict(vocab_size=96, hidden_size=40, intermediate_size=48, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=6, linear_value_head_dim=10, linear_conv_kernel_dim=4, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                       layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                       max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def qwen3_next_config(**kw: Any) -> Any:
    """transformers' Qwen3NextConfig, its architecture named."""
    return _hf_config("Qwen3Next", **kw)


def make_tiny_qwen3_next(out_dir: str | Path, seed: int = 0, init_std: float = 0.2, **overrides: Any) -> Path:
    """A randomly initialised tiny Qwen3-Next (`TINY_QWEN3_NEXT`, with `overrides`), saved to `out_dir` (fp32).
    Its norm weights, `A_log` and `dt_bias` are drawn too (HF starts the (1 + w) norms at w = 0), so a
    map that mixes them up fails."""
    return _save(qwen3_next_config(**(TINY_QWEN3_NEXT | overrides)), out_dir, seed, init_std, perturb=_QWEN3_NEXT_DRAWN)


_QWEN3_NEXT_DRAWN = ("norm.weight", "layernorm.weight", ".dt_bias", ".A_log")


# A tiny Qwen3.5-MoE, unlike Qwen3-Next's: layers 0, 1, 2 gated delta net (2 key heads of 8, 6 value heads
# of 6: three value heads per key head), layer 3 gated full attention (6 heads of 16 over 2 query groups,
# RoPE on half of each head through multimodal RoPE's sections [2, 1, 1], interleaved); 6 experts top-3
# (the router always renormalises) and a gated shared expert in every layer; a vocabulary of 112. Every
# 2-rank layout divides it.
TINY_QWEN3_5_MOE = dict(vocab_size=112, hidden_size=44, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
                        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=3,
                        layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=256,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def qwen3_5_moe_config(**kw: Any) -> Any:
    """transformers' Qwen3_5MoeTextConfig, its architecture `Qwen3_5MoeForCausalLM` named."""
    import transformers

    cfg = transformers.Qwen3_5MoeTextConfig(**kw)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    return cfg


def make_tiny_qwen3_5_moe(out_dir: str | Path, seed: int = 0, init_std: float = 0.1, **overrides: Any) -> Path:
    """A randomly initialised tiny Qwen3.5-MoE text model (`TINY_QWEN3_5_MOE`, with `overrides`), saved to
    `out_dir` (fp32), its norm weights, `A_log` and `dt_bias` drawn as Qwen3-Next's are. `init_std` is 0.1,
    not 0.2: at 0.2 HF's own fp32 forward differs from its fp64 forward by up to 6e-4 in log p on
    72-token sequences (the delta net's output norm rescales near-zero heads), so no fp32 comparison
    could hold 1e-4; at 0.1 by at most 1.5e-5."""
    return _save(qwen3_5_moe_config(**(TINY_QWEN3_5_MOE | overrides)), out_dir, seed, init_std,
                 perturb=_QWEN3_NEXT_DRAWN)


def mixtral_config(**kw: Any) -> Any:
    """transformers' MixtralConfig (no sliding window, no router jitter: what moe_rl reads)."""
    return _hf_config("Mixtral", **({"sliding_window": None, "router_jitter_noise": 0.0} | kw))


def _hf_config(name: str, **kw: Any) -> Any:
    """transformers' `<name>Config(**kw)` with its architecture `<name>ForCausalLM` named."""
    import transformers

    cfg = getattr(transformers, f"{name}Config")(**kw)
    cfg.architectures = [f"{name}ForCausalLM"]
    return cfg


def tiny_hf_config(family: str, config: TinyMoEConfig) -> Any:
    """The HF config of a fresh tiny model of `family` ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe",
    "deepseek_v3" or "qwen3_next") with `config`'s shape (Mixtral has no dense layers, no QK-norm and
    always renormalises its top-k: those fields do not apply, and its experts' `intermediate_size` is
    `moe_intermediate_size`; Qwen2-MoE's head width is hidden / heads; GLM-4.5 keeps its own
    layout: the first layer dense, one shared expert, RoPE on half of each head, q/k/v biases;
    Qwen3-Next's delta net takes its head counts and widths from the attention's)."""
    c = config
    if family == "qwen3_moe":
        return config.to_hf()
    if family == "deepseek_v3":  # MLA widths from head_dim; experts in 2 groups, 1 kept when top-2
        groups = 2 if c.num_experts % 2 == 0 and c.num_experts_per_tok == 2 else 1
        return deepseek_v3_config(
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
    if family == "glm4_moe":
        return glm4_moe_config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
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
    if family == "qwen2_moe":  # its shared expert as wide as a routed one
        kw = {k: v for k, v in c.__dict__.items() if k not in ("head_dim", "rope_theta")}
        return qwen2_moe_config(**kw, shared_expert_intermediate_size=c.moe_intermediate_size, use_sliding_window=False,
                                rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    if family == "qwen3_next":  # delta net at even layers: KV heads as key heads, query heads as value heads
        return qwen3_next_config(
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
    if family != "mixtral":
        raise ValueError(f"model.tiny.family must be 'qwen3_moe', 'qwen2_moe', 'mixtral', 'glm4_moe', "
                         f"'deepseek_v3' or 'qwen3_next', got {family!r}")
    return mixtral_config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.moe_intermediate_size,
                          num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                          num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                          num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                          max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                          rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
                          router_aux_loss_coef=c.router_aux_loss_coef, bos_token_id=c.bos_token_id,
                          eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)


def make_tiny_mixtral(out_dir: str | Path, seed: int = 0, init_std: float = 0.2, **overrides: Any) -> Path:
    """A randomly initialised tiny Mixtral (`TINY_MIXTRAL`, with `overrides`), `save_pretrained` to
    `out_dir` (fp32)."""
    return _save(mixtral_config(**(TINY_MIXTRAL | overrides)), out_dir, seed, init_std)


def make_tiny(family: str, out_dir: str | Path, seed: int, config: TinyMoEConfig, init_std: float) -> Path:
    """A fresh tiny model of `family` with `config`'s shape (`tiny_hf_config`), saved to `out_dir`."""
    if family == "qwen3_moe":
        return make_tiny_qwen3_moe(out_dir, seed=seed, config=config, init_std=init_std)
    return _save(tiny_hf_config(family, config), out_dir, seed, init_std)


def _save(cfg: Any, out_dir: str | Path, seed: int, init_std: float, perturb: tuple[str, ...] = ()) -> Path:
    from transformers import AutoModelForCausalLM

    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():  # a sigmoid router's selection bias, which HF starts at 0: drawn, so it matters
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * init_std)
        for name, param in model.named_parameters():  # parameters HF starts at a constant, drawn
            if name.endswith(perturb):
                param.add_(torch.randn(param.shape) * 0.1)
    model.save_pretrained(out)
    return out
