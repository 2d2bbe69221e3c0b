"""`moe-rl serve` as an SGLang server for the trainer's distributed weight sync.

This test process is the trainer: `NcclSync` (weight_sync/nccl.py) over gloo, the code path
the cluster runs over NCCL, against one `moe-rl serve` subprocess (a process group
name can be registered once per process, so the two sides cannot share one). Also
SGLang 0.5.23's memory release / resume, update session, probe and info endpoints.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.local_engine import LocalEngine
from moe_rl.rollout.memory import MemoryReleasedError
from moe_rl.rollout.server import ServerThread
from moe_rl.rollout.weight_sync import NcclSync, TensorMeta, WeightSyncError, plan_buckets
from moe_rl.testing import free_port, make_tiny_qwen3_moe
from moe_rl.testing.serve import start_serve_process, stop_process

PROMPT = [5, 6, 7, 8, 9]
BUCKET_BYTES = 64 << 10  # the tiny checkpoint (~650 KB) goes in about a dozen buckets


# ----------------------------------------------------------------------------- helpers
def _http(url: str, path: str, body=None, method: str | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("GET" if data is None else "POST"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, (json.loads(raw) if raw.strip() else raw)


def _checksums(url: str) -> dict[str, str]:
    """Every served tensor's checksum (SGLang's weights checker)."""
    status, body = _http(url, "/weights_checker", {"action": "checksum"})
    assert status == 200, body
    return body["ranks"][0]["checksums"]


def _greedy(url: str) -> tuple[list[int], np.ndarray, str]:
    """The server's greedy continuation of PROMPT: (output ids, their log-probs, weight version)."""
    status, d = _http(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert status == 200, d
    lps = np.array([e[0] for e in d["meta_info"]["output_token_logprobs"]])
    return d["output_ids"], lps, d["meta_info"]["weight_version"]


def _hf_logprobs(model_dir: Path, output: list[int]) -> np.ndarray:
    """Independent reference: transformers' full forward over PROMPT + output, log_softmax per position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(PROMPT) - 1:-1]
    return lp.gather(1, torch.tensor(output).view(-1, 1)).view(-1).numpy()


def _sync(url: str, group: str, **kw) -> NcclSync:
    return NcclSync([url], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                    bucket_bytes=BUCKET_BYTES, group_name=group, http_timeout=60.0, **kw)


def _start_server(model_dir: Path, timeout: float = 120.0) -> SimpleNamespace:
    return start_serve_process(model_dir, "--health-check-timeout", "10", "--enable-memory-saver", timeout=timeout)


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    """A second tiny checkpoint: same shapes, other values (seed 1)."""
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe_seed1"), seed=1)


@pytest.fixture(scope="module")
def server(tiny_hf_dir):
    srv = _start_server(tiny_hf_dir)
    yield srv
    stop_process(srv.proc)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under its HF names (per-expert names, as the trainer exports them)."""
    return load_file(str(model_dir / "model.safetensors"))


# ------------------------------------------------------------------------------- tests
def test_sync_over_gloo_in_both_load_formats(server, tiny_hf_dir, new_dir):
    new, old = _weights(new_dir), _weights(tiny_hf_dir)
    assert len(plan_buckets([TensorMeta.of(n, t) for n, t in new.items()], BUCKET_BYTES)) >= 5
    sync = _sync(server.url, "sync_formats")
    try:
        t0 = time.monotonic()
        assert sync.sync(1, new.items()) == len(new)          # flattened buckets
        took = time.monotonic() - t0
        out, lps, version = _greedy(server.url)
        assert version == "1"
        # the served model is now the seed-1 checkpoint: its log-probs are transformers' on those weights
        np.testing.assert_allclose(lps, _hf_logprobs(new_dir, out), atol=1e-4, rtol=0)
        assert np.abs(lps - _hf_logprobs(tiny_hf_dir, out)).max() > 1e-2  # and not the old one's
        assert _http(server.url, "/model_info")[1]["weight_version"] == "1"

        sync.load_format = None                                 # one broadcast per tensor, same group
        assert sync.sync(2, old.items()) == len(old)
        out, lps, version = _greedy(server.url)
        assert version == "2" and _http(server.url, "/get_model_info")[1]["weight_version"] == "2"
        np.testing.assert_allclose(lps, _hf_logprobs(tiny_hf_dir, out), atol=1e-4, rtol=0)
    finally:
        sync.close()
    print(f"flattened sync of {sum(t.nbytes for t in new.values())} bytes: {took:.2f} s")


@pytest.mark.parametrize("bad, needle", [
    (("model.layers.0.mlp.experts.9.gate_proj.weight", torch.zeros(32, 64)),
     "unknown parameter 'model.layers.0.mlp.experts.9.gate_proj.weight'"),
    (("model.norm.weight", torch.ones(65)), "model.norm.weight: shape (65,), expected (64,)"),
])
def test_a_bad_name_or_shape_is_refused_and_the_old_weights_serve(server, new_dir, bad, needle):
    before, sums = _greedy(server.url), _checksums(server.url)
    pairs = {**_weights(new_dir), bad[0]: bad[1]}  # the new weights with one bad tensor among them
    sync = _sync(server.url, "sync_bad")
    sync.bucket_bytes = 1 << 30  # one bucket: the refusal covers every tensor of it
    try:
        with pytest.raises(WeightSyncError, match="Failed to update parameter online") as err:
            sync.sync(7, pairs.items())
        assert needle in str(err.value)
        after = _greedy(server.url)
        assert after[0] == before[0] and after[2] == before[2] != "7"
        assert _checksums(server.url) == sums                # not one weight changed
        # the same log-probs: within the prefix cache's tolerance, as the second request may hit it
        np.testing.assert_allclose(after[1], before[1], atol=1e-5, rtol=0)
        # the session was closed by the failed sync: the next one goes through
        good = dict(_weights(new_dir))
        sync.sync(8, good.items())
        assert _greedy(server.url)[2] == "8"
    finally:
        sync.close()


def test_release_refuses_generation_and_weight_loads_until_resume(server, new_dir):
    url = server.url
    assert _http(url, "/release_memory_occupation", {}) == (200, None)      # SGLang: null body
    assert _http(url, "/release_memory_occupation", method="GET")[0] == 200  # twice: a no-op
    status, d = _http(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 400 and "released" in d["error"]["message"] \
        and "/resume_memory_occupation" in d["error"]["message"]
    assert _http(url, "/health_generate")[0] == 503 and _http(url, "/health")[0] == 200
    info = _http(url, "/server_info")[1]
    assert info["internal_states"][0]["memory_released"] == ["kv_cache", "weights", "cuda_graph"]
    sync = _sync(url, "sync_released")
    try:  # the server still takes the broadcast, then refuses to load: an error, no hang
        with pytest.raises(WeightSyncError, match=r"released"):
            sync.sync(3, _weights(new_dir).items())
        # verl's order: weights back first, weight update, then the KV cache
        assert _http(url, "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
        assert _http(url, "/generate", {"input_ids": PROMPT})[0] == 400        # KV cache still released
        sync.sync(4, _weights(new_dir).items())
    finally:
        sync.close()
    assert _http(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) == (200, None)
    assert _greedy(url)[2] == "4"
    status, d = _http(url, "/resume_memory_occupation", {})                    # nothing released
    assert status == 400 and "not released" in d["error"]["message"]
    status, d = _http(url, "/release_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and "unknown memory tags ['gpu']" in d["error"]["message"]
    assert _http(url, "/health_generate")[0] == 200


def test_probe_and_info_endpoints(server, tiny_hf_dir):
    url = server.url
    assert _http(url, "/health_generate") == (200, b"")
    for path in ("/server_info", "/get_server_info"):
        status, info = _http(url, path)
        assert status == 200
        assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1)
        assert info["model_path"] == str(tiny_hf_dir) and info["port"] == int(url.rsplit(":", 1)[1])
        assert info["context_length"] == 512 and info["max_req_input_len"] == 511
    status, d = _http(url, "/update_weight_version", {"new_version": "relabelled"})
    assert (status, d["success"], d["new_version"]) == (200, True, "relabelled")
    assert _http(url, "/model_info")[1]["weight_version"] == "relabelled"
    assert _greedy(url)[2] == "relabelled"


def test_session_and_group_lifecycle(server, tiny_hf_dir):
    url = server.url
    # the session rules of SGLang 0.5.23's scheduler
    assert _http(url, "/begin_weight_update", {})[1]["success"] is True
    status, d = _http(url, "/begin_weight_update", {})
    assert status == 400 and "already open" in d["message"]
    assert _http(url, "/end_weight_update", {})[0] == 200
    status, d = _http(url, "/end_weight_update", {})
    assert status == 400 and "no weight-update session is open" in d["message"]
    # malformed requests name the field
    status, d = _http(url, "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
                                                                 "shapes": [[1], [2]]})
    assert status == 400 and "names, dtypes and shapes" in d["error"]["message"]
    status, d = _http(url, "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["floaty"],
                                                                 "shapes": [[1]]})
    assert status == 400 and "dtypes[0] (a)" in d["error"]["message"]
    status, d = _http(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                          "rank_offset": 0, "world_size": 2})
    assert status == 400 and "rank_offset must be in [1, world_size)" in d["error"]["message"]
    status, d = _http(url, "/destroy_weights_update_group", {"group_name": "never_made"})
    assert (status, d["success"], d["message"]) == (400, False, "The group to be destroyed does not exist.")

    weights = _weights(tiny_hf_dir)
    first = _sync(url, "sync_cycle")
    first.sync(10, weights.items())
    # a second init of a live group is refused at once (the trainer is not left waiting)
    status, d = _http(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                          "rank_offset": 1, "world_size": 2,
                                                          "group_name": first.group_name, "backend": "gloo"})
    assert status == 400 and "already exists" in d["message"]
    # a trainer that skips begin/end (an SGLang before 0.5.23) is refused after the broadcast
    first._session = False
    with pytest.raises(WeightSyncError, match="must run between begin_weight_update"):
        first.sync(11, weights.items())
    first.close()                                             # destroy on both sides ...
    again = _sync(url, "sync_cycle")                          # ... and a group forms again
    try:
        again.sync(12, weights.items())
        assert _greedy(url)[2] == "12"
    finally:
        again.close()


