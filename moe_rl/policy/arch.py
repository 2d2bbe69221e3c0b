"""A HF MoE checkpoint's `config.json` read into `MoEArch`, a plain description of the network
(names follow megatron), which `model.py` turns into a megatron model for a layout.

Families are registered in `ARCHITECTURES`: each entry reads one HF config format. Qwen3-MoE,
Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3 (also Kimi-K2 and Moonlight, which share its class) and
Qwen3-Next and Qwen3.5-MoE are read; each family's weight map is in `convert.py`. What megatron-core cannot match
is refused here, naming the field, before any work.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable


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


def _rope_theta(cfg: dict[str, Any]) -> float:
    # Published checkpoints: top-level `rope_theta`; current transformers writes
    # `rope_parameters: {"rope_theta": ..., "rope_type": "default"}`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0


def _read_qwen3_moe(cfg: dict[str, Any]) -> MoEArch:
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
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hf_architecture="Qwen3MoeForCausalLM",
    )


def _read_mixtral(cfg: dict[str, Any]) -> MoEArch:
    """Mixtral: Qwen3-MoE's block without QK-norm, every layer MoE, and the router's top-k
    probabilities renormalised (HF's MixtralSparseMoeBlock divides by their sum: norm_topk_prob)."""
    if cfg.get("sliding_window") is not None:
        raise UnsupportedModel(f"Mixtral with sliding_window={cfg['sliding_window']} is not supported yet "
                               "(megatron's local spec has no sliding-window attention on CPU)")
    if float(cfg.get("router_jitter_noise", 0.0) or 0.0) > 0:
        raise UnsupportedModel("Mixtral with router_jitter_noise > 0 samples its routes in training: "
                               "set it to 0 for RL (replay and drift need deterministic routes)")
    experts = int(cfg["num_local_experts"])
    arch = _read_qwen3_moe({**cfg, "num_experts": experts, "moe_intermediate_size": cfg["intermediate_size"],
                            "mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True})
    return replace(arch, family="mixtral", qk_layernorm=False, hf_architecture="MixtralForCausalLM")


def _read_qwen2_moe(cfg: dict[str, Any]) -> MoEArch:
    """Qwen2-MoE: Qwen3-MoE's block with q/k/v biases instead of QK-norm, top-k probabilities not
    renormalised by default (norm_topk_prob false), and a shared expert behind a sigmoid gate."""
    if cfg.get("use_sliding_window"):
        raise UnsupportedModel("Qwen2-MoE with use_sliding_window=true is not supported yet "
                               "(megatron's local spec has no sliding-window attention on CPU)")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return replace(_read_qwen3_moe(cfg), family="qwen2_moe", qk_layernorm=False, qkv_bias=True,
                   shared_expert_size=shared or None, shared_expert_gate=bool(shared),
                   hf_architecture="Qwen2MoeForCausalLM")


def _partial_rotary(cfg: dict[str, Any], params: dict[str, Any]) -> Any:
    """The rotated share of each head: transformers' rotary embeddings read `rope_parameters` (its config
    classes fill it from a top-level `partial_rotary_factor` only when it has none), so that one first.
    A config.json may hold both and disagree: transformers 5.19's Qwen3.5-MoE config saves its default
    top-level 0.25 beside a `rope_parameters` value it then uses."""
    return params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")


def _read_glm4_moe(cfg: dict[str, Any]) -> MoEArch:
    """GLM-4.5 / 4.6: GQA with partial rotary (the first `partial_rotary_factor` of each head, halves
    rotated as Llama's), q/k/v biases (`attention_bias`), optional QK-norm, `first_k_dense_replace`
    dense layers, `n_shared_experts` always-on experts (no gate) and a sigmoid router with a selection
    bias, renormalised top-k and `routed_scaling_factor`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(_partial_rotary(cfg, params) or 0.5)
    experts = int(cfg["n_routed_experts"])
    dense = int(cfg.get("first_k_dense_replace", 1))
    arch = _read_qwen3_moe({**cfg, "num_experts": experts, "decoder_sparse_step": 1,
                            "mlp_only_layers": list(range(min(dense, int(cfg["num_hidden_layers"]))))})
    heads = arch.num_attention_heads
    return replace(arch, family="glm4_moe", qk_layernorm=bool(cfg.get("use_qk_norm", False)),
                   qkv_bias=bool(cfg.get("attention_bias", False)),
                   kv_channels=int(cfg.get("head_dim") or arch.hidden_size // heads), rotary_percent=partial,
                   shared_expert_size=int(cfg.get("n_shared_experts") or 0) * arch.moe_ffn_hidden_size or None,
                   hf_architecture="Glm4MoeForCausalLM", **_sigmoid_router(cfg, experts, arch.moe_router_topk))


def _read_deepseek_v3(cfg: dict[str, Any]) -> MoEArch:
    """DeepSeek-V3 (and Kimi-K2, Moonlight: the same class): multi-latent attention with interleaved
    RoPE (plain or YaRN), `first_k_dense_replace` dense layers, shared experts and a sigmoid router
    with a selection bias, group-limited top-k and `routed_scaling_factor`. Multi-token-prediction
    layers (`num_nextn_predict_layers`) are not read: RL trains the decoder layers."""
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
    arch = _read_qwen3_moe({**cfg, "num_experts": experts, "decoder_sparse_step": 1, "num_key_value_heads": heads,
                            "head_dim": mla.v_head_dim, "mlp_only_layers": list(range(dense)),
                            "rope_parameters": {"rope_theta": _rope_theta(cfg)}, "rope_scaling": None})
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    return replace(arch, family="deepseek_v3", qk_layernorm=False, mla=mla, hf_architecture="DeepseekV3ForCausalLM",
                   shared_expert_size=int(cfg.get("n_shared_experts") or 0) * arch.moe_ffn_hidden_size or None,
                   extra={"mtp_layers": mtp} if mtp else {}, **_sigmoid_router(cfg, experts, arch.moe_router_topk))


def _read_qwen3_next(cfg: dict[str, Any], name: str = "Qwen3-Next") -> MoEArch:
    """Qwen3-Next: gated delta net (linear attention) layers and gated full-attention layers
    (`layer_types`, or every `full_attention_interval`-th layer full), the full ones with QK-norm,
    partial rotary and an output gate; Qwen3-MoE's experts (`decoder_sparse_step`, `mlp_only_layers`)
    with a shared expert behind a sigmoid gate; RMSNorms that scale by (1 + w)."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise UnsupportedModel(f"{name} layer_types={types!r}: expected {layers} entries, each "
                               "'linear_attention' or 'full_attention'")
    if cfg.get("attention_bias"):
        raise UnsupportedModel(f"{name} with attention_bias=true is not supported (megatron-core's gated "
                               "attention is read without biases here)")
    if (cfg.get("hidden_act") or "silu") != "silu":
        raise UnsupportedModel(f"{name} with hidden_act={cfg['hidden_act']!r} is not supported: megatron-core's "
                               "gated delta net and experts are built with silu")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(_partial_rotary(cfg, params) or 0.25)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    if int(head_dim * partial) % 2:
        raise UnsupportedModel(f"{name} partial_rotary_factor={partial} of head_dim={head_dim} rotates an odd "
                               f"number of dims ({int(head_dim * partial)})")
    key_heads, value_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if value_heads % key_heads:
        raise UnsupportedModel(f"{name} linear_num_value_heads={value_heads} is not a multiple of "
                               f"linear_num_key_heads={key_heads}")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if not shared:  # HF builds the shared expert and its gate whatever the width
        raise UnsupportedModel(f"{name} with shared_expert_intermediate_size=0 is not supported")
    linear = LinearAttentionDims(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"), key_heads=key_heads,
        value_heads=value_heads, key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]), conv_kernel=int(cfg["linear_conv_kernel_dim"]))
    arch = _read_qwen3_moe({**cfg, "head_dim": head_dim})
    if arch.num_moe_experts is None:
        raise UnsupportedModel(f"{name} with num_experts=0 is not supported")
    return replace(arch, family="qwen3_next", rotary_percent=partial, shared_expert_size=shared,
                   shared_expert_gate=True, linear_attention=linear, attention_output_gate=True,
                   zero_centered_norms=True, hf_architecture="Qwen3NextForCausalLM")


