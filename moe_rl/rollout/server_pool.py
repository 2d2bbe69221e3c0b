"""A pool of HTTP servers behind one client: health, retries, least-loaded picking.

`SGLangClient` (moe_rl/rollout/sglang_client.py) speaks SGLang's API over it; this module
holds what is not SGLang's: the private event loop sync callers submit to, the aiohttp
session, the servers' health and the choice of a server for each request.

What it does for robustness (SGLangClient's, through it):
- async aiohttp core with bounded concurrency (`max_concurrency` requests in flight);
- a per-request timeout (`request_timeout`): a hung server costs a timeout, never a hang;
- retries with exponential backoff and jitter, each attempt on the least-loaded
  healthy server, or the healthy server a request's affinity key hashes to (`affine`);
  a server that fails (connection error, timeout, HTTP 5xx / 429) is marked unhealthy
  and re-probed via GET /health_generate every `probe_interval` s (a wedged SGLang server
  still answers a plain /health with 200; /health_generate generates a token); a recovered server first gets the latest weights
  (`update_weights_from_disk`) when it missed an update;
- a sample is never dropped: it is retried elsewhere, or the call fails with a
  `RolloutError` naming the server URL and the error. Protocol errors (HTTP 4xx,
  a body that is not the expected JSON, routed experts of the wrong shape) are
  not retried: they fail at once, naming the server.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Sequence

import aiohttp

from moe_rl.rollout.auth import RunKeys
from moe_rl.rollout.engine import RolloutError
from moe_rl.rollout.sglang_api import HEALTH, HEALTH_GENERATE, error_text

log = logging.getLogger(__name__)


class Retryable(Exception):
    """A failure of one server that another server (or a later try) may not have."""


class Unreachable(Retryable):
    """No answer at all (connection refused or reset, timeout): the server is down or restarting."""


@dataclass(eq=False)  # one object per server: compared by identity
class Server:
    url: str
    healthy: bool = True
    inflight: int = 0
    next_probe: float = 0.0
    last_error: str | None = None
    probing: bool = False


def affine(key: str, servers: Sequence[Server]) -> Server:
    """The server `key` belongs to: the highest hash of (key, url) among `servers` (rendezvous hashing).
    A key stays on its server while that server is healthy, and when one leaves or comes back only
    its own keys move, so an episode's turns and a prompt group's samples keep finding their prefix
    in one server's cache. (The sglang-router balances by prefix itself, but R3 requests bypass it.)"""
    def score(s: Server) -> bytes:
        return hashlib.blake2b(f"{key}\0{s.url}".encode(), digest_size=8).digest()
    return max(servers, key=score)


