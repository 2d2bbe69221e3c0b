"""Build a megatron-core `GPTModel` for a HF MoE architecture (`MoEArch`, read by its family in `families/`).

`MoEArch` becomes a megatron `TransformerConfig` for a given `ParallelLayout`. On GPU the
transformer-engine layer spec and the alltoall dispatcher are used; on CPU the local spec with a
sequence-parallel-capable RMSNorm and the allgather dispatcher (the alltoall dispatcher creates a
CUDA stream when it is built).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moe_rl.dist.devices import compute_device
from moe_rl.policy.arch import MoEArch, UnsupportedModel
from moe_rl.policy.compat import gated_delta_net_without_fla, mla_without_te
# A family's reading lives in families/; its names are also reachable from here.
from moe_rl.policy.families.registry import ARCHITECTURES, arch_from_hf_dict, read_hf_config
from moe_rl.policy.packing import use_position_ids_for_rope
from moe_rl.policy.parallel import ParallelLayout
from moe_rl.policy.perf import PerfSettings, use_transformer_engine

__all__ = ["ARCHITECTURES", "MoEArch", "UnsupportedModel", "arch_from_hf_dict", "build_model", "layer_offset",
           "layer_spec", "read_hf_config", "transformer_config", "use_transformer_engine"]


# ---------------------------------------------------------------- megatron config

class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with megatron's norm constructor signature that works with sequence parallel.

    megatron's `WrappedTorchNorm` refuses `sequence_parallel=True`, and its fused
    alternatives need apex or transformer-engine. A norm is elementwise over the
    hidden dimension, so it runs unchanged on a sequence shard; the only SP duty is
    to mark the weight so `finalize_model_grads` sums its gradient over TP ranks.
    """

    zero_centered: bool | None = None  # None: megatron's `layernorm_zero_centered_gamma`

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))
        if self.zero_centered is None:
            self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        if self.zero_centered:
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as HF's Qwen3 RMSNorm: normalise in fp32, scale in input dtype; zero-centred
        # (megatron's `layernorm_zero_centered_gamma`) as HF's Qwen3-Next RMSNorm: (1 + w) * h in fp32.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


class PlainRMSNorm(SequenceParallelRMSNorm):
    """`SequenceParallelRMSNorm` that scales by w even in a zero-centred model: the gated delta net's
    output norm (HF's `Qwen3NextRMSNormGated` scales by w, its other norms by 1 + w)."""

    zero_centered = False


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(arch: MoEArch, layout: ParallelLayout, dtype: str = "fp32",
                       recompute: bool = False, perf: PerfSettings | None = None) -> Any:
    """megatron `TransformerConfig` for `arch` under `layout`; `perf`: the resolved fused kernels
    (moe_rl/policy/perf.py; default: none)."""
    from megatron.core.transformer import TransformerConfig

    perf = PerfSettings() if perf is None else perf
    fused = perf.transformer_kwargs()
    gpu = torch.cuda.is_available()
    te = use_transformer_engine()
    params_dtype = _DTYPES[dtype]
    moe = arch.num_moe_experts is not None
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        ffn_hidden_size=arch.ffn_hidden_size or arch.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_layernorm,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fused kernels as resolved in perf.py (off on CPU, where the plain paths are exact).
        bias_activation_fusion=fused["bias_activation_fusion"],
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=fused["apply_rope_fusion"],
        gradient_accumulation_fusion=fused["gradient_accumulation_fusion"],
        bias_dropout_fusion=fused["bias_dropout_fusion"],
        # Losses are summed over microbatches and DP ranks with global normalisers
        # (see algo/losses.py): no averaging in the schedule or in DDP.
        calculate_per_token_loss=True,
        params_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        pipeline_dtype=params_dtype,
        autocast_dtype=params_dtype,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sequence_parallel,
        use_cpu_initialization=not gpu,
        deallocate_pipeline_outputs=True,
        # gloo runs a batch of isend/irecv one by one, matched in posting order: with pp = 2
        # under VPP a rank's forward and backward sends go to the same peer and land in each
        # other's buffers (wrong gradients, same shapes, no error). Unbatched ops are ordered
        # by even/odd rank.
        batch_p2p_comm=gpu,
    )
    if moe:
        kw.update(
            num_moe_experts=arch.num_moe_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_topk=arch.moe_router_topk,
            # norm_topk_prob=True: softmax over the top-k logits (== renormalised top-k
            # probabilities). False: softmax over all experts, then top-k, no renorm.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_score_function=arch.router_score,
            moe_router_load_balancing_type="aux_loss" if arch.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall" if gpu else "allgather",
            moe_grouped_gemm=te,
            moe_layer_freq=[1 if i in arch.moe_layers else 0 for i in range(arch.num_layers)],
            moe_enable_routing_replay=True,
            moe_router_fusion=fused["moe_router_fusion"],  # the config allows it only without replay
            moe_permute_fusion=fused["moe_permute_fusion"],
        )
        if arch.router_score == "sigmoid":
            kw.update(moe_router_enable_expert_bias=arch.expert_bias,
                      moe_router_bias_update_rate=arch.expert_bias_update_rate,
                      moe_router_topk_scaling_factor=arch.routed_scaling_factor)
        if arch.router_groups:
            kw.update(moe_router_num_groups=arch.router_groups[0], moe_router_group_topk=arch.router_groups[1])
        if arch.shared_expert_size:
            kw.update(moe_shared_expert_intermediate_size=arch.shared_expert_size,
                      moe_shared_expert_gate=arch.shared_expert_gate)
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if arch.zero_centered_norms:
        kw.update(layernorm_zero_centered_gamma=True)
    if arch.attention_output_gate:
        kw.update(attention_output_gate=True)
    if arch.linear_attention is not None:
        la = arch.linear_attention
        kw.update(experimental_attention_variant="gated_delta_net",
                  linear_attention_freq=[1 if i in la.layers else 0 for i in range(arch.num_layers)],
                  linear_conv_kernel_dim=la.conv_kernel, linear_key_head_dim=la.key_head_dim,
                  linear_value_head_dim=la.value_head_dim, linear_num_key_heads=la.key_heads,
                  linear_num_value_heads=la.value_heads)
    if arch.mla is not None:
        return _mla_config(arch, kw)
    return TransformerConfig(**kw)


