"""Weight-version labels around an in-place push, as SGLang 0.5.23 gives them: with its overlap scheduler (the
default) the token sampled last before an in-place pause is still in flight, uncounted by the push's version
event, and lands in the new version's span; --disable-overlap-schedule and retract pauses are exact."""
from __future__ import annotations

import json

import pytest

from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.local_engine import LocalEngine

N = 12


class _PushAt:
    """Hooks that run a push (pause `mode`, load, continue) in the engine's thread when sample 0 has `k`
    tokens: the pause lands after the forward that sampled token k, before the next one is launched."""

    def __init__(self, engine, k, mode, weights):
        self.engine, self.k, self.mode, self.weights, self.done = engine, k, mode, weights, False

    def aborted(self, sample):
        return False

    def progress(self, sample, result):
        if not self.done and len(result.output_ids) == self.k:
            self.done = True
            self.engine.pause_generation(self.mode)
            self.engine.update_weights_from_tensors(self.weights, version="2")
            self.engine.continue_generation()


def _spans(tiny_hf_dir, k, mode, overlap):
    eng = LocalEngine(tiny_hf_dir, weight_version="1", overlap_labels=overlap)
    try:
        weights = [(n, p.detach().clone()) for n, p in eng.model.named_parameters()]  # same values, a new label
        hooks = _PushAt(eng, k, mode, weights)
        (res,), = eng.generate([GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=N, ignore_eos=True, seed=0),
                                                hooks=hooks)])
    finally:
        eng.close()
    assert hooks.done
    return [tuple(s) for s in res.weight_versions]


@pytest.mark.parametrize("k", [1, 5])
def test_the_token_in_flight_at_an_in_place_pause_takes_the_new_version(tiny_hf_dir, k):
    # by hand: tokens 1..k-1 were processed before the pause (version 1); token k, sampled by the old
    # weights, was in flight and is counted after the push (version 2). k = 1: the prefill's token, no event
    want = ([("1", 0, k - 1)] if k > 1 else []) + [("2", k - 1, N)]
    assert _spans(tiny_hf_dir, k, "in_place", overlap=True) == want


@pytest.mark.parametrize("mode, overlap", [("in_place", False), ("retract", True), ("retract", False)])
def test_exact_labels_without_the_overlap_schedule_or_after_a_retract(tiny_hf_dir, mode, overlap):
    assert _spans(tiny_hf_dir, 5, mode, overlap) == [("1", 0, 5), ("2", 5, N)]


def test_server_info_reports_the_schedule(tiny_hf_dir):
    import urllib.request

    from moe_rl.rollout.server import ServerThread

    for overlap in (True, False):
        eng = LocalEngine(tiny_hf_dir, overlap_labels=overlap)
        with ServerThread(eng) as srv, urllib.request.urlopen(srv.url + "/server_info", timeout=30) as r:
            assert json.loads(r.read())["disable_overlap_schedule"] is (not overlap)
        eng.close()
