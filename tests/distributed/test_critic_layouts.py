"""The critic (value head on the policy's megatron network) under parallel layouts, on gloo ranks.

Values of each layout equal the single-process values (<= 1e-5 absolute, fp32, values of
order 1), padded and packed; replaying the critic's own recorded routes reproduces them; and
one backward's gradients (trunk and value head) equal the single-process ones (relative
error <= 1e-4 per tensor).
"""
from __future__ import annotations

import pytest

from moe_rl.policy.parity import sample_sequences
from moe_rl.testing import run_ranks
from moe_rl.testing.critic_worker import critic_worker

# tp2-ep2 splits the value head's trunk over tensor and expert parallel ranks at once: tp2 and ep2
# alone would add two runs and no split it does not make (suite time).
LAYOUTS = ["dp2", "pp2", "pp2-vpp2", "tp2-ep2"]
GRAD_LAYOUTS = {"dp2", "pp2", "pp2-vpp2", "tp2-ep2"}
PACK_TOKENS = 40


@pytest.fixture(scope="module")
def sequences():
    return sample_sequences(vocab_size=128, num=8, max_len=20, seed=1)


@pytest.fixture(scope="module")
def single(tiny_hf_dir, sequences):
    (res,) = run_ranks(critic_worker, 1, "single", str(tiny_hf_dir), sequences, grads=True)
    return res


def _by_sequence(results, index_key, values_key):
    out = {}
    for r in results:
        for j, i in enumerate(r[index_key]):
            out[i] = r[values_key][j]
    return out


def test_single_process_values_are_not_trivial(single, sequences):
    assert single["values"].abs().max() > 0.1  # a non-zero head: values depend on the trunk
    assert single["replay_max_diff"] <= 1e-5
    assert single["grads"]["value_head"].norm() > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_critic_layout_values_and_grads(layout, tiny_hf_dir, sequences, single):
    from moe_rl.policy.parallel import ParallelLayout

    world = ParallelLayout.parse(layout).world_size
    results = run_ranks(critic_worker, world, layout, str(tiny_hf_dir), sequences, grads=layout in GRAD_LAYOUTS,
                        pack_tokens=PACK_TOKENS, timeout=600)
    for key, index in (("values", "index"), ("values_packed", "packed_index")):
        got = _by_sequence(results, index, key)
        assert sorted(got) == list(range(len(sequences)))
        for i, seq in enumerate(sequences):
            n = len(seq) - 1
            err = float((got[i][:n] - single["values"][i, :n]).abs().max())
            assert err <= 1e-5, f"{layout} {key}: sequence {i} max |ΔV| = {err:.2e}"
            assert (got[i][n:] == 0).all()
    assert max(r["replay_max_diff"] for r in results) <= 1e-5
    if layout in GRAD_LAYOUTS:
        grads = {}
        for r in results:
            for name, g in r["grads"].items():
                assert name not in grads, f"{name} returned by two ranks"
                grads[name] = g
        assert sorted(grads) == sorted(single["grads"])
        for name, ref in single["grads"].items():
            err = (grads[name] - ref).norm() / ref.norm().clamp_min(1e-12)
            assert err <= 1e-4, f"{layout}: {name} relative gradient error {err:.2e}"
