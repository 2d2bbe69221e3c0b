"""The first update's pi_old is its own forward: the old pass skips those rows and the step is unchanged.

Before its optimizer step, the first minibatch update runs the very weights the old-log-prob pass
would, on the same rows (no dropout, no router noise: moe_rl refuses both), so where pi_old is all the
pass is for (behaviour=recompute, no replay, no route mask, no drift on the step's tokens) the pass
runs only over the later minibatches' rows (`recipes/rl/step.py: old_pass_after_first`). The
reference is the full pass of the same real megatron policy in the same layout: the 12 sequences of
moe_rl/testing/minibatches.py in three GSPO minibatches through `minibatch_updates`, on one
process and on two data-parallel ranks (each rank's pass skips its own first-update rows).

Tolerances: the first update's forward pads its rows to its own widest sequence, the pass to the
widest of all, so the two round differently (~1e-7 in a log-prob; on one process here the widths
coincide and the steps are equal). Grad norms agree to 1e-5 relative; Adam's first steps magnify
rounding in near-zero gradients, so each tensor's update after three steps agrees to 1e-3 of its
norm (the bound of tests/distributed/test_replay_updates.py).
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.testing import run_ranks
from moe_rl.testing.minibatches import hf_weights, update_errors

LR, CLIP = 3e-3, 0.5


def three_updates(hf_dir: str, out_dir: str, layout: str, skip: bool) -> dict:
    """This rank's old pass (rows it was given) and three minibatch updates; exports the weights."""
    from moe_rl.config import load_config
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig
    from moe_rl.samples import Samples
    from moe_rl.recipes.rl.batch import my_share
    from moe_rl.recipes.rl.run import Run
    from moe_rl.recipes.rl.step import minibatch_updates
    from moe_rl.recipes.rl.old_pass import old_logprobs
    from moe_rl.testing.minibatches import gspo_batch

    seqs, plens, adv, _ = gspo_batch()
    policy = Policy(PolicySpec(hf_dir, ParallelLayout.parse(layout), OptimConfig(lr=LR, grad_clip=CLIP),
                               micro_batch_size=2))
    cfg = load_config(None, ["algo.loss=gspo", "algo.replay=off", "algo.tis_cap=null", "algo.num_minibatches=3",
                             "algo.eps_low=0.2", "algo.eps_high=0.2", "drift.enabled=false",
                             "algo.shuffle_minibatches=false", "data.prompts_per_step=3", "rollout.n_samples=4"])
    run = Run(cfg=cfg, policy=policy, dataset=None, sampler=None, rewards=None, engine=None, weight_sync=None,
              eos_id=2)
    n = len(seqs)
    samples = Samples(prompts=list(range(n)), sequences=seqs, prompt_lens=torch.tensor(plens),
                      engine_logp=[torch.zeros(s.shape[0] - p) for s, p in zip(seqs, plens)], routes=None,
                      completions=[""] * n, rewards=(adv > 0).float(), advantages=adv)
    share = my_share(run, samples, step=1)
    passed: list[int] = []
    real = policy.logprobs

    def logprobs(sequences, **kw):
        passed.append(len(sequences))
        return real(sequences, **kw)

    policy.logprobs = logprobs
    old = old_logprobs(run, share.samples, 1, share.minibatches[0] if skip else None)
    metrics = minibatch_updates(run, share, old)
    policy.export_hf(out_dir)
    return {"passed": passed, "rows": len(share.samples), "first": len(share.minibatches[0]),
            "grad_norm": metrics["perf/grad_norm"]}


@pytest.mark.parametrize("layout,ranks", [("single", 1), ("dp2", 2)])
def test_the_old_pass_skips_the_first_updates_rows_and_the_updates_stay_the_same(layout, ranks, tiny_hf_dir,
                                                                                 tmp_path):
    full = run_ranks(three_updates, ranks, str(tiny_hf_dir), str(tmp_path / "full"), layout, False, timeout=600)
    skip = run_ranks(three_updates, ranks, str(tiny_hf_dir), str(tmp_path / "skip"), layout, True, timeout=600)
    for ref, r in zip(full, skip):
        assert ref["passed"] == [ref["rows"]]  # the reference: one pass over every row of this rank
        assert r["passed"] == [r["rows"] - r["first"]]  # only the second and third minibatches' rows
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    errors = update_errors(hf_weights(tmp_path / "skip"), hf_weights(tmp_path / "full"), hf_weights(tiny_hf_dir))
    for name, err in errors.items():
        assert err <= 1e-3, f"{layout} {name}: the update differs from the full pass's by {err:.2e} of its norm"
