"""The fair, chunked batcher: every engine call takes the next chunk of each waiting `/generate` call in
turn, and a call whose client went away is dropped."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from moe_rl.rollout.engine import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)

class _Job:
    """One /generate call, cut into chunks of at most max_batch samples (whole prompts)."""

    def __init__(self, reqs: list[GenerateRequest], max_batch: int, fut: asyncio.Future):
        self.chunks: list[list[GenerateRequest]] = []
        for r in reqs:
            if not self.chunks or sum(x.sampling.n for x in self.chunks[-1]) + r.sampling.n > max_batch:
                self.chunks.append([])
            self.chunks[-1].append(r)
        self.results: list[list[GenerateResult]] = []
        self.fut = fut


class _Batcher:
    """Feeds the engine from every /generate call in turn.

    Each call is cut into chunks of at most `max_batch` samples; every engine call takes the
    next chunk of each waiting call in rotation (up to max_batch samples), so a small request
    that arrives behind a huge one waits for one chunk, not for the whole huge request. A
    call whose client went away (its future cancelled) loses its remaining chunks: at most the
    chunk already in the engine is generated for nobody.
    """

    def __init__(self, engine: Any, max_batch: int):
        self.engine = engine
        self.max_batch = max(1, int(max_batch))
        self.jobs: list[_Job] = []
        self.wake = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rl-generate")
        self.task: asyncio.Task | None = None
        self.closed = False

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """No chunk starts after this; waiting calls are cancelled (the one in the engine runs on
        until the engine is aborted)."""
        self.closed = True
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        for job in self.jobs:
            job.fut.cancel()
        self.jobs = []
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, reqs: list[GenerateRequest]) -> list[list[GenerateResult]]:
        if self.closed:
            raise web.HTTPServiceUnavailable(text="the server is shutting down")
        fut = asyncio.get_running_loop().create_future()
        self.jobs.append(_Job(reqs, self.max_batch, fut))
        self.wake.set()
        return await fut  # cancelled with the handler when the client disconnects

    def _next_batch(self) -> list[tuple[_Job, list[GenerateRequest]]]:
        self.jobs = [j for j in self.jobs if not j.fut.done()]  # callers that went away
        batch: list[tuple[_Job, list[GenerateRequest]]] = []
        rows = 0
        for job in list(self.jobs):
            if rows >= self.max_batch:  # as before chunking: calls join until max_batch is reached
                break
            n = sum(r.sampling.n for r in job.chunks[0])
            batch.append((job, job.chunks.pop(0)))
            rows += n
            self.jobs.remove(job)
            if job.chunks:
                self.jobs.append(job)  # its next chunk waits behind the others: rotation
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._next_batch()
            if not batch:
                self.wake.clear()
                await self.wake.wait()
                continue
            flat = [r for _, chunk in batch for r in chunk]
            try:
                results = await loop.run_in_executor(self.executor, self.engine.generate, flat)
            except Exception as e:  # noqa: BLE001 - reported to every caller of this batch
                log.exception("generation failed")
                for job, _ in batch:
                    if not job.fut.done():
                        job.fut.set_exception(e)
                continue
            k = 0
            for job, chunk in batch:
                job.results.extend(results[k:k + len(chunk)])
                k += len(chunk)
                if not job.chunks and not job.fut.done():
                    job.fut.set_result(job.results)
