"""The requests a `moe-rl serve` is working on, by rid (SGLang's TokenizerManager.rid_to_state): what
/abort_request ends, and how a running sample tells its streaming reply about each new token."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any, Callable

from moe_rl.rollout.engine import GenerateResult


class LiveRequests:
    """rid -> aborted? for every sample from its parse to its reply."""

    def __init__(self) -> None:
        self._live: dict[str, bool] = {}
        self._lock = threading.Lock()

    def add(self, rids: list[str]) -> None:
        with self._lock:
            self._live.update((r, False) for r in rids)

    def remove(self, rids: list[str]) -> None:
        with self._lock:
            for r in rids:
                self._live.pop(r, None)

    def abort(self, rid: str, abort_all: bool) -> None:
        """SGLang's abort_request: every live sample (abort_all), or nothing unless `rid` is live, then every
        live sample whose rid starts with it (the scheduler matches by prefix)."""
        with self._lock:
            if not abort_all and rid not in self._live:
                return
            for r in self._live:
                if abort_all or r.startswith(rid):
                    self._live[r] = True

    def aborted(self, rid: str) -> bool:
        return self._live.get(rid, False)


class Hooks:
    """`SampleHooks` of one prompt's samples (`rids[j]` is sample j's): aborts from `live`; with `on_progress`
    each sample's output so far, handed to the event loop's thread (the engine calls from its own)."""

    def __init__(self, live: LiveRequests, rids: list[str],
                 on_progress: Callable[[int, GenerateResult], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.live, self.rids, self.on_progress, self.loop = live, rids, on_progress, loop

    def aborted(self, sample: int) -> bool:
        return self.live.aborted(self.rids[sample])

    def progress(self, sample: int, result: GenerateResult) -> None:
        if self.on_progress is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_progress, sample, result)


def with_hooks(req: Any, hooks: Hooks) -> Any:
    return replace(req, hooks=hooks)
