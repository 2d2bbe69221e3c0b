"""`ServerThread`: the app served from a background thread (tests, notebooks, single-process demos)."""
from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web

from moe_rl.rollout.server.app import make_app
from moe_rl.rollout.server.common import HEALTH_CHECK_TIMEOUT, SERVER_ARGS

class ServerThread:
    """Serve an engine from a background thread (tests, notebooks, single-process demos).

    `with ServerThread(engine) as srv: SGLangClient([srv.url]) ...`; port 0 picks a free port.
    enable_return_routed_experts: SGLang's flag, off by default as there (no routes in any reply).
    trusted_dirs: where /update_weights_from_disk may load from (None: anywhere).
    """

    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 32,
                 max_body_mb: float = 64.0, health_timeout: float = HEALTH_CHECK_TIMEOUT,
                 enable_return_routed_experts: bool = False, trusted_dirs: Any = None):
        self.engine, self.host, self.port = engine, host, port
        self._app_kw = dict(max_batch=max_batch, max_body_mb=max_body_mb, health_timeout=health_timeout,
                            enable_return_routed_experts=enable_return_routed_experts, trusted_dirs=trusted_dirs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerThread":
        self._thread = threading.Thread(target=self._main, name="moe-rl-serve", daemon=True)
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001
            self._error = e
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = make_app(self.engine, **self._app_kw, server_args={"host": self.host})
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = app[SERVER_ARGS]["port"] = _bound_port(site, self.port)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _bound_port(site: web.TCPSite, default: int) -> int:
    server = getattr(site, "_server", None)
    socks = getattr(server, "sockets", None) or []
    return int(socks[0].getsockname()[1]) if socks else default
