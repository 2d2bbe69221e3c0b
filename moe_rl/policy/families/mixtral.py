"""Mixtral (`MixtralForCausalLM`): Qwen3-MoE's block without QK-norm, every layer MoE, the router's
top-k probabilities renormalised, and its own checkpoint names for the MoE block."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from moe_rl.policy.arch import MoEArch, UnsupportedModel
from moe_rl.policy.families import qwen3_moe
from moe_rl.policy.families.family import Family, Shard
from moe_rl.policy.families.family import hf_config as named_config


def read(cfg: dict[str, Any]) -> MoEArch:
    """HF's MixtralSparseMoeBlock divides the top-k probabilities by their sum: norm_topk_prob."""
    if cfg.get("sliding_window") is not None:
        raise UnsupportedModel(f"Mixtral with sliding_window={cfg['sliding_window']} is not supported yet "
                               "(megatron's local spec has no sliding-window attention on CPU)")
    if float(cfg.get("router_jitter_noise", 0.0) or 0.0) > 0:
        raise UnsupportedModel("Mixtral with router_jitter_noise > 0 samples its routes in training: "
                               "set it to 0 for RL (replay and drift need deterministic routes)")
    experts = int(cfg["num_local_experts"])
    arch = qwen3_moe.read({**cfg, "num_experts": experts, "moe_intermediate_size": cfg["intermediate_size"],
                           "mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True})
    return replace(arch, family="mixtral", qk_layernorm=False, hf_architecture="MixtralForCausalLM")


# Mixtral's checkpoints name the MoE block `block_sparse_moe` and its experts' gate, down and up
# projections w1, w2, w3 (what SGLang's mixtral.py `load_weights` reads too); the rest is Qwen3-MoE's.
_NAMES = (("mlp.gate.weight", "block_sparse_moe.gate.weight"), (".gate_proj.", ".w1."),
          (".down_proj.", ".w2."), (".up_proj.", ".w3."), ("mlp.experts.", "block_sparse_moe.experts."))


def weight_map(name: str, layer: int | None, expert: int | None, arch: MoEArch) -> Shard | None:
    shard = qwen3_moe.weight_map(name, layer, expert, arch)
    if shard is None or not (expert is not None or name == "mlp.router.weight"):
        return shard
    names = []
    for hf in shard.hf:
        for old, new in _NAMES:
            hf = hf.replace(old, new)
        names.append(hf)
    return replace(shard, hf=tuple(names))


# The checkpoint's names (pushes send them, as SGLang's mixtral loader reads them) as transformers' modules.
_MODULE_PARTS = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w2.": ".down_proj.", ".w3.": ".up_proj."}
_MODULE_RE = re.compile(r"\.block_sparse_moe\.|\.w[123]\.")


def engine_name(name: str) -> str:
    return _MODULE_RE.sub(lambda m: _MODULE_PARTS[m.group(0)], name)


def hf_config(**kw: Any) -> Any:
    """transformers' MixtralConfig (no sliding window, no router jitter: what moe_rl reads)."""
    return named_config("Mixtral", **({"sliding_window": None, "router_jitter_noise": 0.0} | kw))


def tiny(c: Any) -> Any:
    """No dense layers, no QK-norm, top-k always renormalised: those fields of `c` do not apply, and its
    experts' `intermediate_size` is `moe_intermediate_size`."""
    return hf_config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.moe_intermediate_size,
                     num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                     num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                     max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                     rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
                     router_aux_loss_coef=c.router_aux_loss_coef, bos_token_id=c.bos_token_id,
                     eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)


# Shapes unlike `TinyMoEConfig`'s (6 heads of 8 over 2 query groups, 6 experts top-2, 2 layers, no
# QK-norm), so a conversion that only fits Qwen3's shapes fails; every 2-rank layout divides them.
TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2,
            max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILY = Family("mixtral", "MixtralForCausalLM", ("mixtral",), read, weight_map, example=TINY, hf_config=hf_config,
                tiny=tiny, engine_name=engine_name)