def _read_qwen3_5_moe(cfg: dict[str, Any]) -> MoEArch:
    """Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`): Qwen3-Next's layers, the delta net's input
    projections stored apart (the weight map's business), every layer MoE with a router that always
    renormalises its top-k softmax probabilities (the config has no `decoder_sparse_step`,
    `mlp_only_layers` or `norm_topk_prob`), and multimodal RoPE (`mrope_section`, `mrope_interleaved`),
    which at text positions (its three position components equal) is plain RoPE on the rotary dims."""
    return replace(_read_qwen3_next({**cfg, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                                     "intermediate_size": 0}, "Qwen3.5-MoE"),
                   family="qwen3_5_moe", hf_architecture="Qwen3_5MoeForCausalLM")


def _sigmoid_router(cfg: dict[str, Any], experts: int, topk: int) -> dict[str, Any]:
    """MoEArch fields of a DeepSeek-style sigmoid router (GLM-4.5, DeepSeek-V3)."""
    if not cfg.get("norm_topk_prob", True) and topk > 1:
        # megatron's sigmoid router always renormalises the selected scores (topk_routing_with_score_function)
        raise UnsupportedModel("a sigmoid router with norm_topk_prob=false is not supported: megatron-core "
                               "renormalises the selected sigmoid scores")
    groups, keep = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups > 1 and topk // keep != 2:
        # HF ranks a group by the sum of its top-2 scores; megatron by its top topk // topk_group
        raise UnsupportedModel(f"group-limited routing with num_experts_per_tok={topk}, topk_group={keep} "
                               "is not supported: HF ranks groups by their top-2 scores, megatron-core by "
                               "their top num_experts_per_tok // topk_group (they agree when that is 2)")
    if experts % groups:
        raise UnsupportedModel(f"n_routed_experts={experts} does not divide into n_group={groups}")
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    return dict(router_score="sigmoid", expert_bias=True, norm_topk_prob=True,
                routed_scaling_factor=None if scale == 1.0 else scale,
                router_groups=(groups, keep) if groups > 1 else None)


# HF `architectures[0]` -> reader. Add a family by adding a reader here and its
# weight map in convert.py.
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], MoEArch]] = {
    "Qwen3MoeForCausalLM": _read_qwen3_moe,
    "MixtralForCausalLM": _read_mixtral,
    "Qwen2MoeForCausalLM": _read_qwen2_moe,
    "Glm4MoeForCausalLM": _read_glm4_moe,
    "DeepseekV3ForCausalLM": _read_deepseek_v3,
    "Qwen3NextForCausalLM": _read_qwen3_next,
    "Qwen3_5MoeForCausalLM": _read_qwen3_5_moe,
}

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


def read_hf_config(model_dir: str | Path) -> MoEArch:
    """Read `config.json` of a HF checkpoint directory into `MoEArch`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json; expected a HF checkpoint directory")
    cfg = json.loads(path.read_text())
    return arch_from_hf_dict(cfg, source=str(path))


def arch_from_hf_dict(cfg: dict[str, Any], source: str = "config") -> MoEArch:
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                   "mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                                   "deepseek_v3": "DeepseekV3ForCausalLM",
                                   "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                                   "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                                   }.get(cfg.get("model_type", ""), "")
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
