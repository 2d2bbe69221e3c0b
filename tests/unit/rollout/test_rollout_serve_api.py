"""The rest of SGLang 0.5.23's API on `moe-rl serve`, against a tiny model with a real tokenizer (built offline):
prompt log-probs from logprob_start_len (None first, log_softmax(logits) as SGLang's logits processor),
top / token-id log-probs, token text in the third slot, stop strings, the server-sent-event stream,
/abort_request, /tokenize and /detokenize, and the OpenAI endpoints through the `openai` client."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from moe_rl.rollout.local_engine import LocalEngine
from moe_rl.rollout.server import ServerThread
from moe_rl.testing import make_tiny_qwen3_moe
from moe_rl.testing.tokenizer import add_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return add_tiny_tokenizer(make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_tok"), seed=0))


@pytest.fixture(scope="module")
def srv(tok_dir):
    eng = LocalEngine(tok_dir, max_cached_tokens=4096)
    with ServerThread(eng, enable_return_routed_experts=True) as s:
        s.engine = eng
        yield s
    eng.close()


@pytest.fixture(scope="module")
def ref(tok_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tok_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tok_dir, local_files_only=True))


def _post(url, path, body, raw=False):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
            return r.status, data.decode() if raw else json.loads(data or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _logp(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # [len, V], position p predicts p+1


@pytest.mark.parametrize("start, tokens", [(0, 0), (2, 3), (5, 2)])
def test_prompt_logprobs_from_a_start(srv, ref, start, tokens):
    model, tok = ref
    prompt = [40, 41, 42, 43, 44]
    status, d = _post(srv.url, "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}, "return_logprob": True,
        "logprob_start_len": start, "top_logprobs_num": 3, "token_ids_logprob": [7, 9], "return_text_in_logprobs": True})
    assert status == 200, d
    m = d["meta_info"]
    lp = _logp(model, prompt + d["output_ids"])
    got = m["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt[start:] and all(x == tok.decode([t]) for _, t, x in got)
    if start < len(prompt):
        assert got[0][0] is None and m["input_top_logprobs"][0] is None and m["input_token_ids_logprobs"][0] is None
        want = [lp[p - 1, prompt[p]].item() for p in range(start + 1, len(prompt))]
        np.testing.assert_allclose([x for x, _, _ in got[1:]], want, atol=1e-5, rtol=0)
        for p, row in zip(range(start, len(prompt) - 1), m["input_top_logprobs"][1:]):
            vals, ids = lp[p].topk(3)
            assert [t for _, t, _ in row] == ids.tolist()
            np.testing.assert_allclose([x for x, _, _ in row], vals.tolist(), atol=1e-5, rtol=0)
        for p, row in zip(range(start, len(prompt) - 1), m["input_token_ids_logprobs"][1:]):
            np.testing.assert_allclose([x for x, _, _ in row], lp[p, [7, 9]].tolist(), atol=1e-5, rtol=0)
    assert len(m["output_token_logprobs"]) == len(d["output_ids"]) == tokens
    for k, (x, t, text) in enumerate(m["output_token_logprobs"]):  # greedy: T = 1, the same distribution
        assert text == tok.decode([t]) and abs(x - lp[len(prompt) - 1 + k, t].item()) < 1e-5
        assert [i for _, i, _ in m["output_top_logprobs"][k]] == lp[len(prompt) - 1 + k].topk(3).indices.tolist()


def test_stop_strings_end_the_sample_and_are_trimmed(srv):
    body = {"text": "ab", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    full = _post(srv.url, "/generate", body)[1]
    stop = full["text"][3:5]  # a piece of the greedy text
    cut = full["text"].index(stop)
    for trim in (True, False):
        d = _post(srv.url, "/generate", {**body, "sampling_params": {**body["sampling_params"], "stop": [stop],
                                                                        "no_stop_trim": not trim}})[1]
        assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert d["text"] == full["text"][:cut] + ("" if trim else stop)
        assert d["output_ids"] == full["output_ids"][:len(d["output_ids"])] and len(d["output_ids"]) < 12


def _events(raw: str) -> list:
    assert raw.endswith("data: [DONE]\n\n")
    parts = raw.split("\n\n")
    assert parts[-1] == "" and all(p.startswith("data: ") for p in parts[:-1])
    return [json.loads(p[len("data: "):]) for p in parts[:-2]]


def test_stream_sends_cumulative_events_then_the_whole_reply(srv):
    body = {"text": "abc", "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3, "ignore_eos": True},
            "return_logprob": True, "return_routed_experts": True}
    whole = _post(srv.url, "/generate", body)[1]
    status, raw = _post(srv.url, "/generate", {**body, "stream": True}, raw=True)
    assert status == 200
    events = _events(raw)
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5, 6] and "index" not in events[0]
    assert all(e["output_ids"] == whole["output_ids"][:len(e["output_ids"])] for e in events)
    assert all(e["meta_info"]["finish_reason"] is None and "routed_experts" not in e["meta_info"] for e in events[:-1])
    last, want = events[-1], whole
    for k in ("id", "e2e_latency", "cached_tokens"):
        last["meta_info"].pop(k), want["meta_info"].pop(k)
    assert last == want  # the last event is the whole reply
    status, raw = _post(srv.url, "/generate", {"input_ids": [[5, 6], [7, 8]], "stream": True,
                                               "sampling_params": {"max_new_tokens": 2, "n": 2}}, raw=True)
    assert sorted({e["index"] for e in _events(raw)}) == [0, 1, 2, 3]


def _wait_busy(engine):
    deadline = time.monotonic() + 30
    while not engine.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_abort_request_ends_a_running_request_by_rid(srv):
    assert _post(srv.url, "/abort_request", {"rid": "nobody"}, raw=True) == (200, "")
    out = {}
    batch = {"input_ids": [[1, 2, 3], [1, 2, 4]], "rid": ["keep", "stop-me"],
             "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    th = threading.Thread(target=lambda: out.update(b=_post(srv.url, "/generate", batch)[1]))
    th.start()
    _wait_busy(srv.engine)
    assert _post(srv.url, "/abort_request", {"rid": "stop-me"}, raw=True) == (200, "")
    th.join(60)
    keep, stopped = out["b"]
    assert (keep["meta_info"]["id"], stopped["meta_info"]["id"]) == ("keep", "stop-me")
    assert stopped["meta_info"]["finish_reason"]["type"] == "abort" and len(stopped["output_ids"]) < 300
    assert keep["meta_info"]["finish_reason"]["type"] == "length" and len(keep["output_ids"]) == 300
    th = threading.Thread(target=lambda: out.update(one=_post(srv.url, "/generate", {**batch, "rid": "x"})[1]))
    th.start()
    _wait_busy(srv.engine)
    assert _post(srv.url, "/abort_request", {"abort_all": True}, raw=True)[0] == 200
    th.join(60)
    assert [d["meta_info"]["finish_reason"]["type"] for d in out["one"]] == ["abort", "abort"]
    assert [d["meta_info"]["id"] for d in out["one"]] == ["x_0", "x_1"]  # SGLang's per-item rids


def test_server_info_reports_the_cache_and_the_api_version(srv):
    with urllib.request.urlopen(srv.url + "/server_info", timeout=30) as r:
        info = json.loads(r.read())
    assert info["max_total_num_tokens"] == 4096 and info["disable_radix_cache"] is False
    assert info["version"] == "0.5.23" and info["frontend"] == "moe-rl serve"


def test_tokenize_and_detokenize(srv, ref):
    _, tok = ref
    assert _post(srv.url, "/tokenize", {"prompt": "Hi there"})[1] == {"tokens": tok.encode("Hi there"), "count": 8,
                                                                      "max_model_len": 512}
    d = _post(srv.url, "/v1/tokenize", {"prompt": ["a", "bc"]})[1]
    assert d["tokens"] == [tok.encode("a"), tok.encode("bc")] and d["count"] == [1, 2]
    msgs = [{"role": "user", "content": "hi"}]
    want = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert _post(srv.url, "/tokenize", {"messages": msgs})[1]["tokens"] == want
    assert _post(srv.url, "/detokenize", {"tokens": tok.encode("Hi there")})[1] == {"text": "Hi there"}
    assert _post(srv.url, "/detokenize", {"tokens": "x"})[0] == 400


def test_openai_client_completions_and_chat_are_the_native_generations(srv, ref):
    from openai import BadRequestError, OpenAI

    _, tok = ref
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [str(srv.engine.model_path)]
    native = _post(srv.url, "/generate", {"text": "The capital", "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 5, "temperature": 0}})[1]
    r = client.completions.create(model="any", prompt="The capital", max_tokens=5, temperature=0, logprobs=2)
    (c,) = r.choices
    assert c.text == native["text"] and c.finish_reason == "length"
    np.testing.assert_allclose(c.logprobs.token_logprobs, [x for x, _, _ in native["meta_info"]["output_token_logprobs"]],
                               atol=1e-5)
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 5
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="any", prompt="The capital", max_tokens=5, temperature=0, stream=True) if ch.choices)
    assert streamed == native["text"]

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    native = _post(srv.url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})[1]
    r = client.chat.completions.create(model="any", messages=msgs, max_tokens=6, temperature=0, n=1)
    assert r.choices[0].message.content == native["text"] and r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="any", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == native["text"]
    assert chunks[-1].usage.completion_tokens == 6
    with pytest.raises(BadRequestError, match="frequency_penalty is not supported"):
        client.chat.completions.create(model="any", messages=msgs, frequency_penalty=0.5)
    status, d = _post(srv.url, "/v1/completions", {"prompt": ""})
    assert status == 400 and d == {"object": "error", "message": "Prompt cannot be empty", "type": "BadRequestError",
                                   "param": None, "code": 400}
