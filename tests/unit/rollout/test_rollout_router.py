"""The real sglang-router 0.3.2 in front of two `moe-rl serve` workers (rollout.router: true).

The router re-serialises /generate into a fixed struct without `return_routed_experts`,
so SGLangClient sends requests for routes to the workers itself and everything else
through the router. One group (router + 2 workers) serves the whole module.
"""
from __future__ import annotations

import importlib.util
import json
import urllib.error
import urllib.request

import pytest

from moe_rl.config import RolloutConfig
from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.launcher import ServerGroup
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.testing import free_ports

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                reason="sglang-router is not installed (setup.py [dev] installs it)")


@pytest.fixture(scope="module")
def group(tiny_hf_dir, tmp_path_factory):
    cfg = RolloutConfig(engine="local", num_servers=2, router=True, colocated=True)  # + --enable-memory-saver
    cfg.base_port = free_ports(4)  # 2 workers, the router, its metrics exporter
    g = ServerGroup.from_config(cfg, tiny_hf_dir, tmp_path_factory.mktemp("router-logs"),
                                env={"OMP_NUM_THREADS": "1"})
    assert g.router is not None, "rollout.router=true must put the router in front of moe-rl serve"
    with g:
        g.wait_healthy(timeout=90)
        yield g


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_router_drops_routed_experts_on_the_way(group):
    body = {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
            "return_logprob": True, "return_routed_experts": True}
    direct = _post(group.admin_urls[0], "/generate", body)
    assert isinstance(direct["meta_info"].get("routed_experts"), str)  # the worker returns them
    routed = _post(group.urls[0], "/generate", body)
    assert routed["output_ids"] == direct["output_ids"]  # greedy: the same sample either way
    # sglang-router 0.3.2 forwards a fixed struct: return_routed_experts is lost. If this
    # starts failing, the router passes the field on and the client's detour can go.
    assert "routed_experts" not in routed["meta_info"], "sglang-router now returns routed_experts"


def test_client_gets_routes_from_the_workers_and_spreads_the_load(group):
    reqs = [GenerateRequest([1, 5, 9 + k], SamplingParams(max_new_tokens=3, seed=k)) for k in range(8)]
    with SGLangClient(group.urls, admin_urls=group.admin_urls, request_timeout=60) as client:
        assert client.health()
        out = client.generate(reqs)
    samples = [s for per_request in out for s in per_request]
    assert len(samples) == 8
    for s in samples:
        assert s.routed_experts is not None and s.routed_experts.shape == (3 + 3 - 1, 4, 2)
    assert {s.server for s in samples} == set(group.admin_urls)  # both workers, never the router


def test_requests_without_routes_go_through_the_router(group):
    reqs = [GenerateRequest([2, 4, k], SamplingParams(max_new_tokens=2, seed=k), return_routed_experts=False)
            for k in range(4)]
    with SGLangClient(group.urls, admin_urls=group.admin_urls, request_timeout=60) as client:
        out = client.generate(reqs)
    samples = [s for per_request in out for s in per_request]
    assert len(samples) == 4 and all(len(s.output_ids) == 2 and s.routed_experts is None for s in samples)
    assert {s.server for s in samples} == set(group.urls)


def test_generate_after_release_resumes_the_workers_and_reloads_their_weights(group, tiny_hf_dir):
    """Colocated runs release the servers after each rollout; an eval or a skipped step
    must not reach a released server (moe-rl serve refuses /generate then, as SGLang fails),
    nor sample from the weights region a resume maps back without its content."""
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}
    greedy = [GenerateRequest([3, 4, k], SamplingParams(max_new_tokens=3, temperature=0.0)) for k in range(4)]
    with SGLangClient(group.urls, admin_urls=group.admin_urls, request_timeout=60,
                      initial_weights=tiny_hf_dir) as client:
        before = client.generate(greedy)
        client.release_memory_occupation()
        assert client.released
        with pytest.raises(urllib.error.HTTPError) as refused:  # what a rollout would hit untracked
            _post(group.admin_urls[0], "/generate", body)
        assert refused.value.code == 400
        after = client.generate(greedy)  # resumed, then the weights the servers started from, again
        assert not client.released
    for b, a in zip(before, after):
        assert a[0].output_ids == b[0].output_ids
        assert abs(a[0].output_logprobs - b[0].output_logprobs).max() < 1e-5
    assert _post(group.admin_urls[0], "/generate", body)["output_ids"]  # resumed for everybody
