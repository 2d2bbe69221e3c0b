"""The `model` and `parallel` sections of the run config, and the rules between them and
the model's shape (a layout must divide heads, experts and layers).

The `check_*(cfg)` rules take the whole `RunConfig` (`moe_rl.config`, which imports this
module: hence `Any`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from moe_rl.configurable import choice, ranged
from moe_rl.policy.families.registry import BY_NAME, TINY_FAMILIES, family_of


DTYPES = ("fp32", "bf16", "fp16")
# The HF projections LoRA can adapt, by transformers' module names (moe_rl/policy/lora.py).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """LoRA: train low-rank adapters on a frozen base (PEFT's `r`, `lora_alpha`, `lora_dropout`,
    `target_modules`). The adapters sit on megatron's own layers under every layout; weight pushes
    and HF exports carry the merged weights (W + alpha / rank * B A)."""

    rank: int = ranged(0, ge=0)
    """Adapter rank r; 0 = off (full-parameter training)."""
    alpha: float = ranged(16.0, gt=0.0)
    """Scale numerator: the adapter adds alpha / rank * B A x."""
    dropout: float = ranged(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input (training only). PEFT refuses it on routed experts' fused
    weights, so a run that adapts the experts keeps 0 to stay exportable as PEFT does it."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Which projections get adapters: q_proj, k_proj, v_proj, o_proj (attention; q, k and v
    together, they are one fused layer), gate_proj, up_proj, down_proj (every MLP: dense, shared
    and each routed expert, whose gate and up are one weight in HF, gate_up_proj, so both or
    neither). The router is never adapted."""


@dataclass
class TinyModel:
    """Shape of the fresh random MoE built when `model.hf_path` is None (Qwen3-MoE unless `family`).

    Names match `moe_rl.policy.tiny.TinyMoEConfig` (init_std aside: an argument of
    `make_tiny_qwen3_moe`). The defaults divide every layout the tests use: TP2 (4 heads,
    2 KV heads), PP2 x VPP2 (4 layers), EP2 (4 experts).
    """

    vocab_size: int = ranged(128, ge=1)
    """Token vocabulary; the toy tasks need 16 (see moe_rl/data/toy.py)."""
    hidden_size: int = ranged(64, ge=1)
    """Residual width; small so a CPU step takes well under a second."""
    moe_intermediate_size: int = ranged(32, ge=1)
    """Hidden width of each expert's MLP."""
    intermediate_size: int = ranged(128, ge=1)
    """Hidden width of a dense MLP (only used by dense layers, if any)."""
    num_hidden_layers: int = ranged(4, ge=1)
    """Transformer layers; 4 allows PP2 with VPP2."""
    num_attention_heads: int = ranged(4, ge=1)
    """Query heads; 4 allows TP2."""
    num_key_value_heads: int = ranged(2, ge=1)
    """KV heads (GQA groups); 2 allows TP2 and keeps GQA in the tested path."""
    head_dim: int = ranged(16, ge=1)
    """Per-head width (Qwen3 sets it explicitly rather than hidden/heads)."""
    num_experts: int = ranged(4, ge=1)
    """Routed experts per MoE layer; 4 allows EP2 and EP4."""
    num_experts_per_tok: int = ranged(2, ge=1)
    """Top-k experts per token; 2 so routes can partly change between updates."""
    init_std: float = ranged(0.02, gt=0.0)
    """Std of the random initial weights (HF's default): a near-uniform first policy that explores."""
    family: str = choice("qwen3_moe", TINY_FAMILIES)
    """HF architecture of the fresh model: Qwen3-MoE; Qwen2-MoE (q/k/v biases, a gated shared expert
    as wide as a routed one, head width hidden / heads); Mixtral (no QK-norm, top-k probabilities
    renormalised, `moe_intermediate_size` its experts' `intermediate_size`); or GLM-4.5 (the first
    layer dense, a shared expert, a sigmoid router with a selection bias, RoPE on half of each head,
    q/k/v biases); or DeepSeek-V3 (multi-latent attention with widths from `head_dim`, the first
    layer dense, a shared expert, the sigmoid router with experts in 2 groups of which 1 is kept); or
    Qwen3-Next (gated delta net layers 0, 2, ... with `num_key_value_heads` key and `num_attention_heads`
    value heads of `head_dim`, gated attention between them, a gated shared expert; rows are not packed:
    needs `parallel.max_tokens_per_microbatch=null`)."""


