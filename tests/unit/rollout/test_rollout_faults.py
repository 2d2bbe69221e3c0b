"""SGLangClient against misbehaving servers: every failure is a clear RolloutError, never a hang."""
from __future__ import annotations

import asyncio
import base64
import threading
import time

import numpy as np
import pytest
from aiohttp import web

from moe_rl.rollout.engine import GenerateRequest, RolloutError, SamplingParams
from moe_rl.rollout.sglang_client import SGLangClient

LAYERS, TOPK, EXPERTS = 2, 2, 4


def _sample(prompt: list[int], n_out: int, route_rows: int | None = None) -> dict:
    """One /generate sample as SGLang shapes it (tokenizer_manager._handle_batch_output)."""
    out = list(range(10, 10 + n_out))
    rows = len(prompt) + n_out - 1 if route_rows is None else route_rows
    routes = np.tile(np.arange(TOPK, dtype=np.int32), (rows, LAYERS, 1))
    return {"output_ids": out, "meta_info": {
        "id": "x", "finish_reason": {"type": "length", "length": n_out}, "prompt_tokens": len(prompt),
        "weight_version": "default", "output_token_logprobs": [[-1.0, t, None] for t in out],
        "completion_tokens": n_out, "routed_experts": base64.b64encode(routes.tobytes()).decode()}}


class FakeServer:
    """A tiny aiohttp server in a thread; `mode` picks how /generate misbehaves."""

    def __init__(self, mode: str, port: int = 0):
        self.mode, self.calls, self.port = mode, 0, port
        self.version, self.updates, self.update_status = "default", [], 200
        self.first_token_version: str | None = None
        self.wedged = False   # /health still answers 200, /health_generate does not (a stuck scheduler)
        self.old_api = False  # an SGLang before 0.5.23: /get_model_info only
        self.forward_to: "FakeServer | None" = None  # a router: samples come from this worker's weights
        self.paths: list[str] = []
        self.admin_calls: list[str] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._start())
        self.loop.run_forever()

    async def _start(self) -> None:
        self.release = asyncio.Event()
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/health", lambda r: web.Response())
        app.router.add_get("/health_generate", lambda r: web.Response(status=503 if self.wedged else 200))
        app.router.add_get("/model_info", lambda r: web.Response(status=404) if self.old_api else self._info())
        app.router.add_get("/get_model_info", lambda r: self._info())
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/update_weights_from_disk", self._update)
        for path in ("/release_memory_occupation", "/resume_memory_occupation", "/pause_generation",
                     "/continue_generation"):
            app.router.add_post(path, self._admin)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()

    @web.middleware
    async def _record(self, request: web.Request, handler):
        self.paths.append(request.path)
        return await handler(request)

    def _info(self) -> web.Response:
        return web.json_response(
            {"model_path": "fake", "num_hidden_layers": LAYERS, "num_experts_per_tok": TOPK,
             "num_experts": EXPERTS, "moe_layer_ids": list(range(LAYERS)), "weight_version": self.version})

    async def _admin(self, request: web.Request) -> web.Response:
        self.admin_calls.append(request.path)
        return web.json_response({"success": True})

    async def _update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.updates.append(body)
        if self.update_status != 200:
            return web.Response(status=self.update_status, text="Service Unavailable")
        self.version = body.get("weight_version", self.version)
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        prompt = body["input_ids"]
        n_out = body["sampling_params"]["max_new_tokens"]
        if self.mode == "ok":
            sample = _sample(prompt, n_out)
            sample["meta_info"]["weight_version"] = version = (self.forward_to or self).version
            if self.first_token_version is not None and n_out > 1:  # the weights changed after token 1
                sample["meta_info"]["weight_versions"] = [
                    {"version": self.first_token_version, "start": 0, "end": 1},
                    {"version": version, "start": 1, "end": n_out}]
            return web.json_response(sample)
        if self.mode == "500":
            return web.json_response({"error": {"message": "CUDA error: an illegal memory access"}}, status=500)
        if self.mode == "400":
            return web.json_response({"error": {"message": "max_new_tokens is too large"}}, status=400)
        if self.mode == "badjson":
            return web.Response(text="{not json", content_type="application/json")
        if self.mode == "routes":
            return web.json_response(_sample(prompt, n_out, route_rows=len(prompt) + n_out))
        if self.mode == "hang":
            try:
                await asyncio.wait_for(self.release.wait(), 60)
            except asyncio.TimeoutError:
                pass
            return web.Response(status=503)
        raise AssertionError(self.mode)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def fake(request):
    servers = []

    def make(mode, port=0):
        servers.append(FakeServer(mode, port))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def _client(urls, **kw) -> SGLangClient:
    kw = {"request_timeout": 5.0, "max_attempts": 2, "backoff_base": 0.01, "probe_interval": 0.05,
          "no_server_timeout": 5.0, **kw}
    return SGLangClient(urls, **kw)


