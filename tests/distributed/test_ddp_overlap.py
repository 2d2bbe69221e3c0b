"""DDP's communication overlap gives the update it overlaps, on 2 gloo ranks.

`parallel.overlap_grad_reduce` reduces each gradient bucket as the backward pass completes it
(the schedule holds the reduction back until the last micro-batch), `parallel.overlap_param_gather`
moves the distributed optimizer's gather of updated parameters into the next forward's pre-hooks.
Both are on by default on GPUs; here a run with both on must match one with both off: the weights
after every update (read by a forward, by the HF export that feeds the weight sync, and by a
checkpoint) within float tolerance (1e-6), over 3 updates of 2 micro-batches each. dp2 has one
distributed optimizer; ep2 chains the dense one (dp 2) with the experts' (expert-dp 1).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_rl.policy.parity import sample_sequences
from moe_rl.testing import run_ranks


def _policy(layout: str, hf_dir: str, overlap: bool) -> Any:
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.perf import PerfRequest
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    optim = OptimConfig(lr=1e-3, total_steps=3, distributed_optimizer=True)
    perf = PerfRequest(overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    return Policy(PolicySpec(hf_dir=hf_dir, layout=ParallelLayout.parse(layout), optim=optim, micro_batch_size=2,
                             perf=perf))


def _train(layout: str, hf_dir: str, overlap: bool) -> dict[str, Any]:
    policy = _policy(layout, hf_dir, overlap)
    c = policy.opt.chunks[0]
    assert c.ddp_config.overlap_grad_reduce is overlap and c.ddp_config.overlap_param_gather is overlap
    assert (c.module.config.no_sync_func is not None) is overlap
    batch = sample_sequences(policy.arch.vocab_size, num=8, max_len=12, seed=3)
    mine = batch[policy.dp_rank::policy.dp_size]  # 4 sequences: 2 micro-batches of 2

    def loss(logp, mb):
        return -(logp.float() * mb.loss_mask).sum() / 60.0, {}

    out: dict[str, Any] = {"logp": [], "export": [], "norms": []}
    for _ in range(3):
        res = policy.update(mine, {}, loss)
        out["norms"].append(res.step["perf/grad_norm"])
        out["export"].append({n: t.clone() for n, t in policy.hf_tensors()})     # the weight sync reads them,
        out["logp"].append(policy.logprobs(mine).logp.clone())                  # before any forward does
    out["state"] = {k: v.clone() for k, v in policy.state_dict()["model"][0].items() if torch.is_tensor(v)}
    return out


def _both(layout: str, hf_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _train(layout, hf_dir, False), _train(layout, hf_dir, True)


@pytest.mark.parametrize("layout", ["dp2", "ep2"])
def test_overlapped_grad_reduce_and_param_gather_give_the_same_updates(tiny_hf_dir, layout):
    for plain, overlapped in run_ranks(_both, 2, layout, str(tiny_hf_dir), timeout=600):
        assert plain["norms"] == pytest.approx(overlapped["norms"], rel=1e-6)
        for a, b in zip(plain["logp"], overlapped["logp"]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        for a, b in zip(plain["export"], overlapped["export"]):
            assert a.keys() == b.keys()
            for name in a:
                torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
        for name in plain["state"]:
            torch.testing.assert_close(overlapped["state"][name], plain["state"][name], rtol=0, atol=1e-6, msg=name)
