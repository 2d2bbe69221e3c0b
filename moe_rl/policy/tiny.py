"""Tiny Qwen3-MoE checkpoints built with transformers (nothing is downloaded).

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
