"""Per-rank critic checks (values and gradients under a layout), run by tests through `run_ranks`.

Lives in the package (not the test module) because spawned ranks import it by name.
"""
from __future__ import annotations

from typing import Any

import torch

HEAD_STD = 0.1  # a non-zero head, so values and trunk gradients are not trivially 0


def critic_worker(layout_name: str, hf_dir: str, sequences: list[torch.Tensor], micro_batch_size: int = 2,
                  grads: bool = False, pack_tokens: int | None = None) -> dict[str, Any]:
    """Values of this DP rank's share (padded, and packed with `pack_tokens`) and, with `grads`,
    the gradient of sum(w · V) / N over the whole batch: {HF name or "value_head": tensor}."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.parity import token_weights
    from moe_rl.policy.policy import PolicySpec
    from moe_rl.policy.critic import Critic
    from moe_rl.policy.train_step import OptimConfig

    layout = ParallelLayout.parse(layout_name)
    spec = PolicySpec(hf_dir, layout, OptimConfig(), micro_batch_size=micro_batch_size,
                      max_tokens_per_microbatch=None)
    critic = Critic(spec, head_init_std=HEAD_STD)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    index = list(range(dp_rank, len(sequences), dp))
    mine = [sequences[i] for i in index]
    values, routes = critic.values(mine, record_routes=True)
    result: dict[str, Any] = {"rank": dist.get_rank(), "index": index, "values": values}
    replayed, _ = critic.values(mine, replay_routes=routes)
    result["replay_max_diff"] = float((replayed - values).abs().max())
    if pack_tokens:
        from moe_rl.data.balance import balanced_shards
        from moe_rl.policy.forward import compute_logprobs

        packed = balanced_shards([len(s) for s in sequences], dp)[dp_rank]
        result["packed_index"] = packed
        result["values_packed"] = compute_logprobs(critic.chunks, [sequences[i] for i in packed], micro_batch_size,
                                                   max_tokens=pack_tokens, per_token=critic.per_token).logp
    if grads:
        weights = token_weights(sequences)
        total = sum(len(w) for w in weights)
        w = torch.zeros(len(mine), max(len(s) for s in sequences) - 1)
        for j, i in enumerate(index):
            w[j, : len(weights[i])] = weights[i]
        result["grads"] = critic_gradients(critic, mine, {"w": w}, total)
    return result


def critic_gradients(critic: Any, sequences: list[torch.Tensor], extras: dict[str, torch.Tensor],
                     total: int) -> dict[str, torch.Tensor]:
    """Gradient of sum(w · V) / total, gathered: HF-named trunk tensors this rank writes, and the
    value head's on the rank that writes the last stage's tensors. Weights are left as they were."""
    from moe_rl.policy.convert import iter_hf_tensors
    from moe_rl.policy.forward import build_microbatches
    from moe_rl.policy.train_step import grads_as_params

    mbs = build_microbatches(sequences, critic.spec.micro_batch_size, None, extras=extras,
                             seq_len=int(extras["w"].shape[1]) + 1, chunks=critic.chunks)

    def loss_fn(output, mb):
        v = critic.per_token(output, mb)
        valid = (mb.index >= 0).float().unsqueeze(1)
        return (v * mb.extras["w"] * mb.loss_mask * valid).sum() / total, {}

    saved = [p.detach().clone() for c in critic.opt.chunks for p in c.parameters()]
    critic.opt.backward(mbs, loss_fn)
    grads_as_params(critic.opt.chunks)
    out: dict[str, torch.Tensor] = {}
    heads = {i: c.output_layer for i, c in enumerate(critic.chunks) if c.post_process}
    for i, head in heads.items():  # the trunk without the head, as the HF converter knows it
        if _writes_replicated():
            out["value_head"] = head.weight.detach().clone()
        critic.chunks[i].output_layer = torch.nn.Identity()
    out |= {k: v.clone() for k, v in iter_hf_tensors(critic.chunks, critic.arch)}
    for i, head in heads.items():
        critic.chunks[i].output_layer = head
    with torch.no_grad():
        for p, old in zip((p for c in critic.opt.chunks for p in c.parameters()), saved):
            p.copy_(old)
    return out


def _writes_replicated() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
