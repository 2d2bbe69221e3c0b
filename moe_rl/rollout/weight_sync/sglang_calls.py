"""How the update-group syncs call SGLang: the blocking HTTP POST, the calls to every server of a push
and their first error, the update session (`/begin_weight_update` ... `/end_weight_update`, since
0.5.23; servers without those endpoints, 404, are updated without them), and the process group a
trainer rank forms with servers (the bodies and the endpoints: moe_rl/rollout/sglang_api.py).

A server joins any number of groups, by name (`ModelRunner._model_update_group` is a dict), and its
scheduler runs their updates one at a time, in the order they arrive.
"""
from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable, Sequence

from moe_rl.rollout.sglang_api import DESTROY_GROUP, END_UPDATE, reply_error
from moe_rl.rollout.weight_sync.common import WeightSyncError, _describe

log = logging.getLogger(__name__)


def group_rank_offsets(server_tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Rank offset of each server in one update group (trainer = rank 0) and the group's world size."""
    offsets, nxt = [], 1
    for tp in server_tp_sizes:
        if int(tp) < 1:
            raise ValueError(f"server tp sizes must be >= 1, got {list(server_tp_sizes)}")
        offsets.append(nxt)
        nxt += int(tp)
    return offsets, nxt


def post_json(url: str, path: str, payload: Any, timeout: float, keys: Any = None) -> tuple[int, Any]:
    """POST JSON (with the run's Bearer key when `keys`, a RunKeys, is given); returns (HTTP status,
    parsed body or text). Connection problems raise WeightSyncError."""
    headers = {"Content-Type": "application/json", **(keys.header(path) if keys is not None else {})}
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(payload).encode(), method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise WeightSyncError(f"server {url}: POST {path} failed: {_describe(e)}") from None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")[:500]


def new_custom_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                     timeout: timedelta = timedelta(minutes=10), store: Any = None) -> Any:
    """A process group outside the default one, joined with the SGLang servers.

    The same construction as SGLang's `init_custom_process_group`
    (sglang/srt/utils/common.py): rendezvous on `init_method`, a PrefixStore named
    after the group, then torch's group helper. Uses torch internals, as SGLang does.
    `store`: a client of a TCPStore this process already serves (one per trainer rank for all
    of its groups, each under its own prefix; a client of its own per group, since a client
    runs one request at a time); the servers reach it at `init_method`.
    """
    from torch.distributed.distributed_c10d import (PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` in a daemon thread: a call left waiting on a server (an update group that never
    forms, an HTTP call of `http_timeout`) must not hold up the process's exit, as an executor's would."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            done.set_exception(e)

    threading.Thread(target=run, name=f"weight-sync-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return done


def first_error(urls: Sequence[str], path: str, futures: Sequence[Future], only_done: bool = False) -> str | None:
    """The servers' refusals of one call made to each (futures of `post_json`), joined; None if all agreed."""
    errors = []
    for url, fut in zip(urls, futures):
        if only_done and not fut.done():
            continue
        try:
            err = reply_error(url, path, *fut.result())
        except WeightSyncError as e:
            err = str(e)
        if err:
            errors.append(err)
    return "; ".join(errors) or None


def post_all(urls: Sequence[str], path: str, payload: Any, timeout: float, keys: Any = None
             ) -> list[tuple[str, int | None, Any]]:
    """POST to every server at once: (url, HTTP status, body) each, status None and the error line as
    the body when a server could not be reached."""
    futures = [in_daemon_thread(post_json, url, path, payload, timeout, keys) for url in urls]
    out: list[tuple[str, int | None, Any]] = []
    for url, fut in zip(urls, futures):
        try:
            out.append((url, *fut.result()))
        except WeightSyncError as e:
            out.append((url, None, str(e)))
    return out


def session_call(urls: Sequence[str], path: str, timeout: float, keys: Any, session: bool | None
                 ) -> tuple[str | None, bool | None]:
    """`/begin_weight_update` or `/end_weight_update` on every server: (the refusals or None, whether the
    servers have the session endpoints: all answering 404 means an SGLang before 0.5.23, updated
    without them). `session` False: known to have none, nothing is called."""
    if session is False:
        return None, False
    errors, missing = [], 0
    for url, status, body in post_all(urls, path, {}, timeout, keys):
        if status == 404:
            missing += 1
            continue
        err = body if status is None else reply_error(url, path, status, body)
        if err:
            errors.append(err)
    if missing == len(urls):
        return None, False
    return "; ".join(errors) or None, True


def leave_stale(urls: Sequence[str], groups: Sequence[str], keys: Any = None) -> None:
    """Before joining: end an update session and destroy the update `groups` a trainer that died mid-run
    left on the servers (best effort: a server without either says so, and is fine)."""
    for url in urls:
        for path, body in [(END_UPDATE, {})] + [(DESTROY_GROUP, {"group_name": g}) for g in groups]:
            try:
                status, reply = post_json(url, path, body, 30.0, keys)
            except WeightSyncError as e:
                log.warning("before joining the update groups: %s", e)
                break
            if status == 200 and (not isinstance(reply, dict) or reply.get("success", True)):
                log.info("server %s: %s, left by an earlier trainer", url,
                         "closed an open update session" if path == END_UPDATE
                         else f"destroyed update group {body['group_name']}")