REQ = [GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4))]


def test_fake_server_ok_shapes(fake):
    s = fake("ok")
    with _client([s.url]) as c:
        (res,), = c.generate(REQ)
    assert res.output_ids == [10, 11, 12, 13] and res.routed_experts.shape == (6, LAYERS, TOPK)
    assert res.routed_experts.dtype == np.uint8 and res.server == s.url


@pytest.mark.parametrize("mode, pattern", [
    ("500", r"HTTP 500.*illegal memory access"),
    ("badjson", r"invalid JSON"),
    ("routes", r"routed_experts has 7 rows, expected \[len\(prompt \+ output\) - 1 = 6"),
    ("400", r"refused /generate \(HTTP 400\): max_new_tokens is too large"),
])
def test_misbehaving_server_gives_clear_error(fake, mode, pattern):
    s = fake(mode)
    with _client([s.url]) as c, pytest.raises(RolloutError, match=pattern) as ei:
        c.generate(REQ)
    assert s.url in str(ei.value)
    # 5xx is retried (max_attempts=2); protocol errors fail at once
    assert s.calls == (2 if mode == "500" else 1)


def test_hung_server_times_out(fake):
    s = fake("hang")
    t0 = time.monotonic()
    with _client([s.url], request_timeout=0.5) as c, pytest.raises(RolloutError, match="within 0.5 s") as ei:
        c.generate(REQ)
    assert time.monotonic() - t0 < 10
    assert s.url in str(ei.value)


def test_failover_from_failing_server(fake):
    bad, good = fake("500"), fake("ok")
    reqs = [GenerateRequest([1, 2, k], SamplingParams(max_new_tokens=3)) for k in range(8)]
    with _client([bad.url, good.url], max_attempts=3) as c:
        out = c.generate(reqs)
        assert not c.server_states()[bad.url]["healthy"] or bad.calls >= 1
    assert all(len(r) == 1 and r[0].server == good.url for r in out)


def test_unreachable_server_is_reported():
    from moe_rl.testing import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with _client([url], no_server_timeout=0.5) as c, pytest.raises(RolloutError) as ei:
        c.generate(REQ)
    assert url in str(ei.value)


def test_server_that_missed_a_weight_update_is_resynced_before_use(fake):
    a, b = fake("ok"), fake("ok")
    b.update_status = 503                      # b cannot take the update now
    with _client([a.url, b.url]) as c:
        c.update_weights_from_disk("/ckpt/step1", version="v1")
        assert not c.server_states()[b.url]["healthy"]
        out = c.generate(REQ * 4)
        assert {r[0].weight_version for r in out} == {"v1"} and {r[0].server for r in out} == {a.url}
        b.update_status = 200                  # b is back: the next probe re-applies the update
        deadline = time.monotonic() + 5
        while not c.server_states()[b.url]["healthy"] and time.monotonic() < deadline:
            c.generate(REQ)
            time.sleep(0.05)
        assert c.server_states()[b.url]["healthy"]
        assert b.version == "v1" and [u["model_path"] for u in b.updates] == ["/ckpt/step1"] * 2
        out = c.generate(REQ * 8)
    assert {r[0].weight_version for r in out} == {"v1"}
    assert {r[0].server for r in out} == {a.url, b.url}


def test_weight_update_refused_everywhere_raises(fake):
    a = fake("ok")
    a.update_status = 503
    with _client([a.url]) as c, pytest.raises(RolloutError, match="failed on every server") as ei:
        c.update_weights_from_disk("/ckpt/bad", version="v9")
    assert a.url in str(ei.value) and a.version == "default"


