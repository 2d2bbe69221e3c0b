"""LoRA test helpers: the independent reference (HF transformers + the `peft` library on the same base
and adapter) and the rank worker that runs the megatron policy with the adapter under a layout.

Adapters are exchanged whole, named as `moe_rl.policy.lora.adapter_items` names them
(`model.layers.0.self_attn.q_proj.lora_A`, `model.layers.0.mlp.experts.3.gate_up_proj.lora_B`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moe_rl.policy.parity import token_weights

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def peft_model(hf_dir: str, rank: int, alpha: float, seed: int = 0, b_std: float = 0.05) -> Any:
    """HF model + PEFT LoRA on attention (target_modules) and every routed expert (target_parameters,
    transformers 5's fused expert weights), with B drawn non-zero so the adapter changes the output."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(ATTENTION),
                          target_parameters=list(EXPERT_PARAMS), lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
            elif "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def peft_adapter(model: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """The PEFT model's adapter (or its gradients) as whole tensors in moe_rl's names: per-projection
    A and B as they are; each expert's slice of PEFT's stacked expert factors (A: [r*E, in] as
    [E, r, in]; B: [out, r*E] as [out, r, E])."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        a, b = (a.grad, b.grad) if grads else (a.detach(), b.detach())
        path = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            e, part = module.num_experts, module.parameter_name
            r = a.shape[0] // e
            for i in range(e):
                out[f"{path}.{i}.{part}.lora_A"] = a.reshape(e, r, -1)[i].clone()
                out[f"{path}.{i}.{part}.lora_B"] = b.reshape(b.shape[0], r, e)[:, :, i].clone()
        else:
            out[f"{path}.lora_A"], out[f"{path}.lora_B"] = a.clone(), b.clone()
    return out


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The PEFT model's weights with the adapter merged in (PEFT's `merge_and_unload`), by transformers'
    names; the model keeps its adapter."""
    import copy

    return {k: v.detach().clone() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}


def peft_reference(model: Any, sequences: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Per-token log-probs of each sequence (one at a time, no padding) and the adapter's gradient of
    sum(w * logp) / N with `parity.token_weights`, the loss `lora_worker` differentiates."""
    model.eval()
    model.zero_grad()
    weights = token_weights(sequences)
    total = sum(len(w) for w in weights)
    logps = []
    for seq, w in zip(sequences, weights):
        logits = model(seq.unsqueeze(0)).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, seq[1:, None]).squeeze(-1)
        (-(logp * w).sum() / total).backward()
        logps.append(logp.detach())
    return logps, peft_adapter(model, grads=True)


