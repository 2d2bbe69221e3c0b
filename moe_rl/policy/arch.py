"""`MoEArch`, a plain description of the network (names follow megatron) that a family's reader
(`families/<name>.py`) fills from a HF `config.json` and `model.py` turns into a megatron model for a
layout; what megatron-core cannot match is refused by the readers, naming the field, before any work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class UnsupportedModel(ValueError):
    """The checkpoint's architecture has no reader here."""


@dataclass(frozen=True)
class MLADims:
    """Multi-latent attention (DeepSeek-V3): queries through a `q_lora_rank` bottleneck (None: a
    plain projection), keys and values from a `kv_lora_rank` latent, each head's q/k split into a
    position-free part and a RoPE part shared by all heads; `yarn`: megatron's YaRN fields."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    yarn: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class LinearAttentionDims:
    """Gated delta net (Qwen3-Next's linear attention): which layers use it (0-based; the others are
    gated full attention), its key and value heads (each key head serves value_heads // key_heads
    value heads) and their widths, and the causal convolution's kernel."""

    layers: tuple[int, ...]
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class MoEArch:
    """The network as both HF and megatron see it (names follow megatron)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int  # dense MLP layers (mlp_only_layers)
    num_moe_experts: int | None
    moe_ffn_hidden_size: int | None
    moe_router_topk: int
    norm_topk_prob: bool
    moe_aux_loss_coeff: float
    moe_layers: tuple[int, ...]  # 0-based indices of MoE layers; the others are dense
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_layernorm: bool = True
    qkv_bias: bool = False                  # biases on q/k/v (Qwen2-MoE), none on the output projection
    shared_expert_size: int | None = None   # hidden width of an always-on shared expert (None: none)
    shared_expert_gate: bool = False        # its output scaled by sigmoid(x . w) per token (Qwen2-MoE)
    # Sigmoid routers (GLM-4.5, DeepSeek-V3): experts are selected on sigmoid(logits) + a per-expert
    # correction bias (`e_score_correction_bias`, megatron's `expert_bias`), and weighted by the
    # selected sigmoid scores without the bias, renormalised and scaled by `routed_scaling_factor`.
    router_score: str = "softmax"           # "softmax" | "sigmoid"
    expert_bias: bool = False               # the checkpoint's routers carry a selection bias
    expert_bias_update_rate: float = 0.0    # megatron's aux-loss-free balancing step (0: frozen)
    routed_scaling_factor: float | None = None
    router_groups: tuple[int, int] | None = None  # group-limited top-k: (groups, groups kept per token)
    rotary_percent: float = 1.0             # the fraction of each head's dims RoPE rotates (GLM: 0.5)
    mla: MLADims | None = None              # multi-latent attention (DeepSeek-V3) instead of GQA
    linear_attention: LinearAttentionDims | None = None  # gated delta net layers (Qwen3-Next)
    attention_output_gate: bool = False     # attention output scaled by sigmoid(gate), q_proj [q_h | gate_h] per head
    zero_centered_norms: bool = False       # RMSNorms scale by (1 + w) (Qwen3-Next; the gated delta net's own: w)
    hf_architecture: str = ""
    padding_idx: int | None = None  # HF's `pad_token_id`: its embedding row is never trained (see below)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)
