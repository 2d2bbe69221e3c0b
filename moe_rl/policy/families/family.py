"""What one HF model family is to moe_rl (`Family`), and the pieces several families share: the
weight-map record (`Shard`), config readers (RoPE, a sigmoid router) and weight-map parts (q/k/v
biases, shared experts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from moe_rl.policy.arch import MoEArch, UnsupportedModel


@dataclass(frozen=True)
class Shard:
    """How one megatron parameter relates to HF tensors.

    hf: HF tensor names that make up the full (unsharded) megatron tensor.
    kind: `copy` (one tensor), `qkv` (q, k, v interleaved per query group),
          `glu` (gate and up stacked, each split separately), `qgkv` (gated attention: HF's q_proj
          holds [q_h | gate_h] per head; megatron per query group [q heads | gate heads | k | v]),
          `gdn_in` (the gated delta net's in_proj: Qwen3-Next's in_proj_qkvz / in_proj_ba grouped per
          key head, or Qwen3.5-MoE's in_proj_qkv, _z, _b, _a; megatron's [q | k | v | z | b | a], each
          part split over TP), `gdn_conv` (its conv:
          [q | k | v] channels in both, each part split over TP).
    dim: the dimension split across `group` (None = replicated).
    group: `tp` or `etp`.
    """

    hf: tuple[str, ...]
    kind: str = "copy"
    dim: int | None = None
    group: str = "tp"


# A family's weight map: (megatron name, global layer or None, global expert or None, arch) -> its
# Shard, None for a name the family does not have. Layer names are relative to `decoder.layers.<i>.`,
# an expert's are `linear_fc1` / `linear_fc2`.
WeightMap = Callable[[str, "int | None", "int | None", MoEArch], "Shard | None"]


@dataclass(frozen=True)
class Family:
    """One HF model family.

    name: `MoEArch.family` (and `model.tiny.family` where it has a `tiny` shape).
    architecture: HF's `architectures[0]`; model_types: the `model_type` values that name it in a
    config without `architectures`.
    read: config.json (a dict) -> MoEArch, refusing with UnsupportedModel what megatron-core cannot match.
    weight_map: megatron names -> HF names (convert.py slices and gathers by it).
    example: the keys of its tiny test model, unlike the others' shapes so a map that fits only one
    family's fails; hf_config(**keys) -> transformers' config of the family (its architecture named).
    tiny: a `TinyMoEConfig` shape -> the HF config of a fresh model of that shape (None: no fresh model).
    init_std, perturb: the tiny models' init scale and the parameters drawn where HF starts them at a
    constant (so a map that mixes them up fails).
    engine_name: a checkpoint name -> the name of transformers' module (None: the same); what an
    in-process engine resolves pushed tensors with.
    linear_attention: some of its layers are gated delta nets (what the config checks need to know
    before a model is read: such layers take no packed micro-batches).
    """

    name: str
    architecture: str
    model_types: tuple[str, ...]
    read: Callable[[dict[str, Any]], MoEArch]
    weight_map: WeightMap
    example: dict[str, Any]
    hf_config: Callable[..., Any]
    tiny: Callable[[Any], Any] | None = None
    init_std: float = 0.2
    perturb: tuple[str, ...] = ()
    engine_name: Callable[[str], str] | None = None
    linear_attention: bool = False


# ---------------------------------------------------------------- config pieces

def rope_theta(cfg: dict[str, Any]) -> float:
    # Published checkpoints: top-level `rope_theta`; current transformers writes
    # `rope_parameters: {"rope_theta": ..., "rope_type": "default"}`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0


def partial_rotary(cfg: dict[str, Any], params: dict[str, Any]) -> Any:
    """The rotated share of each head: transformers' rotary embeddings read `rope_parameters` (its config
    classes fill it from a top-level `partial_rotary_factor` only when it has none), so that one first.
    A config.json may hold both and disagree: transformers 5.19's Qwen3.5-MoE config saves its default
    top-level 0.25 beside a `rope_parameters` value it then uses."""
    return params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")


def sigmoid_router(cfg: dict[str, Any], experts: int, topk: int) -> dict[str, Any]:
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


def hf_config(name: str, **kw: Any) -> Any:
    """transformers' `<name>Config(**kw)` with its architecture `<name>ForCausalLM` named."""
    import transformers

    cfg = getattr(transformers, f"{name}Config")(**kw)
    cfg.architectures = [f"{name}ForCausalLM"]
    return cfg


# ---------------------------------------------------------------- weight-map pieces

def qkv_bias(p: str) -> dict[str, Shard]:
    """Biases on q/k/v (Qwen2-MoE, GLM-4.5), fused as their weights are."""
    return {"self_attention.linear_qkv.bias": Shard((f"{p}self_attn.q_proj.bias", f"{p}self_attn.k_proj.bias",
                                                     f"{p}self_attn.v_proj.bias"), kind="qkv", dim=0)}


def shared_experts(p: str, hf: str) -> dict[str, Shard]:
    """Always-on shared experts, HF's `mlp.<hf>.{gate,up,down}_proj`."""
    return {"mlp.shared_experts.linear_fc1.weight": Shard((f"{p}mlp.{hf}.gate_proj.weight", f"{p}mlp.{hf}.up_proj.weight"),
                                                          kind="glu", dim=0),
            "mlp.shared_experts.linear_fc2.weight": Shard((f"{p}mlp.{hf}.down_proj.weight",), dim=1)}


def plus(base: WeightMap, extra: Callable[[str], dict[str, Shard]]) -> WeightMap:
    """`base`'s map with the layer tensors `extra(HF layer prefix)` names added."""
    def shard(name: str, layer: int | None, expert: int | None, arch: MoEArch) -> Shard | None:
        found = extra(f"model.layers.{layer}.").get(name) if layer is not None and expert is None else None
        return found or base(name, layer, expert, arch)
    return shard