@dataclass
class ModelConfig:
    """Which policy to train and how its weights are held."""

    hf_path: str | None = None
    """HF checkpoint directory. None builds a fresh tiny model from `tiny` (CPU demo and tests)."""
    tiny: TinyModel = field(default_factory=TinyModel)
    """Shape of the fresh model when `hf_path` is None; ignored otherwise."""
    dtype: str = choice("fp32", DTYPES)
    """Parameter/compute dtype. fp32 because the CPU path is the default; GPU configs set bf16."""
    recompute: bool = False
    """Activation recomputation: trades ~30% more compute for memory; needed for long sequences."""
    moe_router_fusion: bool = False
    """Fused router kernel (transformer-engine >= 2.7). Off because megatron silently skips routing
    replay when it is on: allowed only with algo.replay=off."""
    moe_permute_fusion: bool | None = None
    """Fused MoE token permutation (transformer-engine >= 2.1). None = on with a GPU and TE, off on CPU
    (moe_rl/policy/perf.py says what each fusion needs)."""
    apply_rope_fusion: bool | None = None
    """Fused rotary embedding (transformer-engine >= 1.4). None = on with a GPU and TE, off on CPU."""
    bias_activation_fusion: bool | None = None
    """megatron's fused SwiGLU. None = on with a GPU, off on CPU."""
    bias_dropout_fusion: bool | None = None
    """megatron's fused bias-dropout-add. None = on with a GPU, off on CPU."""
    gradient_accumulation_fusion: bool | None = None
    """Weight-gradient GEMMs accumulate straight into the fp32 gradient buffers (NVIDIA apex's
    fused_weight_gradient_mlp_cuda, which the docker image builds). None = on with a GPU and apex."""
    moe_aux_loss_coef: float | None = ranged(None, ge=0.0)
    """Weight of the routers' load-balancing loss; null = the checkpoint's `router_aux_loss_coef`
    (0 when it has none), 0 = off. HF trainers (TRL's GRPOTrainer) take the same default."""
    expert_bias_update_rate: float = ranged(0.0, ge=0.0)
    """Sigmoid routers with a selection bias (GLM-4.5, DeepSeek-V3): the step of megatron's
    aux-loss-free balancing, which moves each expert's bias by this much per update towards an even
    load. 0 = frozen: routes stay put between updates (what replay and drift measure). Set it (e.g.
    1e-3, pretraining's value) to keep the load balanced; `moe/expert_bias_change` logs the moves
    and the engines get the bias with every weight push."""
    seed: int = 1234
    """Seed for model init and megatron's RNG tracker (data order has its own seed)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full-parameter training (`model.lora.rank` > 0)."""


@dataclass
class ParallelConfig:
    """Trainer parallel layout. Checks against the world size live in `policy/parallel.py`."""

    tp: int = ranged(1, ge=1)
    """Tensor parallel size; must divide attention heads and KV heads."""
    pp: int = ranged(1, ge=1)
    """Pipeline parallel stages; pp * vpp must divide the layer count (or see first_stage_layers)."""
    vpp: int | None = ranged(None, ge=1)
    """Virtual pipeline chunks per stage (interleaved 1F1B); None = not interleaved. Needs pp > 1."""
    first_stage_layers: int | None = ranged(None, ge=1)
    """Layers on the first pipeline stage when they do not split evenly (DeepSeek-V3's 61, GLM-4.5-Air's
    46); the stages without a count share the rest evenly. None = an even split (pp * vpp divides them)."""
    last_stage_layers: int | None = ranged(None, ge=1)
    """Layers on the last pipeline stage (it also holds the output layer and the loss), as above."""
    ep: int = ranged(1, ge=1)
    """Expert parallel size; must divide the number of experts."""
    etp: int = ranged(1, ge=1)
    """Tensor parallel size inside experts; 1 because EP scales MoE better than splitting experts."""
    sp: bool | None = None
    """Sequence parallel; None = auto (on when tp > 1, which megatron MoE requires): the rule is
    `ParallelLayout.sequence_parallel`'s (moe_rl/policy/parallel.py), for the layout it makes of this section."""
    micro_batch_size: int = ranged(4, ge=1)
    """Sequences per forward/backward micro-batch; tiny models fit 4, long-context runs use 1."""
    overlap_grad_reduce: bool | None = None
    """Reduce gradients bucket by bucket during the backward pass (megatron DDP). None = on with a
    GPU, off on CPU."""
    overlap_param_gather: bool | None = None
    """With train.distributed_optimizer: gather the updated parameters during the next forward instead
    of at the end of the optimizer step. None = on with a GPU and the distributed optimizer."""
    max_tokens_per_microbatch: int | None = ranged(None, ge=2)
    """Token budget per micro-batch. Set: sequences are packed several to a row (no padding
    compute) and spread over data-parallel ranks by tokens rather than by count; null = padded
    micro-batches of micro_batch_size sequences. Must hold the longest sequence
    (data.max_prompt_len + rollout.max_new_tokens)."""


