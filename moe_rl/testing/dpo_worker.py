"""A rank of the DPO layout tests: summed pair log-probs and the DPO gradient in one layout."""
from __future__ import annotations

from typing import Any

import torch

from moe_rl.data.preference import PreferencePair


def random_pairs(vocab_size: int, num: int, seed: int = 0) -> list[PreferencePair]:
    """`num` pairs of random tokens: prompts of 2..6 tokens, responses of 1..8 (chosen != rejected)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    length = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    return [PreferencePair(f"p{i}", ids(length(2, 6)), ids(length(1, 8)), ids(length(1, 8))) for i in range(num)]


def dpo_layout_worker(layout_name: str, hf_dir: str, pairs: list[PreferencePair], ref: torch.Tensor,
                      micro_batch_size: int = 4, pack_tokens: int | None = None) -> dict[str, Any]:
    """On every rank: (chosen, rejected) summed log-probs `[N, 2]` of all pairs, and this rank's
    HF-named share of the gradient of the step's DPO loss (reference log-probs `ref` `[N, 2]`),
    padded, and packed into rows of `pack_tokens` when given (pairs spread over DP ranks by
    tokens). Also reports whether every micro-batch held whole pairs, chosen before rejected.
    """
    from moe_rl.config import RunConfig
    from moe_rl.policy.forward import build_microbatches, microbatch_logprobs
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.parity import hf_gradients
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig
    from moe_rl.recipes.dpo.step import pair_batch, pair_logps, pair_loss
    from moe_rl.samples import share_indices

    layout = ParallelLayout.parse(layout_name)
    policy = Policy(PolicySpec(hf_dir, layout, OptimConfig(), micro_batch_size=micro_batch_size))
    cfg = RunConfig()
    cfg.dpo.beta, cfg.dpo.sft_coef = 0.5, 0.1
    out: dict[str, Any] = {"logps": pair_logps(policy, pairs), "whole_pairs": True}
    for key, tokens in (("grads", None), ("grads_packed", pack_tokens)):
        if key == "grads_packed" and tokens is None:
            continue
        mine = share_indices([len(p) for p in pairs], policy.dp_size, policy.dp_rank, 1,
                             by_tokens=tokens is not None)[0]
        seqs, extras = pair_batch([pairs[i] for i in mine], ref[mine])
        mbs = build_microbatches(seqs, micro_batch_size, tokens, extras=extras, chunks=policy.chunks, group_size=2)
        for mb in mbs:
            rows = mb.index[mb.index >= 0].tolist()
            firsts = rows[0::2]  # chosen rows: even, each followed by its rejected row
            out["whole_pairs"] &= rows == [r for c in firsts for r in (c, c + 1)] and all(c % 2 == 0 for c in firsts)
        loss = pair_loss(cfg, len(pairs))

        def loss_fn(logits: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            value, _ = loss(microbatch_logprobs(logits, mb), mb)
            return value, {}

        out[key] = hf_gradients(policy.opt, policy.arch, mbs, loss_fn)
    return out