def test_a_sync_while_generating_fails_on_the_cache_flush_as_sglang(server, tiny_hf_dir):
    url = server.url
    assert _http(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    parked: dict = {}
    th = threading.Thread(target=lambda: parked.update(r=_http(url, "/generate", {"input_ids": PROMPT})),
                          daemon=True)
    th.start()  # a request inside the engine, waiting for /continue_generation
    sync = _sync(url, "sync_busy")
    try:
        deadline = time.monotonic() + 20
        while not _http(url, "/server_info")[1]["internal_states"][0]["generating"]:
            assert time.monotonic() < deadline, "the parked request never reached the engine"
            time.sleep(0.05)
        with pytest.raises(WeightSyncError, match="Weights were updated, but the cache was not flushed"):
            sync.sync(20, _weights(tiny_hf_dir).items())
        assert _http(url, "/model_info")[1]["weight_version"] == "20"  # loaded all the same, as SGLang
    finally:
        _http(url, "/continue_generation", {})
        th.join(30)
        sync.close()
    assert parked["r"][0] == 200
    sync = _sync(url, "sync_idle")
    try:  # idle again: the same sync passes
        sync.sync(21, _weights(tiny_hf_dir).items())
    finally:
        sync.close()


# ----------------------------------------------------------------- in-process engine checks
@pytest.fixture(scope="module")
def local(tiny_hf_dir):
    eng = LocalEngine(tiny_hf_dir, seed=0, memory_saver=True)
    yield eng
    eng.close()


def _park_a_generation(eng: LocalEngine) -> threading.Thread:
    """Pause the engine in place and start a generate call, which then waits holding the engine."""
    eng.pause_generation("in_place")
    th = threading.Thread(target=eng.generate, args=([GenerateRequest(PROMPT, SamplingParams(max_new_tokens=2))],),
                          daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not eng._gen_lock.locked():  # the call has entered the engine
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return th


def test_release_needs_an_idle_engine(local):
    th = _park_a_generation(local)
    try:
        with pytest.raises(ValueError, match="needs an idle engine"):
            local.release_memory_occupation()
        assert local.memory_released == []
    finally:
        local.continue_generation()
        th.join(30)
    local.release_memory_occupation(["weights"])
    with pytest.raises(MemoryReleasedError, match="memory \\['weights'\\] is released"):
        local.update_weights_from_tensors({"model.norm.weight": torch.ones(64)})
    local.resume_memory_occupation(["weights"])


def _engine_greedy(eng: LocalEngine) -> tuple[list[int], np.ndarray]:
    out = eng.generate([GenerateRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                               ignore_eos=True))])[0][0]
    return out.output_ids, np.asarray(out.output_logprobs)


