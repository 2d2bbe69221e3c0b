"""Tiny checkpoints built with transformers (nothing is downloaded): `TinyMoEConfig`, the shape of
the demo's Qwen3-MoE (and of `model.tiny`, which each family in `families/` reads in its own way),
and `save_tiny`, which draws and saves a model of any family's HF config.

The sizes are chosen so every parallel layout the tests use divides them:
4 attention heads and 2 query groups (TP2), 4 layers (PP2 x VPP2), 4 experts (EP2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_rl.policy.families import qwen3_moe


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
        kw = dict(self.__dict__)
        theta = kw.pop("rope_theta")
        return qwen3_moe.hf_config(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta})


def make_tiny_qwen3_moe(out_dir: str | Path, seed: int = 0, config: TinyMoEConfig | None = None,
                        init_std: float = 0.2) -> Path:
    """Create a randomly initialised tiny Qwen3-MoE and `save_pretrained` it to `out_dir` (fp32).

    `init_std` is larger than HF's default (0.02) so that router logits are far apart
    and top-k choices are not decided by float rounding noise.
    """
    return save_tiny((config or TinyMoEConfig()).to_hf(), out_dir, seed, init_std)


def save_tiny(cfg: Any, out_dir: str | Path, seed: int, init_std: float, perturb: tuple[str, ...] = ()) -> Path:
    """A randomly initialised model of HF config `cfg` (`initializer_range` = `init_std`, its sigmoid routers'
    selection bias and the parameters named by `perturb` drawn), saved to `out_dir` (fp32)."""
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
