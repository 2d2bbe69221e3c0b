"""A step's minibatch updates equal plain torch on the HF model: AdamW, clipping, GSPO.

The reference is written here from the definitions alone: HF transformers' model in
fp32, `torch.optim.AdamW` (eps 1e-8, bias correction, no weight decay), the gradient
clipped to a global norm with `torch.nn.utils.clip_grad_norm_` before each step, and
GSPO as TRL's GRPOTrainer defines it with `importance_sampling_level="sequence"` and
`loss_type="grpo"`: per sequence s = exp(mean of the token log-ratios), loss
-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A), mean over the minibatch's sequences.
moe_rl runs the same minibatches through `Policy.update` (megatron DDP and optimizer,
fp32 main parameters, gradient accumulation over micro-batches, global normalisers)
with `moe_rl.algo.losses.compute_loss("gspo")`.

The sequences hold the pad id as an input token, as a sampled completion can (a
`<pad>` then a digit): HF's embedding never trains that row (`padding_idx`), and a
HF-initialised model holds it at zero, where RMSNorm's gradient is 1/sqrt(eps).

Tolerances (fp32, reductions in another order): gradient norms agree to 1e-4 relative;
after three steps each tensor's update differs from the reference's by at most 1e-3 of
the reference update's norm (Adam divides by sqrt(v), so entries whose gradients sit near
rounding level carry that rounding into their update; measured: <= 3.5e-4, routers).
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.testing import run_ranks
from moe_rl.testing.minibatches import PAD, completion_mask, gspo_batch, hf_weights, update_errors

LR, CLIP, EPS = 3e-3, 0.5, (0.2, 0.2)


def moe_rl_updates(hf_dir: str, out_dir: str) -> dict:
    """One rank: the minibatches' updates through `Policy.update`; exports the weights after."""
    from moe_rl.algo.losses import compute_loss
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    seqs, plens, adv, minibatches = gspo_batch()
    policy = Policy(PolicySpec(hf_dir, ParallelLayout(), OptimConfig(lr=LR, grad_clip=CLIP), micro_batch_size=2))
    old = policy.logprobs(seqs).logp
    mask = completion_mask(seqs, plens, old.shape[1])
    norms = []
    for idx in minibatches:
        n_seqs = float(len(idx))

        def loss(logp, mb):
            valid = (mb.index >= 0).float().unsqueeze(1)
            ex = mb.extras
            return compute_loss("gspo", logp=logp, old_logp=ex["old"], advantages=ex["adv"], mask=ex["mask"] * valid,
                                global_num_seqs=n_seqs, eps_low=EPS[0], eps_high=EPS[1])

        out = policy.update([seqs[i] for i in idx], {"old": old[idx], "adv": adv[idx], "mask": mask[idx]}, loss)
        norms.append(out.step["perf/grad_norm"])
    policy.export_hf(out_dir)
    return {"norms": norms}


def reference_updates(hf_dir: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same minibatches in plain torch on HF's model; returns its weights and gradient norms."""
    from transformers import AutoModelForCausalLM

    seqs, plens, adv, minibatches = gspo_batch()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def logp(rows: list[int]) -> torch.Tensor:
        out = []
        for i in rows:  # one sequence at a time: no padding on this side
            logits = model(seqs[i].unsqueeze(0)).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, seqs[i][1:, None]).squeeze(-1)
            out.append(torch.nn.functional.pad(lp, (0, width - lp.shape[0])))
        return torch.stack(out)

    width = max(s.shape[0] for s in seqs) - 1
    mask = completion_mask(seqs, plens, width)
    with torch.no_grad():
        old = logp(list(range(len(seqs))))
    norms = []
    for idx in minibatches:
        m = mask[idx]
        s = torch.exp(((logp(idx) - old[idx]) * m).sum(-1) / m.sum(-1))
        a = adv[idx]
        loss = -torch.minimum(s * a, s.clamp(1 - EPS[0], 1 + EPS[1]) * a).mean()
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


@pytest.fixture(scope="module")
def runs(tiny_hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("updated")
    (ours,) = run_ranks(moe_rl_updates, 1, str(tiny_hf_dir), str(out), timeout=600)
    ref, ref_norms = reference_updates(str(tiny_hf_dir))
    return ours, ref, ref_norms, out


def test_batch_feeds_the_pad_token(tiny_hf_dir):
    """The case the test is about: the checkpoint's pad row is zero and the batch feeds it."""
    import json

    from safetensors.torch import load_file

    assert json.loads((tiny_hf_dir / "config.json").read_text())["pad_token_id"] == PAD
    weights = {}
    for f in tiny_hf_dir.glob("*.safetensors"):
        weights |= load_file(f)
    assert float(weights["model.embed_tokens.weight"][PAD].abs().max()) == 0.0
    seqs, plens, adv, _ = gspo_batch()
    fed = [i for i, (s, p) in enumerate(zip(seqs, plens)) if PAD in s[p:-1].tolist()]
    assert fed and all(adv[i] != 0 for i in fed)


def test_gradient_norms_match_the_reference(runs):
    ours, _, ref_norms, _ = runs
    assert ours["norms"] == pytest.approx(ref_norms, rel=1e-4)
    assert max(ref_norms) > CLIP  # clipping is exercised


def test_updates_match_plain_torch_adamw(runs, tiny_hf_dir):
    _, ref, _, out = runs
    got, start = hf_weights(out), hf_weights(tiny_hf_dir)
    assert sorted(got) == sorted(ref)
    for n, err in update_errors(got, ref, start).items():
        assert err <= 1e-3, f"{n}: update differs from plain torch by {err:.2e} of its norm"
    assert torch.equal(got["model.embed_tokens.weight"][PAD], start["model.embed_tokens.weight"][PAD])
