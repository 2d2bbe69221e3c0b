"""`FunnelSync`: the weight push as it was before the sources (`nccl.py`), kept as the baseline
`tools/bench/weight_sync.py --scale` measures the new path against, side by side.

Every rank sends its HF tensors to trainer rank 0, one point-to-point message per tensor
(`collect_to_rank0`), and rank 0 broadcasts the whole model to all servers in one update group,
bucket by bucket: the model crosses rank 0's link twice, and a model of 47k expert tensors makes
47k messages. Not used by runs.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from moe_rl.dist.collectives import all_gather_objects, rank
from moe_rl.dist.devices import compute_device
from moe_rl.rollout.fused_weights import pair_fused
from moe_rl.rollout.sglang_api import (BEGIN_UPDATE, DESTROY_GROUP, END_UPDATE, INIT_GROUP, UPDATE_FROM_DISTRIBUTED,
                                       init_group_payload, reply_error, update_payload)
from moe_rl.rollout.weight_sync.buckets import Bucket, TensorMeta, check_unique, flatten_bucket, plan_buckets
from moe_rl.rollout.weight_sync.common import (NamedTensors, WeightsArg, WeightSyncError, _describe, _from_rank0,
                                               _global_rank, _named_tensors)
from moe_rl.rollout.weight_sync.sglang_calls import (first_error, group_rank_offsets, in_daemon_thread, leave_stale,
                                                     new_custom_group, post_json, session_call)

log = logging.getLogger(__name__)


class FunnelSync:
    """Broadcast the trainer's weights from rank 0 to SGLang servers: the earlier `rollout.weight_sync=nccl`.

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
        path = INIT_GROUP
        futures = [in_daemon_thread(post_json, url, path,
                                     init_group_payload(self.master_address, self.master_port, off,
                                                        self.world_size, self.group_name, self.backend),
                                     self.http_timeout, self.keys) for url, off in zip(self.urls, self.offsets)]
        # The servers' HTTP calls return only once everybody joined: join while they wait. A server
        # that refuses answers at once, and then nobody else joins: stop waiting for the group then
        # (the join thread gives up at group_timeout) rather than for the whole timeout.
        joined = in_daemon_thread(new_custom_group, self.backend, f"tcp://{self.master_address}:{self.master_port}",
                                   self.world_size, 0, self.group_name, self.group_timeout)
        while not joined.done():
            refused = [f for f in futures if f.done() and (f.exception() is not None
                                                           or reply_error("", path, *f.result()) is not None)]
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
        return first_error(self.urls, path, futures, only_done)

    def _leave_stale_group(self) -> None:
        """Rank 0, before joining: what a trainer that died mid-run left open (its group: `state_file`)."""
        stale = None
        try:
            stale = json.loads(self.state_file.read_text()).get("group_name") if self.state_file else None
        except (OSError, ValueError, AttributeError):
            pass
        leave_stale(self.urls, [stale] if stale else [], self.keys)

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
                post_json(url, DESTROY_GROUP, {"group_name": self.group_name}, 30.0, self.keys)
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
        error = self._call_all(BEGIN_UPDATE, {}) if rank0 else None
        count = 0
        for bucket in collect_to_rank0(source, self.bucket_bytes, self.group):
            count += len(bucket.metas)
            if error is None:  # after a failure keep draining: the other ranks are sending
                error = self._send_bucket(bucket, version)
        if rank0:
            end_error = self._call_all(END_UPDATE, {})
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
        path = UPDATE_FROM_DISTRIBUTED
        futures = [in_daemon_thread(post_json, url, path, payload, self.http_timeout, self.keys)
                   for url in self.urls]
        device = compute_device()
        if self.load_format == "flattened_bucket":
            dist.broadcast(flatten_bucket([t.to(device) for t in bucket.tensors]), src=0, group=self._pg)
        else:  # one broadcast per tensor, in `names` order
            for t in bucket.tensors:
                dist.broadcast(t.to(device).contiguous(), src=0, group=self._pg)
        return self._first_error(path, futures)

    def _call_all(self, path: str, payload: Any) -> str | None:
        """A session endpoint on every server (`session_call`)."""
        error, self._session = session_call(self.urls, path, self.http_timeout, self.keys, self._session)
        return error