@pytest.mark.parametrize("flags, tags, kept", [
    ({}, None, False),                                # SGLang 0.5.23's default: the weights are gone
    ({}, ["weights"], False),
    ({}, ["kv_cache", "cuda_graph"], True),           # the weights region was never paused
    ({"weights_cpu_backup": True}, None, True),       # --enable-weights-cpu-backup keeps them
])
def test_released_weights_are_lost_unless_backed_up(tiny_hf_dir, flags, tags, kept):
    eng = LocalEngine(tiny_hf_dir, seed=0, memory_saver=True, **flags)
    try:
        ids, lps = _engine_greedy(eng)
        np.testing.assert_allclose(lps, _hf_logprobs(tiny_hf_dir, ids), atol=1e-5)
        eng.release_memory_occupation(tags)
        eng.release_memory_occupation(tags)  # twice: a no-op, not a second loss
        eng.resume_memory_occupation(tags)
        after_ids, after_lps = _engine_greedy(eng)
        if kept:
            assert after_ids == ids
            np.testing.assert_allclose(after_lps, lps, atol=1e-6)
        else:  # sampling from what the region holds after resume: not the checkpoint's model
            assert np.abs(after_lps - _hf_logprobs(tiny_hf_dir, after_ids)).max() > 0.1
            eng.update_weights_from_disk(tiny_hf_dir)  # a load brings them back
            assert _engine_greedy(eng)[0] == ids
    finally:
        eng.close()