def _mla_config(arch: MoEArch, kw: dict[str, Any]) -> Any:
    """megatron's `MLATransformerConfig` for DeepSeek-V3's attention. `qk_layernorm` builds the
    latents' norms (q_a_layernorm, kv_a_layernorm); megatron's MLA de-interleaves the RoPE dims
    itself (as HF's `rope_interleave`), so `rotary_interleaved` stays off; the fused RoPE kernel
    is off (megatron refuses it for plain RoPE under MLA). Plain RoPE sets mscale_all_dim 0, which
    makes MLA's softmax scale 1 / sqrt(head dim) as HF's."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m = arch.mla
    kw.update(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
              qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
              qk_layernorm=True, rotary_interleaved=False, apply_rope_fusion=False, rotary_base=arch.rope_theta)
    if m.yarn:
        kw.update(rope_type="yarn", **dict(m.yarn))
    else:
        kw.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return MLATransformerConfig(**kw)


def _swap_norms(spec: Any, config: Any) -> None:
    """Replace the local spec's torch norms with SequenceParallelRMSNorm and its expert loop with
    GroupedExperts, in place (and give multi-latent attention a core attention that takes its head
    widths)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_rl.policy.grouped_experts import GroupedExperts

    sub = spec.submodules
    sub.input_layernorm = SequenceParallelRMSNorm
    sub.pre_mlp_layernorm = SequenceParallelRMSNorm
    attn = sub.self_attention.submodules
    if getattr(config, "multi_latent_attention", False):
        attn.q_layernorm = attn.kv_layernorm = SequenceParallelRMSNorm
        attn.core_attention = _mla_core_attention()
    elif config.qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = SequenceParallelRMSNorm
    experts = getattr(sub.mlp.submodules, "experts", None)  # dense layers (first_k_dense) have none
    if experts is not None and experts.module is SequentialMLP:
        experts.module = GroupedExperts  # the loop's math in two grouped matmuls (grouped_experts.py)


def _mla_core_attention() -> type:
    """megatron-core 0.16.1's local `DotProductAttention` refuses the `k_channels` / `v_channels`
    keywords MLA passes and sizes its output by `kv_channels`: take them and size it by the value
    heads. (The scale is MLA's own, passed in; the maths is the local path's.)"""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, config: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads,
                                                        self.pg_collection.tp.size())

    return MLADotProductAttention


def layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Block spec for this pipeline stage (TE on GPU, local + SP-capable norms on CPU)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = use_transformer_engine()
    if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
        return _hybrid_layer_spec(config, vp_stage, te)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    if te:
        return block
    block = copy.deepcopy(block)
    for spec in block.layer_specs:
        _swap_norms(spec, config)
    block.layer_norm = SequenceParallelRMSNorm
    return block


def _hybrid_layer_spec(config: Any, vp_stage: int | None, te: bool) -> Any:
    """Qwen3-Next's block: gated delta net layers where `config.linear_attention_freq` says 1, gated
    full attention elsewhere. With transformer-engine, megatron's own experimental spec (its delta net's
    `in_proj` holds the input norm as `layer_norm_weight`), its output norm made a plain-w norm; without,
    the local spec with each linear layer's attention swapped for the delta net (the megatron helper
    asserts transformer-engine) and a separate input norm. The delta net's fla kernels or their torch
    stand-ins: `compat.gated_delta_net_without_fla`."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    pattern = config.linear_attention_freq
    if te:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec)

        block = copy.deepcopy(get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage))
        for spec in block.layer_specs:
            attn = spec.submodules.self_attention
            if attn.module is GatedDeltaNet:
                attn.submodules.out_norm = PlainRMSNorm
        return block
    block = copy.deepcopy(get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                     vp_stage=vp_stage))
    first = layer_offset(config, vp_stage)
    delta_net = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=PlainRMSNorm, out_proj=RowParallelLinear),
        metainfo={"fuse_input_layernorm": False})
    specs = []
    for i, spec in enumerate(block.layer_specs):  # the list may alias one spec object
        spec = copy.deepcopy(spec)
        _swap_norms(spec, config)
        if pattern[first + i]:
            spec.submodules.self_attention = copy.deepcopy(delta_net)
        specs.append(spec)
    block.layer_specs = specs
    block.layer_norm = SequenceParallelRMSNorm
    return block


def build_model(arch: MoEArch, layout: ParallelLayout, dtype: str = "fp32", recompute: bool = False,
                perf: PerfSettings | None = None) -> list[Any]:
    """Build this rank's model chunks (one per virtual pipeline stage).

    Parallel groups must already exist (`parallel.init_distributed`). Returns the
    bare `GPTModel` chunks; DDP wrapping is the training step's business.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    config = transformer_config(arch, layout, dtype, recompute, perf)
    if arch.mla is not None:
        mla_without_te()
    if arch.linear_attention is not None:
        gated_delta_net_without_fla()
    # RouterReplay keeps a class-level list of every router ever built; a second
    # model in the same process would otherwise mix its routers into ours.
    RouterReplay.clear_global_router_replay_instances()
    chunks = []
    vpp = layout.vpp or 1
    for stage in range(vpp):
        vp_stage = stage if layout.vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, vp_stage),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            rotary_percent=arch.rotary_percent,
            vp_stage=vp_stage,
        )
        _mark_expert_params(model)
        if not use_transformer_engine():
            use_position_ids_for_rope(model)  # packed rows restart positions (TE uses THD instead)
        # On the compute device: on CPU megatron initialises on the host (use_cpu_initialization), and the
        # device guard must see the weights where a GPU run has them (collectives gather them).
        chunks.append(model.to(device=compute_device(), dtype=_DTYPES[dtype]))
    return chunks


def _mark_expert_params(model: Any) -> None:
    """Route every expert weight's gradient through DDP's expert-data-parallel reduction.

    megatron-core marks expert weights (`allreduce=False`) only when ep > 1. With
    ep = 1, tp > 1 and etp = 1, each TP rank runs the full experts on its own
    sequence-parallel shard of tokens, so the expert gradients must be summed over
    the expert-data-parallel group (TP x DP ranks); left unmarked they are reduced
    over DP only and each TP rank keeps a partial gradient. Marking them is exact for
    every layout, since the expert-DP group equals the DP group whenever etp = tp.
    """
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def layer_offset(config: Any, vp_stage: int | None = None) -> int:
    """Global index of this chunk's first decoder layer."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=vp_stage)


