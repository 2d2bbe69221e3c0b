"""Which weight versions SGLangClient accepts on a sample (`_stale_version`), and what it does with one it does not.

SGLang labels the weights a server starts with "default" (sglang/srt/arg_groups/fields/serving.py) and
puts a ("default", 0, k) span on every request alive at the first push (srt/utils/weight_versions.py).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from moe_rl.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from moe_rl.rollout.sglang_client import SGLangClient


def _result(spans) -> GenerateResult:
    n = spans[-1][2]
    return GenerateResult(prompt_ids=[1], output_ids=[3] * n, output_logprobs=np.zeros(n, np.float32),
                          finish_reason="length", weight_version=spans[-1][0], weight_versions=tuple(spans))


def _client(lag: int, pushes: list[str]) -> SGLangClient:
    client = SGLangClient(["http://127.0.0.1:9"], version_lag=lag)  # never contacted
    for v in pushes:
        client._record_push(f"/weights/v{v}", v)
    return client


@pytest.mark.parametrize("lag, pushes, spans, stale", [
    # alive at the first push: its first tokens are the servers' initial weights, version 0
    (1, ["1"], [("default", 0, 2), ("1", 2, 4)], None),
    (2, ["1", "2"], [("default", 0, 1), ("1", 1, 3), ("2", 3, 4)], None),
    # version 0 is beyond the bound once version_lag + 1 versions were pushed
    (1, ["1", "2"], [("default", 0, 2), ("2", 2, 4)], "default"),
    # a synchronous run trains on the last push's tokens only
    (0, ["1"], [("default", 0, 2), ("1", 2, 4)], "default"),
    (1, ["1", "2"], [("1", 0, 2), ("2", 2, 4)], None),
    # a restarted server, back on the initial weights after the pushes
    (1, ["1", "2", "3"], [("default", 0, 4)], "default"),
])
def test_the_initial_weights_count_as_version_zero(lag, pushes, spans, stale):
    client = _client(lag, pushes)
    try:
        assert client._stale_version([_result(spans)]) == stale
    finally:
        client.close()


def _push_while_generating(client: SGLangClient, engine, req: GenerateRequest, mode: str, weights,
                           after_s: float = 0.0) -> GenerateResult:
    """`req`'s one sample, with weights version "1" pushed (paused `mode`) while the engine generates it."""
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(r=client.generate([req])), daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not engine.busy:
        assert time.monotonic() < deadline and th.is_alive(), "the request never reached the engine"
        time.sleep(0.01)
    time.sleep(after_s)
    client.pause_generation(mode)
    try:
        client.update_weights_from_disk(weights, "1")
    finally:
        client.continue_generation()
    th.join(60)
    return out["r"][0][0]


def test_a_request_alive_at_the_first_push_is_kept(tmp_path):
    """moe-rl serve labels its first weights "default" as SGLang does; a retracted push lands while a request
    generates: the client returns the sample spanning both versions and generates nothing again."""
    from moe_rl.rollout.local_engine import LocalEngine
    from moe_rl.rollout.server import ServerThread
    from moe_rl.testing import make_tiny_qwen3_moe

    model = tmp_path / "tiny"
    make_tiny_qwen3_moe(model)
    engine = LocalEngine(model)
    with ServerThread(engine) as server, SGLangClient([server.url], version_lag=1, probe_interval=0.2) as client:
        req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=300, ignore_eos=True), return_routed_experts=False)
        spans = _push_while_generating(client, engine, req, "retract", model).weight_versions
        assert [v for v, _, _ in spans] == ["default", "1"] and spans[-1][2] == 300
        assert client.take_stale_resamples() == 0
        assert client.server_states()[server.url]["healthy"]


LABELS = ["default", "1", "2"]


@pytest.mark.parametrize("spans, sent, expected", [
    # the token that opens a version's span was sampled before the push: one token later
    ((("default", 0, 3), ("1", 3, 6)), "default", (("default", 0, 4), ("1", 4, 6))),
    ((("default", 0, 2), ("1", 2, 3), ("2", 3, 5)), "default", (("default", 0, 3), ("1", 3, 4), ("2", 4, 5))),
    ((("default", 0, 3), ("1", 3, 4)), "default", (("default", 0, 4),)),  # its one new-labelled token was old
    # no span before the push: the prefill may have been in flight, its first token is counted older
    ((("1", 0, 4),), "default", (("default", 0, 1), ("1", 1, 4))),
    ((("2", 0, 1),), "default", (("1", 0, 1),)),
    ((("1", 0, 4),), "1", (("1", 0, 4),)),  # sent after the push: exact
    ((("1", 0, 0),), "default", (("1", 0, 0),)),  # no tokens
    ((("restarted", 0, 2),), "1", (("restarted", 0, 2),)),  # an unknown label is left for the stale check
])
def test_in_place_spans_count_each_token_with_the_weights_that_sampled_it(spans, sent, expected):
    from moe_rl.rollout.wire import in_place_spans

    assert in_place_spans(spans, sent, LABELS) == expected



def _logprobs(model_dir, prompt: list[int], output: list[int]) -> np.ndarray:
    """log softmax of a fresh HF forward of `model_dir` at each output token (T = 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(1, torch.tensor(output).view(-1, 1)).view(-1).numpy()


@pytest.mark.parametrize("overlap", [True, False])
def test_in_place_spans_name_the_weights_that_sampled_each_token(tmp_path, overlap):
    """An in-place push mid-generation on moe-rl serve, which labels tokens as SGLang's scheduler does (with
    its overlap schedule, the default, or without). Which weights sampled a token is read off its log-prob:
    up to the push they are a fresh forward of the old checkpoint; the first token the new weights sampled
    is not (new weights, partly over old keys and values). The client's spans end the old version exactly
    there (SGLang's overlap labels end it one token early: the raw spans fail this)."""
    from moe_rl.rollout.local_engine import LocalEngine
    from moe_rl.rollout.server import ServerThread
    from moe_rl.testing import make_tiny_qwen3_moe

    old, new = make_tiny_qwen3_moe(tmp_path / "old", seed=0), make_tiny_qwen3_moe(tmp_path / "new", seed=1)
    engine = LocalEngine(old, overlap_labels=overlap)
    prompt = [1, 5, 6, 7]
    with ServerThread(engine) as server, SGLangClient([server.url], version_lag=1, flush_on_update=False,
                                                      pushes_in_place=True) as client:
        req = GenerateRequest(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True, seed=3),
                              return_routed_experts=False)
        res = _push_while_generating(client, engine, req, "in_place", new, after_s=0.05)
    spans = res.weight_versions
    assert [v for v, _, _ in spans] == ["default", "1"], spans
    boundary = spans[0][2]  # the first token counted with version "1"
    engine_lp = res.output_logprobs
    by_old = np.abs(_logprobs(old, prompt, res.output_ids) - engine_lp) < 1e-4
    assert by_old[:boundary].all(), np.flatnonzero(~by_old[:boundary])  # every token before: the old weights'
    assert not by_old[boundary], "the first token of version 1 was sampled from the old weights"
