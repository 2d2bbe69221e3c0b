"""`moe-rl serve` refuses and leaves out what SGLang 0.5.23 refuses and leaves out: unknown sampling keys
(its JSON contract's 400), routes without --enable-return-routed-experts, a route start past the prompt
(its scheduler's message), a weight load from outside the trusted directories (400, as a failed load)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from moe_rl.rollout.local_engine import LocalEngine
from moe_rl.rollout.server import ServerThread


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@pytest.fixture(scope="module")
def servers(tiny_hf_dir):
    eng = LocalEngine(tiny_hf_dir)
    with ServerThread(eng) as plain, ServerThread(eng, enable_return_routed_experts=True) as routed:
        yield plain.url, routed.url
    eng.close()


GEN = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}


def test_routes_only_with_the_flag(servers):
    plain, routed = servers
    status, reply = _post(plain, "/generate", GEN)
    assert status == 200 and "routed_experts" not in reply["meta_info"]  # SGLang has no capturer: nothing
    status, reply = _post(routed, "/generate", GEN)
    assert status == 200 and isinstance(reply["meta_info"]["routed_experts"], str)
    for url, flag in ((plain, False), (routed, True)):
        with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
            assert json.loads(r.read())["enable_return_routed_experts"] is flag


@pytest.mark.parametrize("params, error", [
    ({"max_new_tokens": 1, "seed": 3}, "unknown field `seed`, expected one of `max_new_tokens`, `stop`"),
    ({"max_new_tokens": 1, "bogus": 1}, "unknown field `bogus`"),
    ({"temperature": "hot"}, 'invalid type: string "hot", expected f64'),
    ({"max_new_tokens": 2.0}, "invalid type: floating point `2.0`, expected i64"),
    ({"ignore_eos": "yes"}, 'invalid type: string "yes", expected a boolean'),
])
def test_unknown_or_mistyped_sampling_keys_get_sglangs_contract_error(servers, params, error):
    status, reply = _post(servers[0], "/generate", {"input_ids": [1, 2], "sampling_params": params})
    assert status == 400 and isinstance(reply["error"], str) and reply["error"].startswith(error), reply


def test_a_route_start_past_the_prompt_gets_the_schedulers_message(servers):
    body = {**GEN, "routed_experts_start_len": 4}
    status, reply = _post(servers[1], "/generate", body)
    assert status == 400
    assert reply["error"]["message"] == ("recv_req.routed_experts_start_len=4 is higher than the number of input "
                                         "tokens len(req.origin_input_ids)=3. Please use a smaller "
                                         "routed_experts_start_len.")
    # without return_routed_experts SGLang does not look at it
    assert _post(servers[1], "/generate", {**body, "return_routed_experts": False})[0] == 200


def test_a_load_outside_the_trusted_dirs_is_sglangs_failed_load(tiny_hf_dir, tmp_path):
    eng = LocalEngine(tiny_hf_dir)
    with ServerThread(eng, trusted_dirs=[tiny_hf_dir]) as srv:
        status, reply = _post(srv.url, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    eng.close()
    assert status == 400 and set(reply) == {"success", "message", "num_paused_requests"}
    assert reply["success"] is False and "--trusted-dir" in reply["message"] and reply["num_paused_requests"] == 0


def test_a_request_past_the_context_is_refused_not_capped(servers):
    # SGLang's tokenizer manager refuses prompt + max_new_tokens beyond the context (512 positions here)
    status, reply = _post(servers[0], "/generate", {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 503}})
    assert status == 400 and reply["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 512 tokens. You requested a total of "
        "513 tokens: 10 tokens from the input messages and 503 tokens for the completion.")
    status, reply = _post(servers[0], "/generate", {"input_ids": [5] * 512})
    assert status == 400 and reply["error"]["message"] == ("The input (512 tokens) is longer than the model's context "
                                                           "length (512 tokens).")
    assert _post(servers[0], "/generate", {"input_ids": [5] * 10,
                                           "sampling_params": {"max_new_tokens": 2}})[0] == 200