def collect_to_rank0(named_tensors: NamedTensors, bucket_bytes: int, group: Any = None) -> Iterator[Bucket]:
    """Bring every rank's (name, tensor) pairs to rank 0, bucket by bucket (collective).

    Each rank first drains its own iterator (the policy's export iterator runs TP
    gathers inside, so ranks must not interleave other collectives with it), then
    all ranks agree on one bucket plan (rank-major order) and the owners send each
    bucket's tensors to rank 0 point-to-point. The sends and receives of bucket i + 1
    are posted before bucket i is yielded, so its transfer overlaps whatever rank 0 does
    with bucket i (the nccl sync broadcasts it to the servers, the tensor sync copies it).
    Yields (metas, tensors) on rank 0; yields nothing elsewhere, but every rank must
    exhaust the generator. Memory: each rank holds its own share until the end; rank 0
    two buckets more.
    """
    me = rank(group)
    local: list[tuple[str, torch.Tensor]] = pair_fused([(n, t.detach()) for n, t in named_tensors])
    metas_per_rank = all_gather_objects([TensorMeta.of(n, t, me) for n, t in local], group)
    metas = [m for per_rank in metas_per_rank for m in per_rank]
    check_unique(metas)
    mine = iter(t for _, t in local)
    device = compute_device()  # NCCL groups take no host tensors; gloo takes either
    plan = list(_numbered(plan_buckets(metas, bucket_bytes)))

    def start(k: int) -> Any:
        # Owners post their sends only once rank 0 has posted its receives (it says so on the control
        # group): a send never waits on the default group while rank 0 talks to the servers about
        # the bucket before, however long that takes (NCCL's watchdog would abort the job).
        _from_rank0(k, group)
        return _start_exchange(plan[k][1], mine, me, device, plan[k][0], group)

    pending = start(0) if plan else None
    for index, (_, bucket) in enumerate(plan):
        nxt = start(index + 1) if index + 1 < len(plan) else None
        tensors = _finish_exchange(bucket, pending, me)
        if me == 0:
            yield Bucket(index, len(plan), bucket, tensors)
        pending = nxt


def _numbered(buckets: list[list[TensorMeta]]) -> Iterator[tuple[int, list[TensorMeta]]]:
    """(index of the bucket's first tensor in the global order, bucket): p2p tags."""
    start = 0
    for b in buckets:
        yield start, b
        start += len(b)


def _start_exchange(bucket: list[TensorMeta], mine: Iterator[torch.Tensor], me: int, device: torch.device,
                    tag_base: int, group: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """Post one bucket's transfers: owners send their tensors to rank 0 as raw bytes, rank 0 receives.
    Returns the pending works and, on rank 0, the bucket's tensors (or their receive buffers)."""
    dst = _global_rank(group, 0)
    received: list[torch.Tensor] = []
    works = []
    for i, m in enumerate(bucket):
        tag = (tag_base + i) % (1 << 30)
        if m.owner == me:
            t = next(mine)
            if me == 0:
                received.append(t)
            elif m.numel:
                works.append(dist.isend(_as_bytes(t, device), dst=dst, group=group, tag=tag))
        elif me == 0:
            buf = torch.empty(m.nbytes, dtype=torch.uint8, device=device)
            if m.numel:
                works.append(dist.irecv(buf, src=_global_rank(group, m.owner), group=group, tag=tag))
            received.append(buf)
    return works, received


def _finish_exchange(bucket: list[TensorMeta], pending: tuple[list[Any], list[torch.Tensor]] | None,
                     me: int) -> list[torch.Tensor]:
    """Wait for a bucket's transfers; on rank 0 its tensors with their dtypes and shapes."""
    works, received = pending if pending is not None else ([], [])
    for w in works:
        w.wait()
    if me != 0:
        return []
    return [t if m.owner == 0 else t.view(getattr(torch, m.dtype)).reshape(m.shape)
            for m, t in zip(bucket, received)]


def _as_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Raw bytes go over any backend whatever the dtype (gloo has no p2p for some dtypes).
    return t.to(device).contiguous().reshape(-1).view(torch.uint8)
