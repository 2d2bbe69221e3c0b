"""`Critic`: a megatron value model for PPO-style RL (GAE, VC-PPO, VAPO) on MoE models.

The critic is the policy's network with its vocabulary projection replaced by a value
head (hidden -> 1). It is built by the same builder (`model.build_model`), so it runs
in every layout the policy runs (TP, PP, VPP, EP, ETP, SP, DP, packed micro-batches),
from the trunk of a HF checkpoint (the policy's by default); the head starts at zero,
so the first values are 0 and the first updates move the head only. It has its own
optimizer and LR schedule (`PolicyOptimizer`) and its own `RouteReplay`, so R2 replays
the routes the critic itself chose (the engine's routes are the policy's: no R3).

Position convention (the same as the policy's log-probs, so the two line up):

    sequence        tokens[b, 0 .. T_b - 1]           (prompt, then response)
    values[b, t]    = V(s_t), s_t = tokens[b, : t + 1], the state before token t + 1
    shape           [B, T - 1]; 0 past each sequence's end

so `values[b, t]` is the value of the state in which `logp[b, t]` (the log-prob of
token t + 1) was sampled. For a prompt of P tokens, the response's steps are
t = P - 1 .. T_b - 2; the value after the last step (the state after `<eos>`) is 0.

TP / SP: the head runs replicated on every TP rank. Under sequence parallelism its
input is gathered over the TP group first; the gather's backward only splits the
gradient (every TP rank computed the same full gradient), where the vocabulary
projection's reduce-scatter would sum TP partial gradients. PP: the head exists on
the last pipeline stage; values are broadcast to the other stages like log-probs.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moe_rl.policy.convert import load_hf_weights
from moe_rl.policy.forward import Microbatch
from moe_rl.policy.model import build_model, read_hf_config
from moe_rl.policy.packing import unpack
from moe_rl.policy.parallel import data_parallel_rank_and_size, init_distributed
from moe_rl.policy.perf import resolve
from moe_rl.policy.policy import Policy, PolicySpec, with_aux_loss_coef
from moe_rl.policy.replay import RouteReplay
from moe_rl.policy.train_step import PolicyOptimizer, frozen_rows


class ValueHead(torch.nn.Module):
    """hidden `[s / tp (SP) or s, b, h]` -> values `[s, b, 1]`, replacing GPTModel's output layer.

    Called as the output layer is (`(hidden, weight=..., runtime_gather_output=...)` ->
    `(output, bias)`). The weight `[1, h]` is replicated on TP ranks.
    """

    def __init__(self, config: Any, init_std: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        weight = torch.zeros(1, config.hidden_size, dtype=torch.float32)
        if init_std:  # the same values on every rank: a fixed CPU generator
            weight.normal_(0.0, init_std, generator=torch.Generator().manual_seed(seed))
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        self.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight), None


def microbatch_values(output: torch.Tensor, mb: Microbatch) -> torch.Tensor:
    """`[b, s - 1]` values V(s_t) per sequence from the critic's output `[b_m, s_m, 1]` (packed or not)."""
    if mb.packed is None:
        return output[:, :-1, 0].float()
    return unpack(output[0, :-1, 0].float(), mb.packed.starts, mb.tokens.shape[1] - 1) * mb.loss_mask


class Critic(Policy):
    """The value model on this rank: a `Policy` whose per-token output is V(s_t) instead of log π.

    `values()` is the forward pass, `update()` (inherited) one optimizer step with a loss
    of `(values [b, s - 1], microbatch)`, `state_dict()` / `load_state_dict()` (inherited)
    its model, optimizer and schedule. Every method is collective.
    """

    per_token = staticmethod(microbatch_values)

    def __init__(self, spec: PolicySpec, head_init_std: float = 0.0) -> None:
        self.spec = spec
        arch = with_aux_loss_coef(read_hf_config(spec.hf_dir), spec.moe_aux_loss_coef)
        self.hf_config: dict[str, Any] = json.loads((Path(spec.hf_dir) / "config.json").read_text())
        spec.layout.validate(arch)
        init_distributed(spec.layout, timeout_s=spec.collective_timeout_s, seed=spec.seed)
        # Untied: the value head replaces the output layer, which must not share the embedding.
        self.arch = dataclasses.replace(arch, tie_word_embeddings=False)
        self.perf = resolve(spec.perf, distributed_optimizer=spec.optim.distributed_optimizer,
                            moe=self.arch.num_moe_experts is not None)
        chunks = build_model(self.arch, spec.layout, spec.dtype, spec.recompute, self.perf)
        last = [c for c in chunks if c.post_process]
        for c in last:
            c.output_layer = torch.nn.Identity()  # drop the vocabulary projection before loading
        load_hf_weights(chunks, spec.hf_dir, self.arch)
        for c in last:
            c.output_layer = ValueHead(c.config, head_init_std, spec.seed).to(next(c.parameters()).device)
        self.opt = PolicyOptimizer(chunks, dataclasses.replace(
            spec.optim, overlap_grad_reduce=self.perf.overlap_grad_reduce,
            overlap_param_gather=self.perf.overlap_param_gather), frozen_rows(self.arch))
        self.replay = RouteReplay(self.opt.chunks, self.arch) if self.arch.num_moe_experts else None
        self.dp_rank, self.dp_size = data_parallel_rank_and_size()

    def values(self, sequences: list[torch.Tensor], *, record_routes: bool = False,
               replay_routes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values `[B, T - 1]` of this DP rank's sequences, routes `[B, T - 1, L, K]` or None).

        record_routes: also return the critic's own routes (for R2 and its volatility).
        """
        out = self.logprobs(sequences, record_routes=record_routes, replay_routes=replay_routes)
        return out.logp, out.routes

    def export_hf(self, out_dir: str | Path) -> None:
        raise NotImplementedError("the critic is not a language model: it is checkpointed, not exported")

    def hf_tensors(self):
        raise NotImplementedError("the critic is not a language model: it is not synced to the rollout engine")
