"""Engine contract: sampling-param translation, result shape checks (a route's type and wire form:
tests/unit/test_routes.py)."""
from __future__ import annotations

import numpy as np
import pytest

from moe_rl.rollout.engine import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams, moe_layer_ids
from moe_rl.rollout.sglang_client import SGLangClient


def test_sampling_params_roundtrip_and_validation():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5, stop_token_ids=[3, 4],
                        seed=11, n=2)
    d = sp.to_sglang()
    assert d["sampling_seed"] == 11 and d["stop_token_ids"] == [3, 4] and d["n"] == 2
    assert SamplingParams.from_sglang(d) == sp
    assert SamplingParams.from_sglang({"top_k": 1 << 30}).top_k == -1   # SGLang's TOP_K_ALL
    assert SamplingParams.from_sglang({"temperature": 0}).greedy
    for bad in ({"top_p": 0}, {"top_k": 0}, {"n": 0}, {"max_new_tokens": -1}, {"min_p": 0.1}):
        with pytest.raises(ValueError):
            SamplingParams.from_sglang(bad)
    reqs = GenerateRequest([1, 2], SamplingParams(n=3, seed=5)).single_samples()
    assert [r.sampling.seed for r in reqs] == [5, 6, 7] and all(r.sampling.n == 1 for r in reqs)


def test_result_shape_checks():
    routes = np.broadcast_to(np.array([0, 1], np.uint8), (4, 2, 2))
    ok = GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", routes)
    assert ok.token_ids == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="len\\(prompt \\+ output\\) - 1"):
        GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", np.zeros((5, 2, 2), np.uint8))
    with pytest.raises(ValueError, match="row 0, MoE layer 0 repeats an expert id"):  # zeros as padding, k = 2
        GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", np.zeros((4, 2, 2), np.uint8))
    with pytest.raises(ValueError, match="finish_reason"):
        GenerateResult([1], [4], np.zeros(1), "eos")


def test_moe_layer_ids_from_configs():
    assert moe_layer_ids({"num_experts": 8, "num_hidden_layers": 4, "mlp_only_layers": [1]}) == [0, 2, 3]
    assert moe_layer_ids({"n_routed_experts": 8, "num_hidden_layers": 4, "first_k_dense_replace": 1}) == [1, 2, 3]
    assert moe_layer_ids({"num_hidden_layers": 4}) is None


def test_engines_satisfy_protocol():
    assert isinstance(SGLangClient(["http://127.0.0.1:9"]), RolloutEngine)