# Keys of a HF config.json that give the shapes the parallel layout must divide.
_HF_SHAPE_KEYS = {
    "num_attention_heads": ("num_attention_heads",),
    "num_key_value_heads": ("num_key_value_heads",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_hidden_layers": ("num_hidden_layers",),
    "moe_intermediate_size": ("moe_intermediate_size",),
}


def _model_shape(model: ModelConfig) -> dict[str, tuple[int, str]]:
    """Known model sizes as name -> (value, label for messages).

    The tiny model's sizes are always known; for `hf_path` they are read from its
    config.json when that file is on this machine, and skipped otherwise.
    """
    if model.hf_path is None:
        return {k: (v, f"model.tiny.{k}={v}") for k, v in dataclasses.asdict(model.tiny).items()}
    raw = _hf_config_json(model)
    if raw is None:
        return {}
    raw = raw.get("text_config", raw)  # multimodal checkpoints nest the LM's config
    cfg_file = Path(model.hf_path) / "config.json"
    shape = {}
    for name, keys in _HF_SHAPE_KEYS.items():
        value = next((raw[k] for k in keys if isinstance(raw.get(k), int)), None)
        if value is not None:
            shape[name] = (value, f"{name}={value} (from {cfg_file})")
    return shape


def _hf_config_json(model: ModelConfig) -> dict[str, Any] | None:
    """`model.hf_path`'s config.json, or None (a fresh tiny model, or the file is not on this machine)."""
    if model.hf_path is None:
        return None
    try:
        return json.loads((Path(model.hf_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _has_linear_attention(model: ModelConfig) -> bool:
    """Whether `model.hf_path`'s config.json (when on this machine) is a gated delta net model (Qwen3-Next,
    Qwen3.5-MoE), or the fresh tiny model is one."""
    if model.hf_path is None:
        family = BY_NAME.get(model.tiny.family)
    else:
        family = family_of(_hf_config_json(model) or {})
    return family is not None and family.linear_attention


def _divides(key: str, size: int, shape: dict[str, tuple[int, str]], dim: str,
             what: str = "") -> Iterator[str]:
    """`key: <what><size> must divide <dim>=N` when the model's `dim` is known and not divisible."""
    if dim in shape and shape[dim][0] % size:
        yield f"{key}: {what}{size} must divide {shape[dim][1]}"


def check_model(cfg: Any) -> Iterator[str]:
    tiny = cfg.model.tiny
    yield from _check_lora(cfg)
    if cfg.model.hf_path is None:
        if tiny.num_experts_per_tok > tiny.num_experts:
            yield (f"model.tiny.num_experts_per_tok: {tiny.num_experts_per_tok} must be <= "
                   f"model.tiny.num_experts={tiny.num_experts}")
        if tiny.num_attention_heads % tiny.num_key_value_heads:
            yield (f"model.tiny.num_key_value_heads: {tiny.num_key_value_heads} must divide "
                   f"model.tiny.num_attention_heads={tiny.num_attention_heads}")
    elif not cfg.model.hf_path.strip():
        yield "model.hf_path: '' must be a checkpoint directory or null (fresh tiny model)"
    if cfg.model.moe_router_fusion and cfg.algo.replay != "off":
        yield (f"model.moe_router_fusion: true is not allowed with algo.replay={cfg.algo.replay}: "
               "the fused router skips routing replay (set algo.replay=off or fusion false)")
    elif cfg.model.moe_router_fusion and cfg.drift.enabled:
        yield ("model.moe_router_fusion: true is not allowed with drift.enabled=true: the fused router skips "
               "RouterReplay, which records the routes drift compares (set drift.enabled=false or fusion false)")


def _check_lora(cfg: Any) -> Iterator[str]:
    lora = cfg.model.lora
    if not lora.rank:
        return
    targets = list(lora.target_modules)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        yield (f"model.lora.target_modules: {unknown or targets} {'are not' if unknown else 'names no'} "
               f"projections moe_rl adapts; use some of {list(LORA_TARGETS)}")
    qkv = [t for t in ("q_proj", "k_proj", "v_proj") if t in targets]
    if qkv and len(qkv) < 3:
        yield (f"model.lora.target_modules: {qkv} without the rest of q_proj, k_proj, v_proj: megatron fuses "
               "them into one layer; target all three or none")
    mlp = {"gate_proj", "up_proj", "down_proj"} & set(targets)
    if ("gate_proj" in mlp) != ("up_proj" in mlp):
        yield ("model.lora.target_modules: a routed expert's gate_proj and up_proj are one weight in HF "
               "(gate_up_proj): target both or neither")
    if mlp and lora.dropout:
        yield (f"model.lora.dropout: {lora.dropout} with {sorted(mlp)} targeted: PEFT adapts routed experts "
               "without dropout (it cannot factor it out of their fused weights); set model.lora.dropout=0")
    if mlp and cfg.parallel.etp > 1:
        yield (f"model.lora: adapters on routed experts need parallel.etp=1 (got {cfg.parallel.etp}); set "
               "parallel.etp=1 or drop gate_proj, up_proj and down_proj from model.lora.target_modules")


def check_parallel(cfg: Any) -> Iterator[str]:
    p = cfg.parallel
    if p.overlap_param_gather and not cfg.train.distributed_optimizer:
        yield ("parallel.overlap_param_gather: true needs train.distributed_optimizer=true (the distributed "
               "optimizer gathers the parameters it updates)")
    if p.overlap_param_gather and p.overlap_grad_reduce is False:
        yield "parallel.overlap_param_gather: true needs parallel.overlap_grad_reduce (true or null)"
    if p.vpp is not None and p.pp < 2:
        yield f"parallel.vpp: {p.vpp} needs parallel.pp > 1 (pp={p.pp}); use null without pipelining"
    if p.tp > 1 and p.sp is False:
        yield (f"parallel.sp: false is not allowed with parallel.tp={p.tp}: megatron MoE layers "
               "need sequence parallel when tp > 1 (use true or null for auto)")
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    what = "the longest sequence, data.max_prompt_len + rollout.max_new_tokens"
    if cfg.train.mode == "dpo":  # chosen and rejected of a pair share a packed row
        longest, what = 2 * cfg.dpo.max_len, "the longest pair, 2 * dpo.max_len"
    if p.max_tokens_per_microbatch is not None and p.max_tokens_per_microbatch < longest:
        yield (f"parallel.max_tokens_per_microbatch: {p.max_tokens_per_microbatch} cannot hold {what} = "
               f"{longest}; use at least {longest}")
    if p.max_tokens_per_microbatch is not None and _has_linear_attention(cfg.model):
        model = cfg.model.hf_path or f"model.tiny.family={cfg.model.tiny.family}"
        yield (f"parallel.max_tokens_per_microbatch: {p.max_tokens_per_microbatch} packs sequences into rows, which "
               f"{model} (gated delta net layers: Qwen3-Next, Qwen3.5-MoE) cannot run: megatron-core's "
               "gated delta net refuses packed sequences; set parallel.max_tokens_per_microbatch=null")
    shape = _model_shape(cfg.model)
    yield from _divides("parallel.tp", p.tp, shape, "num_attention_heads")
    yield from _divides("parallel.tp", p.tp, shape, "num_key_value_heads")
    yield from _divides("parallel.ep", p.ep, shape, "num_experts")
    yield from _divides("parallel.etp", p.etp, shape, "moe_intermediate_size")
    uneven = p.first_stage_layers is not None or p.last_stage_layers is not None
    if not uneven and p.vpp is None:
        yield from _divides("parallel.pp", p.pp, shape, "num_hidden_layers")
    elif not uneven:
        yield from _divides("parallel.vpp", p.pp * p.vpp, shape, "num_hidden_layers",
                            f"pp*vpp={p.pp}*{p.vpp}=")
    elif "num_hidden_layers" in shape:
        from moe_rl.policy.parallel import LayoutError, ParallelLayout

        stages = ParallelLayout(pp=p.pp, vpp=p.vpp, first_stage_layers=p.first_stage_layers,
                                last_stage_layers=p.last_stage_layers)
        try:
            stages.validate_stages(shape["num_hidden_layers"][0])
        except LayoutError as e:
            yield f"parallel.first_stage_layers: {e} ({shape['num_hidden_layers'][1]})"
