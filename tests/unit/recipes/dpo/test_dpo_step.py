"""moe_rl.recipes.dpo.step without megatron: the reference cache (computed once, reused, invalidated), the
summed response log-probs it stores, and micro-batches that keep pairs together."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from moe_rl.config import RunConfig
from moe_rl.data.preference import PreferenceDataset, PreferencePair
from moe_rl.policy.forward import make_microbatches, make_packed_microbatches
from moe_rl.recipes.dpo.step import REF_CACHE, reference_logps


class FakePolicy:
    """Per-token log-prob of token x at position t: -x / 10 - t / 100; counts passes and weight loads."""

    dp_size, dp_rank = 1, 0

    def __init__(self):
        self.passes, self.loaded = 0, []

    def logprobs(self, seqs):
        self.passes += 1
        width = max(len(s) for s in seqs) - 1
        logp = torch.zeros(len(seqs), width)
        for i, s in enumerate(seqs):
            logp[i, : len(s) - 1] = -s[1:].float() / 10 - torch.arange(len(s) - 1) / 100
        return SimpleNamespace(logp=logp)

    def all_reduce_sum(self, t):
        return t

    def load_hf_weights(self, path):
        self.loaded.append(str(path))


def plain_sum(prompt, response):
    p = len(prompt)
    return sum(-x / 10 - (p - 1 + j) / 100 for j, x in enumerate(response))


PAIRS = [PreferencePair("a", [1, 2], [3, 4, 5], [6]), PreferencePair("b", [1], [7], [8, 9]),
         PreferencePair("c", [1, 5, 5], [2], [3])]


def _setup(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text("{}")
    (ref / "model.safetensors").write_bytes(b"weights")
    return ref, PreferenceDataset(PAIRS[:2], "train", None), PreferenceDataset(PAIRS[2:], "eval", None)


def test_reference_is_computed_once_then_read_from_the_cache(tmp_path):
    ref, train, evals = _setup(tmp_path)
    policy = FakePolicy()
    t, e = reference_logps(RunConfig(), policy, tmp_path, ref, train, evals)
    assert policy.passes == 1 and (tmp_path / REF_CACHE).is_file()
    for got, p in zip(list(t) + list(e), PAIRS):
        want = torch.tensor([plain_sum(p.prompt_ids, p.chosen_ids), plain_sum(p.prompt_ids, p.rejected_ids)])
        assert torch.allclose(got, want, atol=1e-6)
    again = FakePolicy()  # a resumed run: a fresh process, same data and reference
    t2, e2 = reference_logps(RunConfig(), again, tmp_path, ref, train, evals)
    assert again.passes == 0 and torch.equal(t2, t) and torch.equal(e2, e)


def test_cache_is_invalidated_by_other_data_or_another_reference(tmp_path):
    ref, train, evals = _setup(tmp_path)
    reference_logps(RunConfig(), FakePolicy(), tmp_path, ref, train, evals)
    changed = FakePolicy()
    reference_logps(RunConfig(), changed, tmp_path, ref, PreferenceDataset(PAIRS[:1], "train", None), evals)
    assert changed.passes == 1
    (ref / "model.safetensors").write_bytes(b"other weights")
    changed = FakePolicy()
    reference_logps(RunConfig(), changed, tmp_path, ref, PreferenceDataset(PAIRS[:1], "train", None), evals)
    assert changed.passes == 1


def test_ref_path_is_loaded_for_the_pass_and_the_policy_restored(tmp_path):
    ref, train, _ = _setup(tmp_path)
    other = tmp_path / "other_ref"
    other.mkdir()
    (other / "config.json").write_text('{"other": 1}')
    cfg = RunConfig()
    cfg.dpo.ref_path = str(other)
    policy = FakePolicy()
    _, e = reference_logps(cfg, policy, tmp_path, ref, train, None)
    assert e is None and policy.loaded == [str(other), str(ref)]


def test_micro_batches_keep_pairs_together():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 10, (int(n),), generator=g) for n in torch.randint(2, 12, (14,), generator=g)]
    for mbs in (make_packed_microbatches(seqs, 24, group_size=2), make_microbatches(seqs, 4)):
        seen = []
        for mb in mbs:
            rows = mb.index[mb.index >= 0].tolist()
            assert all(rows[j] % 2 == 0 and rows[j + 1] == rows[j] + 1 for j in range(0, len(rows), 2)), rows
            seen += rows
        assert sorted(seen) == list(range(14))
