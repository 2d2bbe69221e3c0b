"""The prefix (radix) cache of `moe-rl serve`, with SGLang 0.5.23's semantics: a hit is a fresh prefill's
numbers, a cached prefix keeps the KV and routes of the weights that computed it until a flush, a flush
needs an idle engine, and a run that pushes in place launches its servers without the cache."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from moe_rl.config import RolloutConfig
from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.launcher import ServerGroup, plan_servers
from moe_rl.rollout.local_engine import LocalEngine
from moe_rl.rollout.prefix_cache import PrefixCache
from moe_rl.rollout.server import ServerThread
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.testing import make_tiny_qwen3_moe

P = [5, 6, 7, 8, 9, 10, 11, 12]


def hf_reference(model, prompt, output):
    """log_softmax(logits) of `output`, and the routes of every token but the last, from one HF forward (fp32)."""
    seq = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        out = model(seq, output_router_logits=True)
    lp = torch.log_softmax(out.logits[0].float(), -1)[len(prompt) - 1:-1]
    lp = lp.gather(1, torch.tensor(list(output)).view(-1, 1)).view(-1).numpy()
    k = model.config.num_experts_per_tok
    routes = torch.stack([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits], 1)
    return lp, routes[:-1].numpy()


@pytest.fixture(scope="module")
def models(tiny_hf_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    new_dir = make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_new"), seed=1)
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    return {"old": load(tiny_hf_dir), "new": load(new_dir), "new_dir": new_dir}


def _req(prompt, tokens=6, seed=0, n=1, **kw):
    return GenerateRequest(prompt, SamplingParams(max_new_tokens=tokens, seed=seed, ignore_eos=True, n=n), **kw)


def _check(res, model, atol=1e-5):
    lp, routes = hf_reference(model, res.prompt_ids, res.output_ids)
    np.testing.assert_allclose(res.output_logprobs, lp, atol=atol, rtol=0)
    np.testing.assert_array_equal(res.routed_experts.astype(np.int64), routes)


def test_a_hit_gives_a_fresh_prefills_logprobs_and_routes(tiny_hf_dir, models):
    eng = LocalEngine(tiny_hf_dir, max_cached_tokens=4096)
    try:
        (first,), = eng.generate([_req(P, seed=1)])
        assert first.cached_tokens == 0
        turn2 = P + first.output_ids + [20, 21]  # a multi-turn episode's next turn
        out = eng.generate([_req(turn2, seed=2), _req(P[:4] + [30, 31], seed=3), _req([40, 41], seed=4),
                            _req(P, 4, n=3, seed=5)])
    finally:
        eng.close()
    # SGLang's counts: all but the last output token's KV was computed; at most len - 1 tokens match; the
    # samples of n > 1 find their prompt, cached first (one prefill)
    assert [r.cached_tokens for rs in out for r in rs] == [len(P) + 6 - 1, 4, 0, 7, 7, 7]
    for rs in out:
        for r in rs:
            _check(r, models["old"])


def test_a_cached_prefix_keeps_the_routes_of_the_weights_that_computed_it_until_a_flush(tiny_hf_dir, models):
    eng = LocalEngine(tiny_hf_dir, max_cached_tokens=4096)
    try:
        eng.generate([_req(P, 2)])
        eng.update_weights_from_disk(models["new_dir"], version="1")  # no flush asked (an in-place push)
        (stale,), = eng.generate([_req(P + [30], seed=7)])
        assert eng.flush_cache()
        (fresh,), = eng.generate([_req(P + [30], seed=7)])
    finally:
        eng.close()
    _, old_routes = hf_reference(models["old"], stale.prompt_ids, stale.output_ids)
    assert stale.cached_tokens == len(P) and stale.weight_version == "1"
    # SGLang captures routes per KV slot: the cached prompt positions keep the old weights' choices
    np.testing.assert_array_equal(stale.routed_experts[:len(P)].astype(np.int64), old_routes[:len(P)])
    new_lp, new_routes = hf_reference(models["new"], stale.prompt_ids, stale.output_ids)
    assert (stale.routed_experts[:len(P)].astype(np.int64) != new_routes[:len(P)]).any()
    assert np.abs(stale.output_logprobs - new_lp).max() > 1e-3  # and the new tokens attend to the old KV
    assert fresh.cached_tokens == 0
    _check(fresh, models["new"])


def test_a_prompt_logprob_start_bounds_the_match(tiny_hf_dir, models):
    eng = LocalEngine(tiny_hf_dir, max_cached_tokens=4096)
    try:
        eng.generate([_req(P, 1)])
        (res,), = eng.generate([_req(P + [3], 2, logprob_start_len=3)])
    finally:
        eng.close()
    assert res.cached_tokens == 3  # SGLang matches no further than the first prompt log-prob asked for
    seq = torch.tensor([P + [3]])
    with torch.no_grad():
        lp = torch.log_softmax(models["old"](seq).logits[0].float(), -1)
    want = [lp[p - 1, seq[0, p]].item() for p in range(4, len(P) + 1)]
    assert res.input_logprobs[0] is None and len(res.input_logprobs) == len(P) + 1 - 3
    np.testing.assert_allclose(res.input_logprobs[1:], want, atol=1e-5, rtol=0)


def test_the_cache_holds_at_most_its_tokens_least_recently_used_first():
    cache = PrefixCache(10)
    kv = lambda n: torch.zeros((1, 1, n, 2))  # noqa: E731
    cache.insert([1, 2, 3, 4], kv(4), kv(4), None, 0)
    cache.insert([5, 6, 7, 8], kv(4), kv(4), None, 0)
    assert cache.match([1, 2, 3, 4, 9], 4).length == 4  # [1..4] is now the most recently used
    cache.insert([1, 2, 9, 9, 9], kv(5), kv(5), None, 0)  # splits [1..4] at 2, adds 3: 11 tokens > 10
    assert cache.tokens <= 10
    assert cache.match([5, 6, 7, 8, 0], 4).length == 0  # the least recently used leaf went
    assert cache.match([1, 2, 3, 4, 0], 4).length == 4 and cache.match([1, 2, 9, 9, 9, 0], 5).length == 5
    epoch = cache.epoch
    cache.reset()
    assert cache.insert([1, 2], kv(2), kv(2), None, epoch) == 0  # KV computed before a flush stays out
    assert cache.tokens == 0 and cache.match([1, 2, 3], 2).length == 0


def _http(url, path, body=None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_flush_is_refused_while_requests_run_or_are_paused_in_place(tiny_hf_dir):
    eng = LocalEngine(tiny_hf_dir, max_cached_tokens=4096)
    with ServerThread(eng) as srv:
        _http(srv.url, "/generate", {"input_ids": P, "sampling_params": {"max_new_tokens": 2}})
        assert json.loads(_http(srv.url, "/server_info")[1])["disable_radix_cache"] is False
        th = threading.Thread(target=_http, args=(srv.url, "/generate", {
            "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
        th.start()
        deadline = time.monotonic() + 30
        while not eng.busy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        try:
            assert _http(srv.url, "/flush_cache", {}) == (400, "Flush cache failed.\n")  # running
            _http(srv.url, "/pause_generation", {"mode": "in_place"})
            assert _http(srv.url, "/flush_cache", {})[0] == 400  # paused in place: they hold their KV
            assert eng.prefix_cache.tokens > 0
            _http(srv.url, "/pause_generation", {"mode": "retract"})  # retracted requests hold none
            assert _http(srv.url, "/flush_cache", {})[0] == 200 and eng.prefix_cache.tokens == 0
        finally:
            _http(srv.url, "/continue_generation", {})
            th.join(60)
        assert _http(srv.url, "/flush_cache?timeout=5", {})[0] == 200
        status, body = _http(srv.url, "/generate", {"input_ids": P + [3], "sampling_params": {"max_new_tokens": 1}})
        assert status == 200 and json.loads(body)["meta_info"]["cached_tokens"] == 0
    eng.close()


def test_an_in_place_run_reads_a_shared_prefix_with_the_pushed_weights(tiny_hf_dir, models, tmp_path):
    """The launch line of a run with rollout.inflight_update=in_place, pushed through the client as the run
    does (pause in place, load without a flush, continue): a prompt starting with a prefix computed before
    the push gets the new weights' routes and log-probs, as a fresh computation. With the prefix cache on
    (before the launcher disabled it) it got the old weights' routes for the prefix."""
    cfg = RolloutConfig(engine="local", num_servers=1, inflight_update="in_place")
    servers, _ = plan_servers(cfg, tiny_hf_dir)
    with ServerGroup(servers, tmp_path / "logs") as group:
        group.wait_healthy(120)
        with SGLangClient(group.urls, flush_on_update=False, version_lag=1, request_timeout=60) as client:
            client.generate([_req(P, 2)])  # the shared prefix, computed by the first weights
            out: dict = {}
            th = threading.Thread(target=lambda: out.update(r=client.generate([_req([1, 2, 3], 80)])), daemon=True)
            th.start()
            deadline = time.monotonic() + 30
            while not json.loads(_http(group.urls[0], "/server_info")[1])["internal_states"][0]["generating"]:
                assert time.monotonic() < deadline and th.is_alive()
                time.sleep(0.01)
            client.pause_generation("in_place")
            try:
                client.update_weights_from_disk(models["new_dir"], "1")
            finally:
                client.continue_generation()
            th.join(60)
            (res,), = client.generate([_req(P + [30, 31], 4, seed=9)])
    assert res.weight_version == "1"
    _check(res, models["new"], atol=1e-4)


def test_an_in_place_run_refuses_a_running_server_that_keeps_a_prefix_cache(tiny_hf_dir):
    from moe_rl.rollout.config import in_place_refusal

    in_place, retract = RolloutConfig(inflight_update="in_place"), RolloutConfig(inflight_update="retract")
    for flags, cached in (({"max_cached_tokens": 64}, True), ({}, False)):
        eng = LocalEngine(tiny_hf_dir, **flags)
        with ServerThread(eng) as srv:
            info = json.loads(_http(srv.url, "/server_info")[1])
        eng.close()
        why = in_place_refusal(in_place, srv.url, info)
        assert (why is not None) == cached and in_place_refusal(retract, srv.url, info) is None
        if cached:
            assert "rollout.inflight_update" in why and "--disable-radix-cache" in why and srv.url in why
    assert in_place_refusal(in_place, "http://h:1", {}) is not None  # a server that does not say: refused
