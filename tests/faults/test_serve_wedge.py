"""`moe-rl serve` against requests that would wedge it: a huge request does not hold small ones back,
a client that goes away stops costing generation, and /health_generate reports a stuck engine."""
from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from moe_rl.rollout.local_engine import LocalEngine
from moe_rl.rollout.server import ServerThread

MAX_BATCH = 4


@pytest.fixture(scope="module")
def engine(tiny_hf_dir):
    eng = LocalEngine(tiny_hf_dir, max_batch=MAX_BATCH)
    rows: list[int] = []
    real = eng.generate

    def counting(reqs):  # what the server asks the engine for, call by call
        rows.append(sum(r.sampling.n for r in reqs))
        return real(reqs)

    eng.generate = counting
    eng.rows = rows
    yield eng
    eng.close()


def _body(prompts: int, tokens: int) -> dict:
    return {"input_ids": [[1 + i % 9, 2, 3] for i in range(prompts)],
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0}}


async def _post(session: aiohttp.ClientSession, url: str, body: dict, timeout: float = 300) -> float:
    async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return time.monotonic()


def test_small_request_is_not_held_behind_a_huge_one(engine):
    with ServerThread(engine, max_batch=MAX_BATCH) as srv:
        async def go() -> tuple[float, float]:
            async with aiohttp.ClientSession() as s:
                huge = asyncio.ensure_future(_post(s, srv.url, _body(10 * MAX_BATCH, 24)))
                await asyncio.sleep(0.3)  # the huge one is in the engine
                small = await _post(s, srv.url, _body(1, 2))
                return small, await huge
        small_done, huge_done = asyncio.run(go())
    assert small_done < huge_done
    # calls join an engine call until it holds max_batch samples: never two huge chunks at once
    assert max(engine.rows) < 2 * MAX_BATCH


def test_client_gone_stops_its_generation(engine):
    with ServerThread(engine, max_batch=MAX_BATCH) as srv:
        engine.rows.clear()

        async def go() -> None:
            async with aiohttp.ClientSession() as s:
                with pytest.raises(asyncio.TimeoutError):
                    await _post(s, srv.url, _body(20 * MAX_BATCH, 64), timeout=0.5)
        asyncio.run(go())
        at_disconnect = sum(engine.rows)
        time.sleep(2.0)
    generated = sum(engine.rows)  # stopping the server waited for every call still running
    # 80 prompts were asked for; after the client left at most the chunk then in the engine ran
    assert generated <= at_disconnect + MAX_BATCH and generated < 20 * MAX_BATCH, engine.rows


def test_health_generate_fails_while_generation_is_stuck(engine):
    with ServerThread(engine, max_batch=MAX_BATCH, health_timeout=2.0) as srv:
        def status() -> int:
            try:
                with urllib.request.urlopen(srv.url + "/health_generate", timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        def healthy() -> bool:  # a loaded machine may miss one 2 s window; a working engine not three
            return any(status() == 200 for _ in range(3))

        assert healthy()
        engine.pause_generation("in_place")  # the scheduler makes no progress: a wedged engine
        time.sleep(0.5)  # a decode step already under way (e.g. a chunk an earlier test left) ends first
        try:
            assert status() == 503
            with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
                assert r.status == 200  # the plain liveness check cannot tell, as in SGLang
        finally:
            engine.continue_generation()
        assert healthy()
