"""`moe-rl serve` over loopback: SGLang's JSON shapes, errors, weight sync, failover.

One server runs as a subprocess (`python -m moe_rl.cli serve`), one in this
process (ServerThread); both serve the same tiny Qwen3-MoE.
"""
from __future__ import annotations

import base64
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_rl.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from moe_rl.rollout.local_engine import LocalEngine
from moe_rl.rollout.server import ServerThread
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.testing.serve import start_serve_process, stop_process



def _start_cli_server(model_dir: Path, *extra: str, timeout: float = 120.0) -> SimpleNamespace:
    srv = start_serve_process(model_dir, *extra, timeout=timeout)
    assert srv.first_line.strip() == f"serving {model_dir} on {srv.url}"
    return srv


_stop = stop_process


@pytest.fixture(scope="module")
def served(tiny_hf_dir):
    srv = _start_cli_server(tiny_hf_dir, "--max-batch", "16", "--max-body-mb", "0.05")
    yield srv
    _stop(srv.proc)


@pytest.fixture(scope="module")
def local(tiny_hf_dir):
    eng = LocalEngine(tiny_hf_dir, seed=0)
    with ServerThread(eng, enable_return_routed_experts=True) as srv:
        yield SimpleNamespace(url=srv.url, engine=eng)
    eng.close()


def _client(urls, **kw) -> SGLangClient:
    return SGLangClient(urls, **{"request_timeout": 60.0, "backoff_base": 0.05, "probe_interval": 0.1, **kw})


def _http(url: str, path: str, body=None, raw: bytes | None = None, method: str | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def hf_reference(model, prompt, output, temperature: float = 1.0):
    """log_softmax(logits / T) of `output` and the routes, from one HF forward."""
    seq = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        out = model(seq, output_router_logits=True)
    lp = torch.log_softmax(out.logits[0].float() / temperature, -1)[len(prompt) - 1:-1]
    lp = lp.gather(1, torch.tensor(output).view(-1, 1)).view(-1).numpy()
    k = model.config.num_experts_per_tok
    routes = torch.stack([torch.topk(torch.softmax(r.float(), -1), k, -1).indices for r in out.router_logits], 1)
    return lp, routes[:-1].numpy()


REQS = [GenerateRequest([5, 6, 7, 8], SamplingParams(max_new_tokens=10, n=3, seed=42)),
        GenerateRequest([9, 10], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)),
        GenerateRequest([11, 12, 13], SamplingParams(max_new_tokens=7, n=2, top_k=10, top_p=0.9))]


def test_client_over_cli_server(served):
    with _client([served.url]) as c:
        assert c.health()
        out = c.generate(REQS)
        again = c.generate(REQS[:1])
        one_by_one = c.generate(REQS[0].single_samples())  # what the batched group stands for
    assert [len(r) for r in out] == [3, 1, 2]
    for req, results in zip(REQS, out):
        for r in results:
            assert r.prompt_ids == list(req.prompt_ids) and r.server == served.url
            assert r.weight_version == "default"
            assert r.finish_reason in ("stop", "length")
            assert len(r.output_ids) <= req.sampling.max_new_tokens
            if r.finish_reason == "length":
                assert len(r.output_ids) == req.sampling.max_new_tokens
            assert r.output_logprobs.dtype == np.float32 and (r.output_logprobs <= 0).all()
            assert r.routed_experts.shape == (len(r.token_ids) - 1, 4, 2) and r.routed_experts.dtype == np.uint8
    assert [r.output_ids for r in again[0]] == [r.output_ids for r in out[0]]       # same seed, same output
    assert [r.output_ids for (r,) in one_by_one] == [r.output_ids for r in out[0]]  # a group = its n seeded samples
    assert len({tuple(r.output_ids) for r in out[0]}) == 3                             # n samples differ
    # stop ids: the greedy continuation stops at the first stop token (or EOS, id 2), which it keeps
    greedy = out[1][0].output_ids
    stop = greedy[2]
    with _client([served.url]) as c:
        (res,), = c.generate([GenerateRequest([9, 10], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                       stop_token_ids=[stop]))])
    cut = min(greedy.index(t) + 1 for t in (stop, 2) if t in greedy)
    assert res.finish_reason == "stop" and res.output_ids == greedy[:cut]