def test_release_without_the_memory_saver_is_refused(tiny_hf_dir):
    eng = LocalEngine(tiny_hf_dir, seed=0)
    try:
        with ServerThread(eng) as srv:
            status, d = _http(srv.url, "/release_memory_occupation", {})
            assert status == 400 and "--enable-memory-saver" in d["error"]["message"]
            assert _http(srv.url, "/server_info")[1]["enable_memory_saver"] is False
            assert _greedy(srv.url)[2] == "default"  # nothing was released
    finally:
        eng.close()


def test_health_generate_fails_on_a_wedged_engine(local):
    with ServerThread(local, health_timeout=1.0) as srv:
        assert _http(srv.url, "/health_generate") == (200, b"")
        th = _park_a_generation(local)  # the engine stops stepping: a stand-in for a wedged one
        try:
            t0 = time.monotonic()
            assert _http(srv.url, "/health_generate")[0] == 503
            assert 0.9 < time.monotonic() - t0 < 5
            assert _http(srv.url, "/health")[0] == 200   # /health does not generate, as SGLang
        finally:
            local.continue_generation()
            th.join(30)
        assert _http(srv.url, "/health_generate")[0] == 200


def _generating(url: str) -> bool:
    return bool(_http(url, "/server_info")[1]["internal_states"][0]["generating"])


