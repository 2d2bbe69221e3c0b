"""Checkpoints with megatron's distributed optimizer hold the whole optimizer state, on 2 gloo ranks.

A run saves `Policy.state_dict()` before its first update (and loads it back), trains two
updates, saves, and trains a third. A fresh run (new processes, as a resume is) first trains
the first update without the pre-step round trip: the weights must equal the first run's
bit for bit, so saving and loading before any step changes nothing. It then loads the
checkpoint and trains the third update: the weights must equal the first run's (≤ 1e-6,
in practice bit-identical). The old checkpoint content, megatron's `state_dict()` alone
(without the parameter state: Adam moments, main parameters), is loaded too and must give
other weights, which shows the test would catch a checkpoint that drops that state; `Policy`
refuses to load such a checkpoint with a message naming `train.distributed_optimizer`.

dp2 has one distributed optimizer; ep2 chains two (dense over dp 2, experts over expert-dp 1),
in bf16, where the fp32 main parameters live only in the optimizer.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_rl.policy.parity import sample_sequences
from moe_rl.testing import run_ranks

LAYOUTS = [("dp2", "fp32"), ("ep2", "bf16")]


def _policy(layout: str, hf_dir: str, dtype: str) -> Any:
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    optim = OptimConfig(lr=1e-3, total_steps=3, distributed_optimizer=True)
    return Policy(PolicySpec(hf_dir=hf_dir, layout=ParallelLayout.parse(layout), optim=optim, dtype=dtype,
                             micro_batch_size=2))


def _update(policy: Any, batch: list[torch.Tensor]) -> None:
    def loss(logp, mb):
        return -(logp.float() * mb.loss_mask).sum() / 100.0, {}

    policy.update(batch[policy.dp_rank::policy.dp_size], {}, loss)


def _weights(policy: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters (its own shards: runs of the same layout compare rank by rank)."""
    return {n: p.detach().clone() for i, c in enumerate(policy.chunks) for n, p in c.named_parameters(prefix=str(i))}


def _round_trip(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _moments(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every exp_avg / exp_avg_sq tensor in a distributed-optimizer state of `Policy.state_dict()`."""
    opt = state["optimizer"]
    out = []
    for sub in opt if isinstance(opt, list) else [opt]:
        for key, per_dtype in sub["param_state"].items():
            if isinstance(key, int):
                out += [t[k] for buckets in per_dtype.values() for bucket in buckets for t in bucket
                        for k in ("exp_avg", "exp_avg_sq")]
    return out


def _first_run(layout: str, hf_dir: str, dtype: str, batches: list[list[torch.Tensor]], ckpt: str) -> dict:
    import torch.distributed as dist

    policy = _policy(layout, hf_dir, dtype)
    before = _round_trip(policy.state_dict())  # before any optimizer step
    moments = _moments(before)
    policy.load_state_dict(before)
    _update(policy, batches[0])
    w1 = _weights(policy)
    _update(policy, batches[1])
    torch.save(policy.state_dict(), Path(ckpt) / f"rank_{dist.get_rank():05d}.pt")
    _update(policy, batches[2])
    return {"w1": w1, "w3": _weights(policy), "num_moments": len(moments),
            "pre_step_moments_zero": all(not t.any() for t in moments)}


def _resumed_run(layout: str, hf_dir: str, dtype: str, batches: list[list[torch.Tensor]], ckpt: str) -> dict:
    import torch.distributed as dist

    policy = _policy(layout, hf_dir, dtype)
    _update(policy, batches[0])
    w1 = _weights(policy)
    saved = torch.load(Path(ckpt) / f"rank_{dist.get_rank():05d}.pt", weights_only=False)

    # What the checkpoint held before: megatron's state_dict() without the parameter state.
    opt = saved["optimizer"]
    old = [{k: v for k, v in s.items() if not k.startswith("param_state")} for s in
           (opt if isinstance(opt, list) else [opt])]
    try:  # Policy refuses it: resuming from it would silently restart Adam
        policy.load_state_dict({**saved, "optimizer": old if isinstance(opt, list) else old[0]})
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    for chunk, sd in zip(policy.opt.chunks, saved["model"]):
        chunk.load_state_dict(sd)
    policy.opt.optimizer.load_state_dict(old if isinstance(opt, list) else old[0])
    policy.opt.scheduler.load_state_dict(saved["scheduler"])
    _update(policy, batches[2])
    w3_old = _weights(policy)

    policy.load_state_dict(saved)
    _update(policy, batches[2])
    return {"w1": w1, "w3": _weights(policy), "w3_old": w3_old, "refused": refused}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


@pytest.mark.parametrize("layout,dtype", LAYOUTS)
def test_distributed_optimizer_checkpoint_resumes_exactly(layout, dtype, tiny_hf_dir, tmp_path):
    sequences = sample_sequences(vocab_size=128, num=12, max_len=12, seed=5)
    batches = [sequences[0:4], sequences[4:8], sequences[8:12]]
    first = run_ranks(_first_run, 2, layout, str(tiny_hf_dir), dtype, batches, str(tmp_path), timeout=600)
    resumed = run_ranks(_resumed_run, 2, layout, str(tiny_hf_dir), dtype, batches, str(tmp_path), timeout=600)
    for rank, (a, b) in enumerate(zip(first, resumed)):
        assert a["num_moments"] > 0 and a["pre_step_moments_zero"], rank
        assert _max_diff(a["w1"], b["w1"]) == 0.0, f"rank {rank}: a pre-step save/load changed the first update"
        diff = _max_diff(a["w3"], b["w3"])
        assert diff <= 1e-6, f"rank {rank}: resumed third update differs from the uninterrupted one by {diff:.2e}"
        old = _max_diff(a["w3"], b["w3_old"])
        assert old > 1e-5, f"rank {rank}: without the parameter state the third update still matched ({old:.2e})"
        assert "train.distributed_optimizer" in b["refused"], b["refused"]
