"""The families moe_rl reads, and what is looked up by them: a HF config.json into `MoEArch`, a
family's weight map, the fresh tiny model of a `model.tiny` shape, an engine's module names."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from moe_rl.policy.arch import MoEArch, UnsupportedModel
from moe_rl.policy.families import deepseek_v3, glm4_moe, mixtral, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next
from moe_rl.policy.families.family import Family, WeightMap

# Add a family here (its file beside this one). The order is the one `--help` and the docs list.
FAMILIES: tuple[Family, ...] = tuple(m.FAMILY for m in (qwen3_moe, qwen2_moe, mixtral, glm4_moe, deepseek_v3,
                                                          qwen3_next, qwen3_5_moe))
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}
_BY_ARCHITECTURE: dict[str, Family] = {f.architecture: f for f in FAMILIES}
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], MoEArch]] = {a: f.read for a, f in _BY_ARCHITECTURE.items()}
WEIGHT_MAPS: dict[str, WeightMap] = {f.name: f.weight_map for f in FAMILIES}
TINY_FAMILIES: tuple[str, ...] = tuple(f.name for f in FAMILIES if f.tiny is not None)  # model.tiny.family

# Architectures recognised and refused, with the way out. A released Qwen3.5-MoE checkpoint is
# vision-language (its config nests `text_config`, its text weights are `model.language_model.*` beside
# a vision tower `model.visual.*`): the policy here is text-only, and an export that dropped the tower
# would be a broken checkpoint of that class.
REFUSED: dict[str, str] = {
    "Qwen3_5MoeForConditionalGeneration": (
        "a vision-language checkpoint (text_config, model.visual.*); the RL policy is text-only. Save its "
        "text model with transformers and set model.hf_path to it: cfg = AutoConfig.from_pretrained(path)"
        ".text_config; Qwen3_5MoeForCausalLM.from_pretrained(path, config=cfg).save_pretrained(out)"),
}
# HF model_type -> architecture, for a config that names no `architectures`.
MODEL_TYPES: dict[str, str] = {t: f.architecture for f in FAMILIES for t in f.model_types} | {
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def family_of(cfg: dict[str, Any]) -> Family | None:
    """The family a HF config.json (a dict) names (`architectures`, else `model_type`), None for none read here."""
    return _BY_ARCHITECTURE.get(_architecture(cfg))


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    return archs[0] if archs else MODEL_TYPES.get(cfg.get("model_type", ""), "")


def read_hf_config(model_dir: str | Path) -> MoEArch:
    """Read `config.json` of a HF checkpoint directory into `MoEArch`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; expected a HF checkpoint directory")
    cfg = json.loads(path.read_text())
    return arch_from_hf_dict(cfg, source=str(path))


def arch_from_hf_dict(cfg: dict[str, Any], source: str = "config") -> MoEArch:
    name = _architecture(cfg)
    if name in REFUSED:
        raise UnsupportedModel(f"{source}: architecture {name!r} is not supported: {REFUSED[name]}")
    if name not in ARCHITECTURES:
        raise UnsupportedModel(f"{source}: architecture {name or cfg.get('model_type')!r} is not supported; "
                               f"supported: {', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[name](cfg)
    if arch.padding_idx is None:
        arch = replace(arch, padding_idx=_padding_idx(cfg, arch.vocab_size))
    return arch


def _padding_idx(cfg: dict[str, Any], vocab_size: int) -> int | None:
    """The embedding row HF leaves untrained: its decoders build `nn.Embedding(vocab, hidden,
    padding_idx=config.pad_token_id)`, whose backward gives that row no gradient (HF's
    `_init_weights` also zeroes it). None when the config names no pad token in the vocabulary."""
    pad = cfg.get("pad_token_id")
    return int(pad) if isinstance(pad, int) and 0 <= pad < vocab_size else None


def tiny_hf_config(family: str, config: Any) -> Any:
    """The HF config of a fresh tiny model of `family` (`TINY_FAMILIES`) with `config`'s shape (a
    `TinyMoEConfig`; each family says which of its fields apply)."""
    found = BY_NAME.get(family)
    if found is None or found.tiny is None:
        raise ValueError(f"model.tiny.family must be one of {', '.join(map(repr, TINY_FAMILIES))}, got {family!r}")
    return found.tiny(config)


def make_tiny(family: str, out_dir: str | Path, seed: int, config: Any, init_std: float) -> Path:
    """A fresh tiny model of `family` with `config`'s shape (`tiny_hf_config`), saved to `out_dir`."""
    from moe_rl.policy.tiny import save_tiny

    return save_tiny(tiny_hf_config(family, config), out_dir, seed, init_std)  # nothing perturbed, as ever


def make_example(family: str, out_dir: str | Path, seed: int = 0, init_std: float | None = None,
                 **overrides: Any) -> Path:
    """A randomly initialised tiny model of `family` of its own shape (its `example` keys, with
    `overrides`), saved to `out_dir` (fp32): the tests' model of each family."""
    from moe_rl.policy.tiny import save_tiny

    f = BY_NAME[family]
    if not f.example:  # Qwen3-MoE's test model is the demo's shape: moe_rl.policy.tiny.make_tiny_qwen3_moe
        raise ValueError(f"{family} has no example shape of its own: build it from TinyMoEConfig with make_tiny")
    return save_tiny(f.hf_config(**(f.example | overrides)), out_dir, seed,
                     f.init_std if init_std is None else init_std, f.perturb)


def engine_name(name: str) -> str:
    """A pushed checkpoint tensor's name as transformers' modules name it (Mixtral's differ)."""
    for f in FAMILIES:
        if f.engine_name is not None:
            name = f.engine_name(name)
    return name
