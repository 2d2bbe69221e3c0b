"""The HF config of the model a run trains, and the part of it that fixes parameter shapes:
what a checkpoint's `meta.json` records (`model`) and what resuming it must agree with."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from moe_rl.config import RunConfig


def run_hf_config(cfg: RunConfig) -> dict[str, Any]:
    """`model.hf_path`'s config.json, or the config of the fresh tiny model `model.tiny` builds."""
    import json

    if cfg.model.hf_path:
        return json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    from moe_rl.policy.families.registry import tiny_hf_config
    from moe_rl.policy.tiny import TinyMoEConfig

    shape = {k: v for k, v in dataclasses.asdict(cfg.model.tiny).items() if k not in ("init_std", "family")}
    return tiny_hf_config(cfg.model.tiny.family, TinyMoEConfig(**shape)).to_dict()


# The HF config keys that fix the shapes of a model's parameters (every family read in
# moe_rl/policy/families/): a checkpoint resumes only into a model that agrees on them all.
SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
              "num_local_experts", "shared_expert_intermediate_size", "mlp_only_layers", "decoder_sparse_step",
              "tie_word_embeddings")


def model_shape(cfg: RunConfig) -> dict[str, Any]:
    """This run's model, as the shape keys of its HF config (what a checkpoint's meta.json records)."""
    hf = run_hf_config(cfg)
    return {k: hf[k] for k in SHAPE_KEYS if k in hf}