def test_weight_update_with_every_server_down_waits_for_one_back_with_the_weights(fake):
    from moe_rl.testing import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    back: list[FakeServer] = []
    with _client([url], no_server_timeout=20) as c:
        c.update_weights_from_disk("/ckpt/step2", version="v2")  # nobody answers (restarting): no error
        assert not c.server_states()[url]["healthy"]
        threading.Timer(0.5, lambda: back.append(fake("ok", port))).start()  # the restarted server
        out = c.generate(REQ)                                      # waits for it
    assert out[0][0].weight_version == "v2"                        # it served only after taking them
    assert back[0].updates == [{"model_path": "/ckpt/step2", "weight_version": "v2"}]


def test_weight_update_with_every_server_down_and_none_back_fails_the_next_call():
    from moe_rl.testing import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with _client([url], no_server_timeout=0.5) as c:
        c.update_weights_from_disk("/ckpt/step2", version="v2")
        with pytest.raises(RolloutError, match="no healthy SGLang server") as ei:
            c.generate(REQ)
    assert url in str(ei.value)


def test_server_serving_stale_weights_is_resynced_and_its_samples_retried(fake):
    a, b = fake("ok"), fake("ok")
    with _client([a.url, b.url], max_attempts=4) as c:
        c.update_weights_from_disk("/ckpt/step1", version="v1")
        b.version = "default"                  # restarted behind the client's back: initial weights
        out = c.generate(REQ * 8)
        assert {r[0].weight_version for r in out} == {"v1"}  # no sample of the stale weights is kept
        deadline = time.monotonic() + 5
        while b.version != "v1" and time.monotonic() < deadline:
            c.generate(REQ)                    # probes bring b back with the weights
            time.sleep(0.05)
    assert b.version == "v1" and [u["model_path"] for u in b.updates] == ["/ckpt/step1"] * 2


def test_a_sample_with_a_stale_span_is_retried(fake):
    # the sample ends under the pushed weights but its first token came from others (SGLang's
    # weight_versions spans): it is stale all the same, and only whole-version samples are kept
    a, b = fake("ok"), fake("ok")
    with _client([a.url, b.url], max_attempts=4) as c:
        c.update_weights_from_disk("/ckpt/step1", version="v1")
        b.first_token_version = "default"
        out = c.generate(REQ * 8)
    assert all(r[0].weight_versions in (None, (("v1", 0, len(r[0].output_ids)),)) for r in out)
    assert {r[0].server for r in out} == {a.url}


def test_worker_behind_a_router_serving_stale_weights_gets_them_before_the_retry(fake):
    worker, router = fake("ok"), fake("ok")
    router.forward_to = worker
    with _client([router.url], admin_urls=[worker.url], max_attempts=3) as c:
        c.update_weights_from_disk("/ckpt/step1", version="v1")
        worker.version = "default"             # the worker restarted; the router sends it requests
        out = c.generate(REQ)
    assert out[0][0].weight_version == "v1"
    assert worker.version == "v1" and len(worker.updates) == 2 and not router.updates


def test_a_pause_around_a_push_skips_a_dead_server_and_takes_it_out_of_rotation(fake):
    # an asynchronous run pauses the servers before each push: one that died must not fail the step
    # (its requests are sent again); it serves again only after its probe re-applies the weights
    from moe_rl.testing import free_port

    live, dead = fake("ok"), f"http://127.0.0.1:{free_port()}"
    with _client([live.url, dead]) as c:
        c.pause_generation("retract")
        c.update_weights_from_disk("/ckpt/step1", version="v1")
        c.continue_generation()
        assert not c.server_states()[dead]["healthy"] and c.server_states()[live.url]["healthy"]
        out = c.generate(REQ * 2)
    assert live.admin_calls == ["/pause_generation", "/continue_generation"]
    assert {r[0].server for r in out} == {live.url} and {r[0].weight_version for r in out} == {"v1"}