class LoopThread:
    """A private asyncio loop in a daemon thread: sync callers submit coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-client", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()



class ServerPool:
    """Servers over HTTP: `urls` take the generate requests; `admin_urls` (default: `urls`) the
    calls every server must get (weight updates, pause, flush, memory). Behind a router, the
    admin servers are its workers. Subclasses (`SGLangClient`) add the API; `_on_recovered`
    is what a server we update directly must do before it serves again after a failure."""

    def __init__(self, urls: Sequence[str] | str, *, admin_urls: Sequence[str] | None = None,
                 max_concurrency: int = 64, request_timeout: float = 600.0, connect_timeout: float = 10.0,
                 max_attempts: int = 4, backoff_base: float = 0.5, backoff_max: float = 10.0,
                 probe_interval: float = 5.0, probe_timeout: float = 20.0, no_server_timeout: float = 60.0,
                 keys: RunKeys | None = None, served_name: str | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        # With a run id to check, a server is used only once a probe has seen it is ours.
        self._servers = [Server(u.rstrip("/"), healthy=served_name is None) for u in urls]
        admin = [u.rstrip("/") for u in (admin_urls or [])]
        # A router in front: `urls` are not the workers themselves.
        self._behind_router = bool(admin) and set(admin) != set(self.urls)
        self._admin = [Server(u, healthy=served_name is None) for u in admin] if self._behind_router \
            else self._servers
        self.max_concurrency = int(max_concurrency)
        self.request_timeout = float(request_timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_attempts = max(1, int(max_attempts))
        self.backoff_base, self.backoff_max = float(backoff_base), float(backoff_max)
        self.probe_interval, self.probe_timeout = float(probe_interval), float(probe_timeout)
        self.no_server_timeout = float(no_server_timeout)
        self.keys, self.served_name = keys, served_name
        self._rr = 0
        self._lt: LoopThread | None = None
        self._lt_lock = threading.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._health_changed: asyncio.Event | None = None

    async def _on_recovered(self, server: Server) -> None:
        """Called when a failed admin server answers again, before it is marked healthy."""

    # ------------------------------------------------------------------ plumbing
    def _loop_thread(self) -> LoopThread:
        with self._lt_lock:
            if self._lt is None:
                self._lt = LoopThread()
            return self._lt

    def _run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        fut = self._loop_thread().submit(coro)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()
            raise RolloutError(f"no result within {timeout:g} s (servers: {', '.join(self.urls)})") from None
        except KeyboardInterrupt:
            fut.cancel()
            raise

    async def _on_loop(self, coro: Coroutine) -> Any:
        """Await `coro` on the client's loop from any other loop."""
        return await asyncio.wrap_future(self._loop_thread().submit(coro))

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency + 2 * len(self._servers)))
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._health_changed = asyncio.Event()
        return self._session

    def close(self) -> None:
        if self._lt is None:
            return
        async def shutdown() -> None:
            me = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not me]
            for t in pending:  # probes still running
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if self._session is not None:
                await self._session.close()

        try:
            self._run(shutdown(), timeout=10)
        except Exception:  # noqa: BLE001
            pass
        self._lt.stop()
        self._lt, self._session = None, None

    def __enter__(self) -> "ServerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    def _all_servers(self) -> list[Server]:
        """The generate URLs, then the workers behind a router (each once)."""
        return self._servers + [s for s in self._admin if s not in self._servers]

    def server_states(self) -> dict[str, dict[str, Any]]:
        return {s.url: {"healthy": s.healthy, "inflight": s.inflight, "last_error": s.last_error}
                for s in self._all_servers()}

    async def _request(self, server: Server, method: str, path: str, payload: Any = None,
                       timeout: float | None = None) -> tuple[int, bytes]:
        """One HTTP call; connection problems and timeouts become `Retryable`."""
        session = self._ensure_session()
        t = self.request_timeout if timeout is None else timeout
        to = aiohttp.ClientTimeout(total=t, sock_connect=min(self.connect_timeout, t))
        try:
            headers = self.keys.header(path) if self.keys is not None else None
            async with session.request(method, server.url + path, json=payload, timeout=to,
                                       headers=headers) as resp:
                return resp.status, await resp.read()
        except asyncio.TimeoutError:
            raise Unreachable(f"no answer to {method} {path} within {t:g} s") from None
        except aiohttp.ClientError as e:
            raise Unreachable(f"{method} {path} failed: {type(e).__name__}: {e}") from None

    async def _json(self, server: Server, method: str, path: str, payload: Any = None,
                    timeout: float | None = None, ok_statuses: tuple[int, ...] = (200,)) -> Any:
        status, body = await self._request(server, method, path, payload, timeout)
        return self._decode(server, path, status, body, ok_statuses)

    def _decode(self, server: Server, path: str, status: int, body: bytes,
                ok_statuses: tuple[int, ...] = (200,)) -> Any:
        """A reply's JSON; 5xx / 408 / 429 are retryable, other refusals and bad JSON are not."""
        if status >= 500 or status in (408, 429):
            raise Retryable(f"HTTP {status} from {path}: {error_text(body)}")
        if status not in ok_statuses:
            raise RolloutError(f"server {server.url} refused {path} (HTTP {status}): {error_text(body)}")
        try:
            return json.loads(body)
        except ValueError as e:
            raise RolloutError(f"server {server.url} answered {path} with invalid JSON ({e}): "
                               f"{body[:200]!r}") from None

    # ------------------------------------------------------------- server health
    def _mark_unhealthy(self, server: Server, why: str) -> None:
        if server.healthy:
            log.warning("server %s marked unhealthy: %s", server.url, why)
        server.healthy = False
        server.last_error = why
        server.next_probe = time.monotonic() + self.probe_interval

    async def _probe(self, server: Server, path: str = HEALTH_GENERATE) -> bool:
        """GET `path`; on success bring the server's weights up to date, then mark it healthy.

        Failed servers are re-probed with /health_generate, which generates a token: SGLang's
        plain /health answers 200 even when the scheduler is wedged.
        """
        if server.probing:
            return server.healthy
        server.probing = True
        try:
            status, body = await self._request(server, "GET", path, timeout=self.probe_timeout)
            if status != 200:
                raise Retryable(f"{path} answered HTTP {status}")
            if not server.healthy and server in self._admin:  # a server we update directly, recovering
                await self._on_recovered(server)
            if not server.healthy and server.last_error is not None:  # not a first probe at start-up
                log.info("server %s is healthy again", server.url)
            server.healthy, server.last_error = True, None
            return True
        except (Retryable, RolloutError) as e:
            self._mark_unhealthy(server, str(e))
            return False
        finally:
            server.probing = False
            server.next_probe = time.monotonic() + self.probe_interval
            if self._health_changed is not None:
                self._health_changed.set()

    def _schedule_probes(self, pool: list[Server]) -> None:
        now = time.monotonic()
        for s in pool:
            if not s.healthy and not s.probing and s.next_probe <= now:
                asyncio.get_running_loop().create_task(self._probe(s))

    async def _pick(self, pool: list[Server] | None = None, affinity: str | None = None) -> Server:
        """The least-loaded healthy server of `pool` (default: the generate URLs), or with an `affinity`
        key the healthy server that key hashes to (`affine`); waits (probing) up to `no_server_timeout`
        for one."""
        pool = self._servers if pool is None else pool
        deadline = time.monotonic() + self.no_server_timeout
        while True:
            self._schedule_probes(pool)
            healthy = [s for s in pool if s.healthy]
            if healthy and affinity is not None:
                return affine(affinity, healthy)
            if healthy:
                low = min(s.inflight for s in healthy)
                best = [s for s in healthy if s.inflight == low]
                self._rr += 1
                return best[self._rr % len(best)]
            left = deadline - time.monotonic()
            if left <= 0:
                why = "; ".join(f"{s.url}: {s.last_error}" for s in pool)
                raise RolloutError(f"no healthy SGLang server for {self.no_server_timeout:g} s ({why})")
            assert self._health_changed is not None
            self._health_changed.clear()
            try:
                await asyncio.wait_for(self._health_changed.wait(),
                                       timeout=min(left, max(0.05, self.probe_interval / 2)))
            except asyncio.TimeoutError:
                pass

    async def _ahealth(self) -> bool:
        self._ensure_session()
        res = await asyncio.gather(*(self._probe(s, HEALTH) for s in self._all_servers()))
        front = res[:len(self._servers)]
        workers = [ok for s, ok in zip(self._all_servers(), res) if s in self._admin]
        return any(front) and (not self._behind_router or any(workers))

    def health(self) -> bool:
        """Quick liveness: probe every server now with GET /health. True when at least one
        generate URL answers (and, behind a router, at least one worker too)."""
        return bool(self._run(self._ahealth()))

    async def _check_each(self, servers: list[Server], check: Callable[[Server], Awaitable[None]]) -> None:
        """`check` every server at once; one whose check fails goes out of rotation."""
        async def one(s: Server) -> None:
            try:
                await check(s)
            except (Retryable, RolloutError) as e:
                self._mark_unhealthy(s, str(e))
        await asyncio.gather(*(one(s) for s in servers))

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)

    # --------------------------------------------------------------- admin calls
    async def _broadcast(self, method: str, path: str, payload: Any = None, json_reply: bool = True) -> list[Any]:
        self._ensure_session()

        async def one(s: Server) -> Any:
            try:
                if json_reply:
                    return await self._json(s, method, path, payload)
                status, body = await self._request(s, method, path, payload)
                if status != 200:
                    raise RolloutError(f"server {s.url} refused {path} (HTTP {status}): {error_text(body)}")
                return body.decode("utf-8", "replace")
            except Retryable as e:
                raise RolloutError(f"server {s.url}: {e}") from None

        return list(await asyncio.gather(*(one(s) for s in self._admin)))
