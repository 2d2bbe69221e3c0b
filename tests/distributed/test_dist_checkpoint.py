"""A megatron distributed checkpoint of the policy (`Policy.save_sharded`) loads under another layout
and world size (`Policy.load_sharded`), with nothing changed.

A 2-rank EP2 run with the distributed optimizer trains one update and saves. Runs of other layouts
(one rank; TP2 on two) load it, and every number comes back exactly: the weights and, in model
space, the Adam moments and fp32 main parameters, each gathered to HF names and full shapes by
the project's exporter (`iter_hf_tensors`), compared with `torch.equal` against what the saving
run held; the Adam step and the LR schedule's step too. A fresh policy differs from the saved
one, so the comparison would catch a load that did nothing.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_rl.policy.parity import sample_sequences
from moe_rl.testing import run_ranks

STATES = ("exp_avg", "exp_avg_sq", "main_param")


def _policy(layout: str, hf_dir: str) -> Any:
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    optim = OptimConfig(lr=1e-3, total_steps=4, distributed_optimizer=True)
    return Policy(PolicySpec(hf_dir=hf_dir, layout=ParallelLayout.parse(layout), optim=optim, micro_batch_size=2))


def _model_space(policy: Any) -> dict[str, dict[Any, torch.Tensor]]:
    """Per model parameter (this rank's TP/EP slice, whole over DP): Adam moments and fp32 main
    parameter, read from the optimizer itself (megatron's DP gather), not from a checkpoint."""
    from moe_rl.policy.train_step import sub_optimizers

    out: dict[str, dict[Any, torch.Tensor]] = {k: {} for k in STATES}
    for opt in sub_optimizers(policy.opt.optimizer):
        world = opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        for index, buffer in enumerate(opt.buffers):
            ((_, whole),) = world[index].items()
            for p, (start, end, _) in buffer.param_index_map.items():
                for key, name in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("main_param", "param")):
                    out[key][p] = whole[name][start:end].reshape(p.shape).clone()
    return out


@torch.no_grad()
def _hf_view(policy: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Weights and optimizer state as full HF-named tensors: each state is swapped into its
    parameter's `.data` and gathered as the weights are (TP/EP/PP shards joined)."""
    from moe_rl.policy.convert import iter_hf_tensors

    space = _model_space(policy)
    params = [p for c in policy.chunks for p in c.parameters()]
    out = {"weights": {n: t.clone() for n, t in policy.hf_tensors()}}
    for key in STATES:
        kept = [p.data for p in params]
        try:
            for p in params:
                p.data = space[key][p]
            out[key] = {n: t.clone() for n, t in iter_hf_tensors(policy.chunks, policy.arch)}
        finally:
            for p, data in zip(params, kept):
                p.data = data
    return out


def _steps(policy: Any) -> tuple[list[float], int]:
    from moe_rl.policy.train_step import sub_optimizers

    steps = {float(s["step"]) for o in sub_optimizers(policy.opt.optimizer) for s in o.optimizer.state.values()}
    return sorted(steps), policy.opt.scheduler.num_steps


def _save(hf_dir: str, ckpt: str, batch: list[torch.Tensor]) -> dict:
    policy = _policy("ep2", hf_dir)

    def loss(logp, mb):
        return -(logp.float() * mb.loss_mask).sum() / 100.0, {}

    policy.update(batch[policy.dp_rank::policy.dp_size], {}, loss)
    view, steps = _hf_view(policy), _steps(policy)
    policy.save_sharded(ckpt)
    return {"view": view, "steps": steps}


def _load(layout: str, hf_dir: str, ckpt: str) -> dict:
    policy = _policy(layout, hf_dir)
    fresh = {n: t.clone() for n, t in policy.hf_tensors()}
    policy.load_sharded(ckpt)
    return {"fresh": fresh, "view": _hf_view(policy), "steps": _steps(policy)}


def _merged(results: list[dict], key: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's HF tensors of one job in one dict (each name comes from the rank that holds it)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for r in results:
        for part, tensors in r[key].items():
            out.setdefault(part, {}).update(tensors)
    return out


@pytest.fixture(scope="module")
def saved(tiny_hf_dir, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dist_ckpt") / "policy")
    batch = sample_sequences(64, num=4, max_len=10, seed=0)
    results = run_ranks(_save, 2, str(tiny_hf_dir), ckpt, batch, timeout=300)
    return ckpt, _merged(results, "view"), results[0]["steps"]


@pytest.mark.parametrize("layout,world", [("single", 1), ("tp2", 2)])
def test_an_ep2_checkpoint_loads_exactly_under_another_layout(saved, tiny_hf_dir, layout, world):
    ckpt, want, steps = saved
    results = run_ranks(_load, world, layout, str(tiny_hf_dir), ckpt, timeout=300)
    got = _merged(results, "view")
    fresh = {n: t for r in results for n, t in r["fresh"].items()}
    assert any(not torch.equal(fresh[n], want["weights"][n]) for n in want["weights"])  # the load had work to do
    for part in ("weights", *STATES):
        assert set(got[part]) == set(want[part]), part
        unequal = [n for n in want[part] if not torch.equal(got[part][n], want[part][n])]
        assert not unequal, f"{part}: {unequal[:5]}"
    assert all(r["steps"] == steps for r in results) and steps == ([1.0], 1)
