"""SGLang's `model_update_lock` (sglang/srt/aio_rwlock.py, used in tokenizer_manager.py and
tokenizer_control_mixin.py): a /generate request holds it shared for its whole life; a weight
update (from disk, from the distributed group, a session's begin and end) holds it alone unless
generation is paused, so it waits for the running requests to finish and new ones wait for it.
Only a paused server (/pause_generation) takes weights under running requests, which then go
on under the new ones (their tokens span two versions: meta_info["weight_versions"]).

Written here because asyncio has no reader-writer lock; it prefers writers, as SGLang's does:
a reader arriving while a writer waits queues behind it.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator


class ModelUpdateLock:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        """Held by a /generate request from before it reaches the engine until its reply is built."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self, engine: Any) -> AsyncIterator[None]:
        """Held by a weight update: alone, unless the engine is paused (then not at all, as SGLang)."""
        if getattr(engine, "paused", False):
            yield
            return
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self._readers)
                self._writer = True
            finally:
                self._waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()
