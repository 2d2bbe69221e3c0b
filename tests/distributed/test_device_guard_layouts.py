"""A policy log-prob pass (routes recorded, entropy) and an update under routing replay, on 2 gloo
ranks, with the device guard installed before the policy is built and without it.

Under the guard every collective moe_rl calls must get device tensors (else the run raises
HostTensorInCollective), and the results must be bit-identical to the unguarded run: the
guard only watches, compat does the same arithmetic on the CPU either way.
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.policy.parity import sample_sequences
from moe_rl.testing import run_ranks


def _step(layout_name: str, hf_dir: str, sequences: list[torch.Tensor], guard: bool) -> dict:
    from moe_rl.dist.devices import compute_device

    installed = None
    if guard:
        from moe_rl.dist.device_guard import install_device_guard

        installed = install_device_guard()  # first, as the trainer does: the model is built under it
    from moe_rl.drift.metrics import route_stats
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    policy = Policy(PolicySpec(hf_dir=hf_dir, layout=ParallelLayout.parse(layout_name),
                               optim=OptimConfig(lr=1e-3), micro_batch_size=2))
    mine = sequences[policy.dp_rank::policy.dp_size]
    old = policy.logprobs(mine, record_routes=True, entropy=True)

    def loss(logp, mb):
        kept = (logp * mb.loss_mask).sum()
        return -kept / 100.0, {"logp_sum": kept.detach()}

    update = policy.update(mine, {}, loss, replay_routes=old.routes)
    new = policy.logprobs(mine, record_routes=True)
    counts = policy.all_reduce_sum(torch.tensor([float(len(mine)), float(old.mask.sum())], dtype=torch.float64))
    top = policy.all_reduce_max(old.logp.min().view(1).double(), group="world")
    keep = old.mask.bool()
    drift = route_stats(old.routes[keep], new.routes[keep]).all_reduce(policy.dp_group).summary()
    return {"device": str(compute_device()), "logp": old.logp, "entropy": old.entropy, "routes": old.routes,
            "microbatches": update.microbatches, "step": update.step, "logp_after": new.logp,
            "counts": counts, "top": top, "drift": drift,
            "checked": dict(installed.calls) if installed is not None else {}}


@pytest.mark.parametrize("layout", ["ep2", "pp2"])
def test_policy_step_under_device_guard_matches_unguarded(layout, tiny_hf_dir):
    sequences = sample_sequences(vocab_size=128, num=6, max_len=14, seed=3)
    plain = run_ranks(_step, 2, layout, str(tiny_hf_dir), sequences, guard=False, timeout=600)
    guarded = run_ranks(_step, 2, layout, str(tiny_hf_dir), sequences, guard=True, timeout=600)
    for p, g in zip(plain, guarded):
        assert p["device"] == "cpu" and g["device"] == "cuda:0"
        for key in ("logp", "entropy", "routes", "logp_after", "counts", "top"):
            assert torch.equal(p[key], g[key]), key
        assert p["microbatches"] == g["microbatches"] and p["step"] == g["step"] and p["drift"] == g["drift"]
        assert p["counts"][0] == len(sequences)
    # the guard did check moe_rl's collectives on each rank: routes, entropy, shapes, loop reductions
    for g in guarded:
        checked = g["checked"]
        for call in ("all_reduce from moe_rl.policy.replay", "all_reduce from moe_rl.policy.forward",
                     "all_reduce from moe_rl.policy.policy", "all_reduce from moe_rl.drift.metrics"):
            assert checked.get(call, 0) > 0, (call, checked)
        if layout == "pp2":
            assert checked.get("broadcast from moe_rl.policy.forward", 0) > 0, checked