def test_colocated_memory_release_and_resume_reach_every_server(fake):
    servers = [fake("ok"), fake("ok")]
    client = _client([s.url for s in servers])
    try:
        client.release_memory_occupation()
        client.resume_memory_occupation()
    finally:
        client.close()
    for s in servers:
        assert s.admin_calls == ["/release_memory_occupation", "/resume_memory_occupation"]


def test_model_info_falls_back_to_its_deprecated_name_on_older_servers(fake):
    new, old = fake("ok"), fake("ok")
    old.old_api = True
    for s in (new, old):
        with _client([s.url]) as c:
            (res,), = c.generate(REQ)  # the routes' geometry comes from the model info
            assert res.routed_experts.shape == (6, LAYERS, TOPK)
            assert c.get_model_info()["num_hidden_layers"] == LAYERS
    assert "/model_info" in new.paths and "/get_model_info" not in new.paths
    assert old.paths.count("/model_info") == old.paths.count("/get_model_info") == 2


def test_wedged_server_answering_health_stays_out_of_rotation(fake):
    a, b = fake("ok"), fake("500")
    reqs = [GenerateRequest([1, 2, k], SamplingParams(max_new_tokens=3)) for k in range(4)]
    with _client([a.url, b.url], max_attempts=3) as c:
        c.generate(reqs)
        assert not c.server_states()[b.url]["healthy"]
        b.mode, b.wedged = "ok", True           # /health says 200, but it cannot generate
        for _ in range(10):
            assert {r[0].server for r in c.generate(reqs)} == {a.url}
            time.sleep(0.06)                     # > probe_interval: b is re-probed every round
        assert not c.server_states()[b.url]["healthy"] and b.paths.count("/health_generate") >= 3
        assert "/health" not in b.paths          # the quick /health is never taken as recovery
        b.wedged = False
        deadline = time.monotonic() + 5
        while not c.server_states()[b.url]["healthy"] and time.monotonic() < deadline:
            c.generate(reqs)
            time.sleep(0.06)
        assert c.server_states()[b.url]["healthy"]


def test_released_servers_are_resumed_and_given_their_weights_before_the_next_generate(fake):
    servers = [fake("ok"), fake("ok")]
    with _client([s.url for s in servers]) as c:
        assert not c.released
        c.resume_memory_occupation()             # nothing released: no call at all
        assert all(s.admin_calls == [] for s in servers)
        c.update_weights_from_disk("/ckpt/step1", version="v1")
        c.generate(REQ)
        c.release_memory_occupation()
        assert c.released
        c.generate(REQ * 4)                      # e.g. an eval right after the training phase
        assert not c.released
        c.generate(REQ)
        c.resume_memory_occupation()             # already resumed by generate: no second call
    for s in servers:
        assert s.admin_calls == ["/release_memory_occupation", "/resume_memory_occupation"]
        # the resumed weights region holds no weights (SGLang 0.5.23): the last ones, loaded again
        assert [u["model_path"] for u in s.updates] == ["/ckpt/step1"] * 2
        later = s.paths[s.paths.index("/resume_memory_occupation"):]
        assert "/update_weights_from_disk" in later and "/generate" in later
        assert later.index("/update_weights_from_disk") < later.index("/generate")


def test_a_weight_update_after_the_resume_needs_no_reload(fake):
    """The training step's order: release, train, resume, push the new weights, generate."""
    server = fake("ok")
    with _client([server.url]) as c:
        c.release_memory_occupation()
        c.resume_memory_occupation()
        c.update_weights_from_disk("/ckpt/step2", version="v2")
        c.generate(REQ)
    assert [u["model_path"] for u in server.updates] == ["/ckpt/step2"]


def test_before_any_update_the_initial_weights_are_loaded_again(fake):
    server = fake("ok")
    with _client([server.url], initial_weights="/ckpt/initial") as c:
        c.generate(REQ)
        c.release_memory_occupation()            # e.g. the first step was skipped by dynamic sampling
        c.generate(REQ)
    assert [u["model_path"] for u in server.updates] == ["/ckpt/initial"]
    with _client([server.url]) as c:             # nothing known to load: refused, never garbage
        c.release_memory_occupation()
        with pytest.raises(RolloutError, match="lost their weights"):
            c.generate(REQ)
