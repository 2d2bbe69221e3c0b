"""`NcclSync` (rollout.weight_sync=nccl): trainer rank 0 joins a process group with the SGLang servers
(`/init_weights_update_group`) and broadcasts the tensors bucket by bucket while each server receives
them (`/update_weights_from_distributed`). NCCL on GPUs; gloo reaches `moe-rl serve` on CPU.

SGLang payloads (sglang 0.5.23, sglang/srt/managers/io_struct.py):
`InitWeightsUpdateGroupReqInput{master_address, master_port, rank_offset,
world_size, group_name, backend}`; server i's TP rank r joins as
`rank_offset + r`, the trainer is rank 0.
`UpdateWeightsFromDistributedReqInput{names, dtypes, shapes, group_name,
flush_cache, abort_all_requests, weight_version, load_format}`; dtypes are torch
attribute names (`getattr(torch, dtype)`: "bfloat16"). With
`load_format="flattened_bucket"` one uint8 tensor holding the bucket's tensors
back to back is broadcast from rank 0, and each tensor's byte offset must be a
multiple of its element size (sglang/srt/weight_sync/tensor_bucket.py
`FlattenedTensorBucket.empty`); with `load_format=None` each tensor is broadcast
on its own, in `names` order. Since 0.5.23 the updates run inside
`/begin_weight_update` ... `/end_weight_update`; servers without those
endpoints (404) are updated without them.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from moe_rl.dist.collectives import rank
from moe_rl.dist.devices import compute_device
from moe_rl.rollout.weight_sync.buckets import Bucket, TensorMeta, collect_to_rank0, flatten_bucket
from moe_rl.rollout.weight_sync.common import WeightsArg, WeightSyncError, _describe, _from_rank0, _named_tensors

log = logging.getLogger(__name__)

def group_rank_offsets(server_tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Rank offset of each server in the update group (trainer = rank 0) and the group's world size."""
    offsets, nxt = [], 1
    for tp in server_tp_sizes:
        if int(tp) < 1:
            raise ValueError(f"server tp sizes must be >= 1, got {list(server_tp_sizes)}")
        offsets.append(nxt)
        nxt += int(tp)
    return offsets, nxt


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str = "nccl") -> dict[str, Any]:
    """Body of POST /init_weights_update_group (InitWeightsUpdateGroupReqInput)."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_payload(bucket: Sequence[TensorMeta], group_name: str, *, flush_cache: bool,
                   weight_version: str | None, load_format: str | None = "flattened_bucket") -> dict[str, Any]:
    """Body of POST /update_weights_from_distributed (UpdateWeightsFromDistributedReqInput) for one bucket."""
    body: dict[str, Any] = {
        "names": [m.name for m in bucket],
        "dtypes": [m.dtype for m in bucket],
        "shapes": [list(m.shape) for m in bucket],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": False,
        "weight_version": weight_version,
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


def bucket_payloads(buckets: Sequence[Sequence[TensorMeta]], group_name: str, version: int | str, *,
                    flush_cache: bool = True, load_format: str | None = "flattened_bucket") -> list[dict[str, Any]]:
    """One update body per bucket: only the last one flushes the cache and sets the weight version,
    so a server never reports the new version while it still holds part of the old weights."""
    last = len(buckets) - 1
    return [update_payload(b, group_name, flush_cache=flush_cache and i == last,
                           weight_version=str(version) if i == last else None, load_format=load_format)
            for i, b in enumerate(buckets)]


def _post_json(url: str, path: str, payload: Any, timeout: float, keys: Any = None) -> tuple[int, Any]:
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


def _reply_error(url: str, path: str, status: int, body: Any) -> str | None:
    if status == 200 and (not isinstance(body, dict) or body.get("success", True)):
        return None
    msg = body.get("message", body) if isinstance(body, dict) else body
    return f"server {url} {path} (HTTP {status}): {msg}"


def new_custom_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                     timeout: timedelta = timedelta(minutes=10)) -> Any:
    """A process group outside the default one, joined with the SGLang servers.

    The same construction as SGLang's `init_custom_process_group`
    (sglang/srt/utils/common.py): rendezvous on `init_method`, a PrefixStore named
    after the group, then torch's group helper. Uses torch internals, as SGLang does.
    """
    from torch.distributed.distributed_c10d import (PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future:
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


class NcclSync:
    """Broadcast the trainer's weights from rank 0 to SGLang servers (`rollout.weight_sync=nccl`).

    admin_urls: the servers themselves (not the router). server_tp_sizes: each
    server's --tp-size (one int for all). master_address / master_port: where rank 0
    listens for the update group; the servers must reach it. backend "nccl" (GPU);
    "gloo" works for CPU tests. dtype: cast before sending (e.g. the servers' bf16).

    Rejoining long-lived servers: each connect forms a group of a new name
    (`group_name` + a random suffix), since torch refuses a second group of a name that
    exists (`_new_process_group_helper`), and a trainer that died without `close()`
    (NCCL abort, OOM kill, kill -9) leaves its group registered in every server. Before
    joining, rank 0 closes what such a trainer may have left open on the servers, best
    effort: an update session (`/end_weight_update`; `/begin_weight_update` is refused
    while one is open) and the group it joined last, whose name `state_file` keeps
    (`/destroy_weights_update_group`).
    """

    def __init__(self, admin_urls: Sequence[str], *, master_address: str, master_port: int,
                 server_tp_sizes: int | Sequence[int] = 1, group_name: str = "moe_rl_weight_sync",
                 backend: str = "nccl", bucket_bytes: int = 1 << 30, dtype: torch.dtype | None = None,
                 load_format: str | None = "flattened_bucket", flush_cache: bool = True,
                 http_timeout: float = 600.0, group_timeout: timedelta = timedelta(minutes=10), group: Any = None,
                 keys: Any = None, state_file: str | Path | None = None):
        self.urls = [u.rstrip("/") for u in admin_urls]
        self.keys = keys  # the servers' RunKeys (moe_rl/rollout/auth.py), or None
        if not self.urls:
            raise ValueError("NcclSync needs the servers' URLs")
        tps = [server_tp_sizes] * len(self.urls) if isinstance(server_tp_sizes, int) else list(server_tp_sizes)
        if len(tps) != len(self.urls):
            raise ValueError(f"{len(self.urls)} servers but {len(tps)} tp sizes")
        self.offsets, self.world_size = group_rank_offsets(tps)
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_prefix, self.backend = group_name, backend
        self.group_name = group_name  # made unique by each connect
        self.state_file = None if state_file is None else Path(state_file)
        self.bucket_bytes, self.dtype, self.load_format = int(bucket_bytes), dtype, load_format
        self.flush_cache, self.http_timeout, self.group_timeout = flush_cache, float(http_timeout), group_timeout
        self.group = group
        self._pg: Any = None
        self._session: bool | None = None  # None: not probed; False: the servers have no session endpoints

    # ------------------------------------------------------------------ group
    def connect(self) -> None:
        """Rank 0: make every server join the update group, and join it as rank 0 (collective)."""
        error = None
        if rank(self.group) == 0 and self._pg is None:
            error = self._connect()
        error = _from_rank0(error, self.group)
        if error:
            raise WeightSyncError(error)

    def _connect(self) -> str | None:
        self._leave_stale_group()
        self.group_name = f"{self.group_prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self._remember_group(self.group_name)
        path = "/init_weights_update_group"
        futures = [_in_daemon_thread(_post_json, url, path,
                                     init_group_payload(self.master_address, self.master_port, off,
                                                        self.world_size, self.group_name, self.backend),
                                     self.http_timeout, self.keys) for url, off in zip(self.urls, self.offsets)]
        # The servers' HTTP calls return only once everybody joined: join while they wait. A server
        # that refuses answers at once, and then nobody else joins: stop waiting for the group then
        # (the join thread gives up at group_timeout) rather than for the whole timeout.
        joined = _in_daemon_thread(new_custom_group, self.backend, f"tcp://{self.master_address}:{self.master_port}",
                                   self.world_size, 0, self.group_name, self.group_timeout)
        while not joined.done():
            refused = [f for f in futures if f.done() and (f.exception() is not None
                                                           or _reply_error("", path, *f.result()) is not None)]
            if refused:
                return self._first_error(path, futures, only_done=True)
            time.sleep(0.05)
        try:
            self._pg = joined.result()
        except Exception as e:  # noqa: BLE001
            return f"joining weight update group {self.group_name} at {self.master_address}:{self.master_port} " \
                   f"failed: {_describe(e)}"
        return self._first_error(path, futures)

    def _first_error(self, path: str, futures: list, only_done: bool = False) -> str | None:
        errors = []
        for url, fut in zip(self.urls, futures):
            if only_done and not fut.done():
                continue
            try:
                err = _reply_error(url, path, *fut.result())
            except WeightSyncError as e:
                err = str(e)
            if err:
                errors.append(err)
        return "; ".join(errors) or None

    def _leave_stale_group(self) -> None:
        """Rank 0, before joining: end an update session and leave the group that a trainer which
        died mid-run left on the servers (best effort: a server without either says so, and is fine)."""
        stale = None
        try:
            stale = json.loads(self.state_file.read_text()).get("group_name") if self.state_file else None
        except (OSError, ValueError, AttributeError):
            pass
        for url in self.urls:
            calls = [("/end_weight_update", {})] + ([("/destroy_weights_update_group", {"group_name": stale})]
                                                   if stale else [])
            for path, body in calls:
                try:
                    status, reply = _post_json(url, path, body, 30.0, self.keys)
                except WeightSyncError as e:
                    log.warning("before joining the update group: %s", e)
                    continue
                if status == 200 and (not isinstance(reply, dict) or reply.get("success", True)):
                    log.info("server %s: %s, left by an earlier trainer", url,
                             "closed an open update session" if path == "/end_weight_update"
                             else f"destroyed update group {stale}")

    def _remember_group(self, name: str) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"group_name": name, "servers": self.urls}))
        os.replace(tmp, self.state_file)

    def close(self) -> None:
        """Rank 0: leave the update group on both sides."""
        if self._pg is None:
            return
        for url in self.urls:
            try:
                _post_json(url, "/destroy_weights_update_group", {"group_name": self.group_name}, 30.0, self.keys)
            except WeightSyncError as e:
                log.warning("%s", e)
        dist.destroy_process_group(self._pg)
        self._pg = None

    # ------------------------------------------------------------------- sync
    def sync(self, version: int, named_tensors: WeightsArg, engine: Any = None) -> int:
        """Broadcast all weights as version `version` (collective over the trainer's ranks).

        `engine` is unused (the servers are addressed by URL); it is accepted so every
        sync has the same call. Returns the number of tensors sent.
        """
        self.connect()
        source = _named_tensors(named_tensors)
        if self.dtype is not None:
            source = ((n, t.to(self.dtype)) for n, t in source)
        rank0 = rank(self.group) == 0
        error = self._call_all("/begin_weight_update", {}) if rank0 else None
        count = 0
        for bucket in collect_to_rank0(source, self.bucket_bytes, self.group):
            count += len(bucket.metas)
            if error is None:  # after a failure keep draining: the other ranks are sending
                error = self._send_bucket(bucket, version)
        if rank0:
            end_error = self._call_all("/end_weight_update", {})
            error = error or end_error
        error = _from_rank0(error, self.group)
        if error:
            raise WeightSyncError(f"weight version {version} over {self.group_name}: {error}")
        return int(_from_rank0(count, self.group))

    def _send_bucket(self, bucket: Bucket, version: int) -> str | None:
        """POST the bucket's metadata to every server and broadcast its bytes while they wait."""
        # flush_cache and weight_version go with the last bucket only (see bucket_payloads)
        payload = update_payload(bucket.metas, self.group_name, flush_cache=self.flush_cache and bucket.last,
                                 weight_version=str(version) if bucket.last else None, load_format=self.load_format)
        path = "/update_weights_from_distributed"
        futures = [_in_daemon_thread(_post_json, url, path, payload, self.http_timeout, self.keys)
                   for url in self.urls]
        device = compute_device()
        if self.load_format == "flattened_bucket":
            dist.broadcast(flatten_bucket([t.to(device) for t in bucket.tensors]), src=0, group=self._pg)
        else:  # one broadcast per tensor, in `names` order
            for t in bucket.tensors:
                dist.broadcast(t.to(device).contiguous(), src=0, group=self._pg)
        return self._first_error(path, futures)

    def _call_all(self, path: str, payload: Any) -> str | None:
        """POST to every server; a 404 on the session endpoints means an SGLang without them."""
        if self._session is False:
            return None
        futures = [_in_daemon_thread(_post_json, url, path, payload, self.http_timeout, self.keys)
                   for url in self.urls]
        errors, missing = [], 0
        for url, fut in zip(self.urls, futures):
            try:
                status, body = fut.result()
            except WeightSyncError as e:
                errors.append(str(e))
                continue
            if status == 404:
                missing += 1
                continue
            err = _reply_error(url, path, status, body)
            if err:
                errors.append(err)
        if missing == len(self.urls):
            self._session = False
            return None
        self._session = True
        return "; ".join(errors) or None