def lora_worker(layout_name: str, hf_dir: str, sequences: list[torch.Tensor], adapter: dict[str, torch.Tensor],
                rank: int, alpha: float, micro_batch_size: int = 2, export_dir: str | None = None,
                peft_dir: str | None = None) -> dict[str, Any]:
    """On every rank: the megatron policy under `layout_name` with `adapter` on, this DP rank's
    log-probs, and the whole-batch loss's gradient of every adapter tensor this rank holds (gathered
    over TP to whole tensors). Also the number of trainable parameters outside the adapters; with
    `export_dir`, the HF export (merged weights) written there first; with `peft_dir`, the adapter in
    PEFT's format."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.policy.convert import export_hf, load_hf_weights
    from moe_rl.policy.forward import build_microbatches, compute_logprobs, microbatch_logprobs
    from moe_rl.policy.lora import LoraSpec, adapter_items, attach_lora, export_peft, is_adapter, set_adapters
    from moe_rl.policy.model import build_model, read_hf_config
    from moe_rl.policy.parallel import ParallelLayout, init_distributed
    from moe_rl.policy.train_step import OptimConfig, PolicyOptimizer, frozen_rows

    layout = ParallelLayout.parse(layout_name)
    arch = read_hf_config(hf_dir)
    init_distributed(layout.validate(arch))
    chunks = build_model(arch, layout)
    load_hf_weights(chunks, hf_dir, arch)
    spec = LoraSpec(rank=rank, alpha=alpha, target_modules=(*ATTENTION, "gate_proj", "up_proj", "down_proj"))
    attach_lora(chunks, arch, spec)
    set_adapters(chunks, arch, adapter)
    if peft_dir is not None:
        export_peft(chunks, arch, spec, peft_dir, hf_dir)
    if export_dir is not None:
        export_hf(chunks, export_dir, arch, json.loads((Path(hf_dir) / "config.json").read_text()))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    index = list(range(dp_rank, len(sequences), dp))
    mine = [sequences[i] for i in index]
    result: dict[str, Any] = {"rank": dist.get_rank(), "index": index,
                              "logp": compute_logprobs(chunks, mine, micro_batch_size).logp}
    result["trainable_base"] = sum(p.numel() for c in chunks for n, p in c.named_parameters()
                                   if p.requires_grad and not is_adapter(n))

    weights = token_weights(sequences)
    total = sum(len(w) for w in weights)
    w = torch.zeros(len(mine), max(len(s) for s in sequences) - 1)
    for j, i in enumerate(index):
        w[j, : len(weights[i])] = weights[i]
    mbs = build_microbatches(mine, micro_batch_size, extras={"w": w}, seq_len=max(len(s) for s in sequences),
                             chunks=chunks)

    def loss_fn(logits, mb):
        logp = microbatch_logprobs(logits, mb)
        valid = (mb.index >= 0).float().unsqueeze(1)
        return -(logp * mb.extras["w"] * mb.loss_mask * valid).sum() / total, {}

    opt = PolicyOptimizer(chunks, OptimConfig(), frozen_rows(arch))
    opt.backward(mbs, loss_fn)
    grads = {}
    for stem, param, lora, _ in adapter_items(chunks, arch):
        g = getattr(param, "main_grad", None)
        g = (param.grad if g is None else g).detach().clone()
        split = (stem.endswith("lora_B") and lora.column) or (stem.endswith("lora_A") and not lora.column)
        if split and not lora.local:
            pieces = [torch.empty_like(g) for _ in range(lora.tp)]
            dist.all_gather(pieces, g.contiguous(), group=lora.tp_group)
            g = torch.cat(pieces, dim=0 if lora.column else 1)
        grads[stem] = g
    result["grads"] = grads
    return result


def lora_checkpoint_worker(layout_name: str, hf_dir: str, ckpt: str, batch: list[torch.Tensor], save: bool,
                           rank: int = 4, alpha: float = 8.0) -> dict[str, Any]:
    """A LoRA policy (distributed optimizer) under `layout_name`: with `save`, one update, a checkpoint
    in `ckpt`, then a second update; else the checkpoint loaded, then the same second update. Returns the
    whole adapters after the checkpoint's state and after the second update, and the base's HF tensors."""
    from moe_rl.policy.lora import LoraSpec, whole_adapters
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    optim = OptimConfig(lr=1e-2, total_steps=4, distributed_optimizer=True)
    policy = Policy(PolicySpec(hf_dir=hf_dir, layout=ParallelLayout.parse(layout_name), optim=optim,
                               micro_batch_size=2, lora=LoraSpec(rank, alpha)))

    def loss(logp, mb):
        return -(logp.float() * mb.loss_mask).sum() / 100.0, {}

    mine = batch[policy.dp_rank::policy.dp_size]
    if save:
        policy.update(mine, {}, loss)
        policy.save_sharded(ckpt)
    else:
        policy.load_sharded(ckpt)
    held = whole_adapters(policy.chunks, policy.arch)
    policy.update(mine, {}, loss)
    return {"held": held, "next": whole_adapters(policy.chunks, policy.arch),
            "merged": {n: t.clone() for n, t in policy.hf_tensors()}}