def test_logprobs_are_of_the_tempered_distribution(served, tiny_hf_dir):
    """At T = 0.7 the server returns log_softmax(logits / 0.7) of the sampled tokens, as SGLang does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    with _client([served.url]) as c:
        (results,) = c.generate([GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=8, n=2, seed=3,
                                                                            temperature=0.7, ignore_eos=True))])
    for r in results:
        tempered, _ = hf_reference(model, r.prompt_ids, r.output_ids, temperature=0.7)
        raw, _ = hf_reference(model, r.prompt_ids, r.output_ids)
        np.testing.assert_allclose(r.output_logprobs, tempered, atol=1e-4, rtol=0)
        assert np.abs(raw - tempered).max() > 1e-2  # the two conventions differ visibly at T = 0.7


def test_http_json_shapes(served):
    status, body = _http(served.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, "return_logprob": True,
        "return_routed_experts": True})
    assert status == 200
    d = json.loads(body)
    assert set(d) == {"output_ids", "meta_info"}           # no tokenizer -> no "text"
    m = d["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 4}
    assert m["prompt_tokens"] == 3 and m["completion_tokens"] == 4 and m["weight_version"] == "default"
    assert [e[1] for e in m["output_token_logprobs"]] == d["output_ids"]
    assert all(len(e) == 3 and e[2] is None for e in m["output_token_logprobs"])
    routes = np.frombuffer(base64.b64decode(m["routed_experts"]), dtype=np.int32).reshape(3 + 4 - 1, 4, 2)
    # routed_experts_start_len=2: rows [2, len - 1) only, as SGLang
    status, body = _http(served.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, "return_routed_experts": True,
        "routed_experts_start_len": 2})
    tail = json.loads(body)["meta_info"]["routed_experts"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(tail), dtype=np.int32).reshape(4, 4, 2),
                                  routes[2:])
    # batch of 2 prompts x n=2 -> list of 4, prompt-major
    status, body = _http(served.url, "/generate", {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {
        "max_new_tokens": 2, "n": 2}})
    items = json.loads(body)
    assert status == 200 and [i["meta_info"]["prompt_tokens"] for i in items] == [2, 2, 3, 3]
    assert "output_token_logprobs" not in items[0]["meta_info"] and "routed_experts" not in items[0]["meta_info"]
    status, body = _http(served.url, "/get_model_info")
    info = json.loads(body)
    assert info["is_generation"] and info["weight_version"] == "default" and info["num_experts_per_tok"] == 2
    assert _http(served.url, "/health") == (200, b"")
    assert _http(served.url, "/flush_cache", raw=b"")[0] == 200


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"input_ids": []}).encode(), 400, "input_ids"),
    (json.dumps({"input_ids": [1, "a"]}).encode(), 400, "integers"),
    (json.dumps({"input_ids": [1, 999]}).encode(), 400, "out of range"),
    (json.dumps({"input_ids": [1], "sampling_params": {"top_p": 2}}).encode(), 400, "top_p"),
    (json.dumps({"text": "hello"}).encode(), 400, "send `input_ids`"),
    (json.dumps({"input_ids": [1] * 20000}).encode(), 413, "too large"),
    (b"[" * 20000 + b"]" * 20000, 400, "nests JSON too deeply"),  # a RecursionError, not a 500
    (json.dumps({"input_ids": [[1, 2]] * 400, "sampling_params": {"n": 8, "max_new_tokens": 100}}).encode(), 400,
     "asks for 320800 tokens"),  # bounded work per request: named limit and flag
])
def test_http_errors(served, body, status, needle):
    got, raw = _http(served.url, "/generate", raw=body)
    assert got == status
    assert needle in json.loads(raw)["error"]["message"]


def test_health_answers_while_generating_and_pause_aborts(served):
    res = {}
    with _client([served.url]) as c:
        t = threading.Thread(target=lambda: res.update(out=c.generate(
            [GenerateRequest([3, 4], SamplingParams(max_new_tokens=450, ignore_eos=True))])))
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        assert _http(served.url, "/health")[0] == 200
        assert time.monotonic() - t0 < 2.0
        c.pause_generation("abort")
        t.join(60)
        c.continue_generation()
    (r,), = res["out"]
    assert r.finish_reason == "abort" and len(r.output_ids) < 450
    assert r.routed_experts.shape[0] == len(r.token_ids) - 1


def test_weight_sync_from_disk(served, tiny_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from moe_rl.testing import make_tiny_qwen3_moe

    new_dir = make_tiny_qwen3_moe(tmp_path / "v1", seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    req = [GenerateRequest([5, 6, 7, 8], SamplingParams(max_new_tokens=8, seed=5, ignore_eos=True))]
    with _client([served.url]) as c:
        old = c.generate(req)[0][0]
        try:
            c.update_weights_from_disk(new_dir, version="v1")
            assert c.get_model_info()["weight_version"] == "v1"
            (res,), = c.generate(req)
            assert res.weight_version == "v1" and res.output_ids != old.output_ids
            lp, routes = hf_reference(new_model, res.prompt_ids, res.output_ids)
            np.testing.assert_allclose(res.output_logprobs, lp, atol=1e-4, rtol=0)
            np.testing.assert_array_equal(res.routed_experts.astype(np.int64), routes)
            # a corrupt checkpoint is refused and v1 keeps serving
            bad = tmp_path / "corrupt"
            shutil.copytree(new_dir, bad)
            f = bad / "model.safetensors"
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            with pytest.raises(RolloutError, match="refused the weights") as ei:
                c.update_weights_from_disk(bad, version="v2")
            assert served.url in str(ei.value)
            (same,), = c.generate(req)
            assert same.weight_version == "v1" and same.output_ids == res.output_ids
            # the repeat reuses the prompt's cached keys and values (the prefix cache): equal to rounding
            np.testing.assert_allclose(same.output_logprobs, res.output_logprobs, atol=1e-5, rtol=0)
        finally:
            c.update_weights_from_disk(tiny_hf_dir, version="default")
        assert c.generate(req)[0][0].output_ids == old.output_ids


def test_failover_when_a_server_is_killed_mid_batch(served, local):
    """Runs last: it kills the subprocess server."""
    reqs = [GenerateRequest([5 + k, 6, 7], SamplingParams(max_new_tokens=12, seed=100 + k, ignore_eos=True))
            for k in range(8)]
    want = local.engine.generate(reqs)
    # park the subprocess server's generation so the kill lands while requests are in flight there
    assert _http(served.url, "/pause_generation", {"mode": "in_place"})[0] == 200
    res = {}
    with _client([served.url, local.url], max_attempts=3) as c:
        t = threading.Thread(target=lambda: res.update(out=c.generate(reqs)))
        t.start()
        deadline = time.monotonic() + 30
        while c.server_states()[served.url]["inflight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.server_states()[served.url]["inflight"] > 0
        served.proc.kill()
        t.join(60)
        assert not c.server_states()[served.url]["healthy"]
    out = res["out"]
    assert [len(r) for r in out] == [1] * 8
    assert all(r[0].server == local.url for r in out)
    assert [r[0].output_ids for r in out] == [w[0].output_ids for w in want]


def test_sigterm_stops_the_server_within_seconds_mid_generation(tiny_hf_dir):
    """A long request in flight must not hold SIGTERM until it would have finished."""
    import signal

    srv = _start_cli_server(tiny_hf_dir)
    body = {"input_ids": [[5, 6, 7]] * 400, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
    worker = threading.Thread(target=lambda: _http(srv.url, "/generate", body), daemon=True)
    worker.start()
    time.sleep(2.0)  # generating by now: 400 x 500 tokens take minutes on CPU
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=20)
    finally:
        _stop(srv.proc)
    assert time.monotonic() - start < 20  # the whole request would take minutes