def _long_generate(url: str, out: dict) -> threading.Thread:
    """A /generate of 400 tokens in a thread (streamed: its last event is the whole reply), returned once two
    of its tokens were sent: a pause from then on finds it decoding, past its first token (which SGLang's
    overlap schedule would still hold in flight, and label with the next version)."""
    started = threading.Event()

    def run() -> None:
        req = urllib.request.Request(url + "/generate", data=json.dumps({
            "input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            events = []
            for line in r:
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[len(b"data: "):]))
                    if len(events) == 2:
                        started.set()
            out["r"] = (r.status, events[-1])

    th = threading.Thread(target=run, daemon=True)
    th.start()
    assert started.wait(20), "the request never reached the engine"
    return th


def test_a_weight_update_waits_for_running_requests_unless_paused(server, tiny_hf_dir):
    # SGLang's model_update_lock: an update waits for the running requests, whose tokens all come from
    # the old weights; paused (in place), it loads at once and the request's tokens span both versions
    url = server.url
    assert _http(url, "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "30"})[0] == 200
    done: dict = {}
    th = _long_generate(url, done)
    status, reply = _http(url, "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "31"})
    assert status == 200 and reply["success"], reply
    th.join(30)  # its reply is written once it left the engine: the update went first, or the spans say so
    meta = done["r"][1]["meta_info"]
    assert meta["weight_versions"] == [{"version": "30", "start": 0, "end": 400}] and meta["weight_version"] == "30"

    done.clear()
    th = _long_generate(url, done)
    assert _http(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:  # the cache of the parked request cannot be flushed: asking for it fails the call, as SGLang
        status, reply = _http(url, "/update_weights_from_disk", {"model_path": str(tiny_hf_dir)})
        assert status == 400 and "the cache was not flushed" in reply["message"]
        status, reply = _http(url, "/update_weights_from_disk",
                              {"model_path": str(tiny_hf_dir), "weight_version": "32", "flush_cache": False})
        assert status == 200 and reply["success"] and th.is_alive()  # loaded under the parked request
    finally:
        _http(url, "/continue_generation", {})
        th.join(60)
    spans = done["r"][1]["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["31", "32"] and spans[0]["start"] == 0 and spans[-1]["end"] == 400
    assert spans[0]["end"] == spans[1]["start"] > 0
    assert done["r"][1]["meta_info"]["num_retractions"] == 0

    done.clear()  # retracted, the request holds no cache: the flush SGLang does after the load succeeds
    th = _long_generate(url, done)
    assert _http(url, "/pause_generation", {"mode": "retract"})[0] == 200
    try:
        status, reply = _http(url, "/update_weights_from_disk", {"model_path": str(tiny_hf_dir), "weight_version": "33"})
        assert status == 200 and reply["success"] and th.is_alive(), reply
    finally:
        _http(url, "/continue_generation", {})
        th.join(60)
    meta = done["r"][1]["meta_info"]
    assert [s["version"] for s in meta["weight_versions"]] == ["32", "33"] and meta["num_retractions"] == 1


@pytest.mark.parametrize("lag", [1, 0])
def test_an_in_place_push_keeps_the_paused_sample_across_two_versions(server, tiny_hf_dir, lag):
    # rollout.inflight_update=in_place: pause in place, push without a flush, continue. The sample
    # finishes under the new weights; the client keeps it when the previous version may appear
    # (version_lag 1), and generates it again from the new weights when not (0)
    from moe_rl.rollout.sglang_client import SGLangClient

    with SGLangClient([server.url], flush_on_update=False, pushes_in_place=True, version_lag=lag,
                      probe_interval=0.2) as client:
        client.update_weights_from_disk(tiny_hf_dir, f"4{lag}0")
        out: dict = {}
        req = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=400, ignore_eos=True))
        th = threading.Thread(target=lambda: out.update(r=client.generate([req])), daemon=True)
        th.start()
        deadline = time.monotonic() + 20
        while not _generating(server.url):
            assert time.monotonic() < deadline and th.is_alive(), "the request never reached the engine"
            time.sleep(0.01)
        # past its first token, which SGLang's overlap schedule would still hold in flight at the pause and
        # label with the next version (400 tokens take seconds: 0.3 s leaves no doubt)
        time.sleep(0.3)
        client.pause_generation("in_place")
        try:
            client.update_weights_from_disk(tiny_hf_dir, f"4{lag}1")  # no flush asked: it passes
        finally:
            client.continue_generation()
        th.join(60)
    spans = out["r"][0][0].weight_versions
    if lag:
        assert [v for v, _, _ in spans] == [f"4{lag}0", f"4{lag}1"] and spans[-1][2] == 400
    else:
        assert spans == ((f"4{lag}1", 0, 400),)
