"""DPO under parallel layouts vs one process, on gloo ranks: the summed (chosen, rejected)
log-probs of every pair (≤ 1e-4) and the gradient of the step's DPO loss, padded and packed
(relative error ≤ 1e-4 per parameter), with chosen and rejected always in one micro-batch.

DP2 and EP2 (dense weights data parallel, experts split) each run padded micro-batches
(contiguous pair blocks per DP rank) and packed rows (pairs spread over DP ranks by tokens,
a pair's two sequences in one row); the gradient uses the global pair count, so every split
must give the single process's gradient.
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.testing import run_ranks
from moe_rl.testing.dpo_worker import dpo_layout_worker, random_pairs

PACK_TOKENS = 40  # a few pairs (6..28 tokens each) per packed row


@pytest.fixture(scope="module")
def pairs():
    return random_pairs(vocab_size=128, num=10, seed=2)


@pytest.fixture(scope="module")
def ref(pairs):
    g = torch.Generator().manual_seed(5)
    return -20 + 4 * torch.rand(len(pairs), 2, generator=g)  # reference log-probs: any fixed values


@pytest.fixture(scope="module")
def single(tiny_hf_dir, pairs, ref):
    (res,) = run_ranks(dpo_layout_worker, 1, "single", str(tiny_hf_dir), pairs, ref)
    return res


def test_single_process_summed_logprobs_match_a_plain_sum(single, pairs, tiny_hf_dir):
    from moe_rl.policy.parity import hf_logprobs

    for i, p in enumerate(pairs):
        chosen, rejected = p.sequences()
        tok = hf_logprobs(tiny_hf_dir, [chosen, rejected])
        n = len(p.prompt_ids) - 1  # positions from P - 1 on predict the response
        expect = torch.tensor([float(tok[0][n:].sum()), float(tok[1][n:].sum())], dtype=torch.float64)
        assert torch.allclose(single["logps"][i], expect, atol=1e-4), i


@pytest.mark.parametrize("layout", ["dp2", "ep2"])
def test_layout_matches_single_process(layout, tiny_hf_dir, pairs, ref, single):
    results = run_ranks(dpo_layout_worker, 2, layout, str(tiny_hf_dir), pairs, ref, pack_tokens=PACK_TOKENS,
                        timeout=600)
    for r in results:
        assert r["whole_pairs"], f"{layout}: a micro-batch split a pair"
        diff = (r["logps"] - single["logps"]).abs().max().item()
        assert diff <= 1e-4, f"{layout}: summed log-probs differ by {diff:.2e}"
    for key in ("grads", "grads_packed"):
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            for name, g in r[key].items():
                grads.setdefault(name, g)  # dense weights: every DP rank holds the same reduced copy
        assert sorted(grads) == sorted(single["grads"])
        for name, want in single["grads"].items():
            err = (grads[name] - want).norm() / want.norm().clamp_min(1e-12)
            assert err <= 1e-4, f"{layout} {key}: {name} relative gradient error {err:.2e}"
