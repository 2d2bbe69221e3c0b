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
from typing import Any

import torch
import torch.nn.functional as F

from moe_rl.policy.convert import load_hf_weights
from moe_rl.policy.forward import Microbatch
from moe_rl.policy.model import MoEArch
from moe_rl.policy.packing import unpack
from moe_rl.policy.policy import MegatronModel, PolicySpec


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


class Critic(MegatronModel):
    """The value model on this rank: a megatron model whose per-token output is V(s_t).

    `values()` is the forward pass, `update()` one optimizer step with a loss of
    `(values [b, s - 1], microbatch)`, `state_dict()` / `load_state_dict()` its model,
    optimizer and schedule (all shared with `Policy` through `MegatronModel`). It is
    checkpointed, never exported or synced to a rollout engine. Every method is collective.
    """

    per_token = staticmethod(microbatch_values)

    def __init__(self, spec: PolicySpec, head_init_std: float = 0.0) -> None:
        self.head_init_std = head_init_std
        super().__init__(spec)

    def _model_arch(self, arch: MoEArch) -> MoEArch:
        # Untied: the value head replaces the output layer, which must not share the embedding.
        return dataclasses.replace(arch, tie_word_embeddings=False)

    def _load_weights(self, chunks: list[Any]) -> None:
        last = [c for c in chunks if c.post_process]
        for c in last:
            c.output_layer = torch.nn.Identity()  # drop the vocabulary projection before loading
        load_hf_weights(chunks, self.spec.hf_dir, self.arch)
        for c in last:
            c.output_layer = ValueHead(c.config, self.head_init_std, self.spec.seed).to(next(c.parameters()).device)

    def values(self, sequences: list[torch.Tensor], *, record_routes: bool = False,
               replay_routes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values `[B, T - 1]` of this DP rank's sequences, routes `[B, T - 1, L, K]` or None).

        record_routes: also return the critic's own routes (for R2 and its volatility).
        """
        out = self._forward(sequences, record_routes=record_routes, replay_routes=replay_routes)
        return out.logp, out.routes
