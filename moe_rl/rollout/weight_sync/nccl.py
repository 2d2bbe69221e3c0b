"""`NcclSync` (rollout.weight_sync=nccl): every trainer rank that owns HF tensors sends its own share
straight to the servers, bucket by bucket. NCCL on GPUs; gloo reaches `moe-rl serve` on CPU.

Sources. The ranks that write HF tensors (`MegatronWeights.is_source`: tensor-parallel rank 0 of
each data-parallel-0 replica's pipeline stages for the dense tensors, expert-tensor rank 0 of each
expert-parallel rank for its own experts) each form one update group per server: the source is its
rank 0, the server's TP ranks the rest (SGLang's `/init_weights_update_group`; a server joins any
number of groups by name). A source converts its tensors as the policy yields them (TP gathers run
inside the policy's iterator, among the ranks of one stage), cuts them into buckets and sends each
bucket as one flattened broadcast per server, while it converts the next: no rank holds more than
two buckets of converted tensors, and no rank receives another's share. The disk sync has the same
shape already: each rank writes its own safetensors files of one index.

Why one group per (source, server) and not one per source with every server in it: a server runs
the updates of its groups one at a time, in the order the requests arrive, and requests of several
sources reach two servers in different orders; a broadcast that spans both servers would then wait
on a server busy with another source's broadcast, which waits on the first: a deadlock. With a
group per server, every request a server takes has its broadcast posted already, so each finishes.

The last word. After every source finished, trainer rank 0 sends one small tensor again with the
weight version (and the cache flush), so a server reports the new version only once it holds all of
it. With `delta` a source sends only what changed since the last push every server took
(`delta.py`); with `verify` each server's checksums are compared with what was sent (`verify.py`).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from moe_rl.dist.collectives import all_errors, all_gather_objects, rank
from moe_rl.dist.devices import compute_device
from moe_rl.rollout.fused_weights import fused_key
from moe_rl.rollout.sglang_api import (BEGIN_UPDATE, DESTROY_GROUP, END_UPDATE, FLUSH_CACHE, INIT_GROUP, MODEL_INFO,
                                       SERVER_INFO, SPARSE_FORMAT, UPDATE_FROM_DISTRIBUTED, UPDATE_WEIGHT_VERSION,
                                       WEIGHTS_CHECKER, init_group_payload, reply_error, update_payload)
from moe_rl.rollout.weight_sync.buckets import TensorMeta, flatten_bucket, local_buckets
from moe_rl.rollout.weight_sync.common import (WeightsArg, WeightSyncError, _describe, _from_rank0,
                                               _named_tensors, is_source)
from moe_rl.rollout.weight_sync.delta import DeltaBase, flatten_sparse
from moe_rl.rollout.weight_sync.sglang_calls import (first_error, in_daemon_thread, leave_stale, new_custom_group,
                                                     post_all, post_json, session_call)
from moe_rl.rollout.weight_sync.verify import mismatches, tensor_checksum

log = logging.getLogger(__name__)


def _loopback(address: str) -> bool:
    """A trainer on one host (rank 0 listens on loopback): every rank's groups meet there too."""
    return address in ("localhost", "::1") or address.startswith("127.")


@dataclass
class PushStats:
    """What this rank did in the last push (the bench and the run's log read it)."""

    full: bool = True
    tensors: int = 0          # tensors this rank owns
    sent_tensors: int = 0     # of them sent (delta: the changed ones)
    sparse_tensors: int = 0   # of them sent as changed elements
    buckets: int = 0
    messages: int = 0         # broadcasts (one per bucket per server) and HTTP calls this rank made
    full_bytes: int = 0       # bytes of its tensors in the pushed dtype
    sent_bytes: int = 0       # bytes it broadcast, over all servers
    push_s: float = 0.0
    verify_s: float = 0.0
    servers: list[str] = field(default_factory=list)
    changed_elements: int = 0  # delta: elements whose bits changed since the last push
    elements: int = 0


def push_metrics(every: list[dict[str, Any]]) -> dict[str, float]:
    """The step's `weight_sync/*` metrics from every rank's PushStats (the busiest rank's bytes and
    messages: the push's critical path)."""
    senders = [s for s in every if s["buckets"]]
    full_bytes = sum(s["full_bytes"] for s in every) or 1
    out = {"weight_sync/senders": float(len(senders)),
           "weight_sync/model_bytes": float(sum(s["full_bytes"] for s in every)),
           "weight_sync/busiest_rank_bytes": float(max((s["sent_bytes"] for s in every), default=0)),
           "weight_sync/messages_busiest_rank": float(max((s["messages"] for s in every), default=0)),
           "weight_sync/sent_frac": sum(s["sent_bytes"] for s in every)
           / (full_bytes * max(1, len(every[0]["servers"]))),
           "weight_sync/full": float(every[0]["full"]),
           "weight_sync/push_s": max(s["push_s"] for s in every),
           "weight_sync/verify_s": max(s["verify_s"] for s in every)}
    if not every[0]["full"] and sum(s["elements"] for s in every):
        out["weight_sync/changed_frac"] = sum(s["changed_elements"] for s in every) / sum(s["elements"] for s in every)
    return out


@dataclass
class _Bucket:
    metas: list[TensorMeta]   # full shapes and dtypes
    payloads: list[torch.Tensor]
    nnz: list[int] | None     # sparse format only


class NcclSync:
    """Push the trainer's weights to SGLang servers from every source rank (`rollout.weight_sync=nccl`).

    admin_urls: the servers themselves (not the router). server_tp_sizes: each
    server's --tp-size (one int for all). master_address / master_port: where trainer rank
    0 serves its groups' rendezvous (other sources serve theirs on a port of their own, at
    their host's address). backend "nccl" (GPU); "gloo" for CPU. dtype: cast before sending
    (the servers' bf16). delta: send only what changed (`delta.py`); verify: compare every
    server's checksums with what was sent after each push (`verify.py`).

    Rejoining long-lived servers: each connect forms groups of new names (torch refuses a
    second group of a name that exists), and a trainer that died without `close()` leaves its
    groups registered in every server. Before joining, rank 0 closes what such a trainer may
    have left open, best effort: an update session (`/end_weight_update`) and the groups it
    joined last, whose names `state_file` keeps (`/destroy_weights_update_group`).
    """

    def __init__(self, admin_urls: Sequence[str], *, master_address: str, master_port: int,
                 server_tp_sizes: int | Sequence[int] = 1, group_name: str = "moe_rl_weight_sync",
                 backend: str = "nccl", bucket_bytes: int = 1 << 30, dtype: torch.dtype | None = None,
                 load_format: str | None = "flattened_bucket", flush_cache: bool = True,
                 http_timeout: float = 600.0, group_timeout: timedelta = timedelta(minutes=10), group: Any = None,
                 keys: Any = None, state_file: str | Path | None = None, delta: bool = False, verify: bool = False):
        self.urls = [u.rstrip("/") for u in admin_urls]
        self.keys = keys  # the servers' RunKeys (moe_rl/rollout/auth.py), or None
        if not self.urls:
            raise ValueError("NcclSync needs the servers' URLs")
        tps = [server_tp_sizes] * len(self.urls) if isinstance(server_tp_sizes, int) else list(server_tp_sizes)
        if len(tps) != len(self.urls):
            raise ValueError(f"{len(self.urls)} servers but {len(tps)} tp sizes")
        if any(int(tp) < 1 for tp in tps):
            raise ValueError(f"server tp sizes must be >= 1, got {tps}")
        self.tp_sizes = [int(tp) for tp in tps]
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_prefix, self.backend = group_name, backend
        self.group_names: list[str] = []  # this rank's groups, one per server (made unique by each connect)
        self.state_file = None if state_file is None else Path(state_file)
        self.bucket_bytes, self.dtype, self.load_format = int(bucket_bytes), dtype, load_format
        self.flush_cache, self.http_timeout, self.group_timeout = flush_cache, float(http_timeout), group_timeout
        self.group = group
        self.delta = DeltaBase() if delta else None
        self.verify = verify
        self.stats = PushStats()
        self.push_metrics: dict[str, float] = {}  # of the last push, the same on every rank
        self._pgs: list[Any] | None = None   # this rank's groups (sources only), one per server
        self._store: Any = None
        self._connected = False
        self._session: bool | None = None  # None: not probed; False: the servers have no session endpoints
        self._sparse: bool | None = None   # the servers take SPARSE_FORMAT (`moe-rl serve`)
        self._pushed: str | None = None    # the version every server took last
        self._sums: dict[str, Any] = {}    # checksum (or its future) of each tensor this rank last sent
        self._hasher: ThreadPoolExecutor | None = None  # hashes off the push's path (hashlib frees the GIL)
        self._smallest: tuple[str, torch.Tensor] | None = None
        self._held: str | None = None      # rank 0: the dtype every server holds ("" = unknown)
        self._wire: torch.dtype | None = dtype

    @property
    def group_name(self) -> str:
        """This rank's group with the first server."""
        return self.group_names[0] if self.group_names else self.group_prefix

    # ------------------------------------------------------------------ groups
    def connect(self, source: bool = True) -> None:
        """Every source joins one update group with each server (collective; once, until a failure)."""
        if self._connected:
            return
        if rank(self.group) == 0:
            self._leave_stale_groups()
        _from_rank0(None, self.group)  # nobody joins before the leftovers are gone
        error = self._join() if source else None
        errors = all_errors(error, self.group)
        names = all_gather_objects(self.group_names, self.group)
        if rank(self.group) == 0:
            self._remember_groups([n for per_rank in names for n in per_rank])
        if errors:
            self._drop_groups()
            raise WeightSyncError("; ".join(errors))
        self._connected = True

    def _join(self) -> str | None:
        from torch.distributed import TCPStore

        me = rank(self.group)
        address = self.master_address if me == 0 or _loopback(self.master_address) \
            else socket.gethostbyname(socket.gethostname())  # this host, as the servers resolve it
        try:  # one rendezvous store per rank, served for its groups (rank 0: master_port; others: any free port)
            self._store = TCPStore("0.0.0.0", self.master_port if me == 0 else 0, None, True,
                                   timeout=self.group_timeout, wait_for_workers=False)
            # A client of the store per group: a TCPStore client runs one request at a time and a group's
            # rendezvous waits inside one, so groups forming over one client form one after the other, and two
            # servers that take two sources' groups in crossed orders would wait on each other for good.
            clients = [TCPStore("127.0.0.1", self._store.port, None, False, timeout=self.group_timeout)
                       for _ in self.urls]
        except Exception as e:  # noqa: BLE001
            return f"rank {me}: cannot serve the update groups' rendezvous: {_describe(e)}"
        port, token = self._store.port, secrets.token_hex(4)
        self.group_names = [f"{self.group_prefix}-{os.getpid()}-{token}-r{me}-s{i}" for i in range(len(self.urls))]
        path = INIT_GROUP
        inits = [in_daemon_thread(post_json, url, path,
                                  init_group_payload(address, port, 1, 1 + tp, name, self.backend),
                                  self.http_timeout, self.keys)
                 for url, tp, name in zip(self.urls, self.tp_sizes, self.group_names)]
        joins = [in_daemon_thread(new_custom_group, self.backend, f"tcp://{address}:{port}", 1 + tp, 0, name,
                                  self.group_timeout, client)
                 for tp, name, client in zip(self.tp_sizes, self.group_names, clients)]
        # A server that refuses answers at once, and its group never forms: stop waiting then.
        while not all(j.done() for j in joins):
            if any(f.done() and (f.exception() is not None or reply_error("", path, *f.result()) is not None)
                   for f in inits):
                return f"rank {me}: " + str(first_error(self.urls, path, inits, only_done=True))
            time.sleep(0.02)
        try:
            self._pgs = [j.result() for j in joins]
        except Exception as e:  # noqa: BLE001
            return f"rank {me}: joining the update groups at {address}:{port} failed: {_describe(e)}"
        error = first_error(self.urls, path, inits)
        return f"rank {me}: {error}" if error else None

    def _leave_stale_groups(self) -> None:
        """Rank 0, before joining: what a trainer that died mid-run left open (its groups: `state_file`)."""
        stale: list[str] = []
        try:
            state = json.loads(self.state_file.read_text()) if self.state_file else {}
            stale = list(state.get("group_names") or ([state["group_name"]] if state.get("group_name") else []))
        except (OSError, ValueError, AttributeError, KeyError):
            pass
        leave_stale(self.urls, stale, self.keys)

    def _remember_groups(self, names: list[str]) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"group_names": names, "servers": self.urls}))
        os.replace(tmp, self.state_file)

    def _drop_groups(self) -> None:
        """Leave this rank's groups on both sides (best effort); the next push joins new ones, in full."""
        for url, name in zip(self.urls, self.group_names if self._pgs else []):
            try:
                post_json(url, DESTROY_GROUP, {"group_name": name}, 30.0, self.keys)
            except WeightSyncError as e:
                log.warning("%s", e)
        for pg in self._pgs or []:
            try:
                dist.destroy_process_group(pg)
            except Exception as e:  # noqa: BLE001 - a broken group may refuse; it is dropped either way
                log.warning("leaving an update group: %s", _describe(e))
        self._pgs, self._store, self.group_names, self._connected = None, None, [], False

    def close(self) -> None:
        """Leave the update groups on both sides (every rank that joined some; not collective)."""
        self._drop_groups()

    # -------------------------------------------------------------------- push
    def sync(self, version: int, weights: WeightsArg, engine: Any = None) -> int:
        """Push all weights as version `version` (collective over the trainer's ranks). `engine` is unused
        (the servers are addressed by URL). Returns the number of tensors the sources own."""
        started = time.perf_counter()
        weights, source = self._source(weights)
        self.connect(source)
        rank0 = rank(self.group) == 0
        plan = _from_rank0(self._open() if rank0 else None, self.group)
        self.stats, self._smallest = PushStats(full=plan["full"], servers=list(self.urls)), None
        self._wire = self.dtype or (getattr(torch, plan["dtype"]) if plan["dtype"] else None)
        pairs = _named_tensors(weights, self._wire)  # a policy casts before its gathers
        if plan["error"] is None:
            error = self._send_share(pairs, version, plan["full"], plan["sparse"], source)
        else:  # the session did not open: send nothing, but keep pace with the policy's gathers
            error = None
            for _ in pairs:
                pass
        # Two collectives end the push (each costs every rank a round trip, more at hundreds of ranks):
        # one gather brings every rank's outcome and stats to rank 0, which has the servers finish the
        # push and tells every rank how it went and the push's metrics in one broadcast.
        every = all_gather_objects((error, vars(self.stats)), self.group)
        outcome = self._finish_push(plan, [e for e, _ in every if e], [s for _, s in every], version,
                                    started) if rank0 else None
        errors, self.push_metrics, total = _from_rank0(outcome, self.group)
        if not errors and self.verify:
            errors = self._verify(version)
            self.push_metrics["weight_sync/verify_s"] = self.stats.verify_s
            self.push_metrics["weight_sync/push_s"] += self.stats.verify_s
        self.stats.push_s = time.perf_counter() - started
        if errors:
            if self.delta is not None:
                self.delta.valid = False
            self._pushed = None
            self._drop_groups()  # a broken group (a dead server) is not used again: the next push rejoins
            raise WeightSyncError(f"weight version {version}: " + "; ".join(errors))
        if self.delta is not None:
            self.delta.valid = True
        self._pushed = str(version)
        return total

    def _finish_push(self, plan: dict[str, Any], errors: list[str], every: list[dict[str, Any]], version: int,
                     started: float) -> tuple[list[str], dict[str, float], int]:
        """Rank 0, once every source is done: the last word and the end of the servers' session; the
        push's errors, its metrics, and the number of tensors the sources own."""
        if plan["error"] is not None:
            errors = [plan["error"]]
        else:
            if not errors:  # every source is done: the servers hold all but the last word
                errors += [e for e in [self._last_word(self._smallest, version)] if e]
            end_error = self._call_all(END_UPDATE, {})
            errors += [end_error] if end_error else []
        self.stats.push_s = time.perf_counter() - started
        every[0] = vars(self.stats)  # with the last word's message and bytes
        return errors, push_metrics(every), sum(s["tensors"] for s in every)

    def _source(self, weights: WeightsArg) -> tuple[WeightsArg, bool]:
        """The weights, and whether this rank sends any (a policy says; plain pairs by being there)."""
        said = is_source(weights)
        if said is not None:
            return weights, said
        pairs = list(_named_tensors(weights))
        return pairs, bool(pairs)

    def _open(self) -> dict[str, Any]:
        """Rank 0: open the servers' update session; decide full or delta and the update format."""
        if self._sparse is None and self.delta is not None:
            self._sparse = all(self._server_info(url).get("moe_rl_sparse_updates") is True for url in self.urls)
        if self._held is None:  # the dtype the servers hold, when they say (SGLang's "auto" does not)
            held = {str(self._server_info(url).get("dtype")) for url in self.urls}
            self._held = held.pop() if len(held) == 1 and held <= {"bfloat16", "float16", "float32"} else ""
        full = self.delta is None or not self.delta.valid or self._pushed is None or not all(
            str(self._model_info(url).get("weight_version")) == self._pushed for url in self.urls)
        error = self._call_all(BEGIN_UPDATE, {})
        return {"error": error, "full": full, "sparse": bool(self._sparse) and not full, "dtype": self._held}

    def _send_share(self, pairs: Iterable[tuple[str, torch.Tensor]], version: int, full: bool, sparse: bool,
                    source: bool) -> str | None:
        """Send this rank's tensors, one bucket in flight while the next fills. After a failure it keeps
        consuming `pairs` (its TP peers gather with it) and sends nothing more."""
        error, inflight = None, None
        for bucket in self._buckets(pairs, full, sparse):
            if inflight is not None:
                error = error or self._finish(inflight)
                inflight = None
            if error is None and source:
                inflight = self._post(bucket)
        if inflight is not None:
            error = error or self._finish(inflight)
        return error

    def _buckets(self, pairs: Iterable[tuple[str, torch.Tensor]], full: bool, sparse: bool) -> Iterator[_Bucket]:
        """This rank's tensors in the pushed dtype, what changed of them (delta), cut into buckets."""
        st = self.stats
        kept: dict[str, tuple[TensorMeta, int]] = {}

        def converted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in pairs:
                t = t.detach() if self._wire is None else t.detach().to(self._wire)
                if self._smallest is None or t.numel() < self._smallest[1].numel():
                    self._smallest = (name, t)  # rank 0's last word sends it again
                st.tensors += 1
                st.full_bytes += t.numel() * t.element_size()
                if self.verify and (full or self.delta is None):
                    self._sums[name] = self._checksum(t)
                yield name, t

        def changed(units: list[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
            # Compared a bucket's worth at a time (DeltaBase.encode_many). A fused pair (fused_weights.py)
            # goes whole and together when either half changed.
            outs = iter(self.delta.encode_many([(n, t, sparse and len(u) == 1) for u in units for n, t in u]))
            for unit in units:
                got = [next(outs) for _ in unit]
                st.changed_elements += sum(c for _, c in got)
                st.elements += sum(t.numel() for _, t in unit)
                if all(o is None for o, _ in got):
                    continue
                for (name, t), (out, _) in zip(unit, got):
                    payload, nnz = out if len(unit) == 1 else (t, -1)
                    if self.verify and not full:
                        self._sums[name] = self._checksum(t)
                    kept[name] = (TensorMeta.of(name, t), nnz)
                    yield name, (payload.contiguous().reshape(-1).view(torch.uint8) if sparse else payload)

        def units() -> Iterator[list[tuple[str, torch.Tensor]]]:
            held: dict[str, tuple[str, torch.Tensor]] = {}
            for name, t in converted():
                key = fused_key(name)
                if key is None:
                    yield [(name, t)]
                elif key in held:
                    yield [held.pop(key), (name, t)]
                else:
                    held[key] = (name, t)
            for item in held.values():
                yield [item]

        def wire() -> Iterator[tuple[str, torch.Tensor]]:
            if self.delta is None:
                yield from converted()
                return
            group, size = [], 0  # at most a bucket of converted tensors held for one comparison
            for unit in units():
                group.append(unit)
                size += sum(t.numel() * t.element_size() for _, t in unit)
                if size >= self.bucket_bytes:
                    yield from changed(group)
                    group, size = [], 0
            if group:
                yield from changed(group)

        for bucket in local_buckets(wire(), self.bucket_bytes, rank(self.group)):
            if sparse:  # the metas describe the full tensors; the payloads are raw bytes
                metas = [kept[m.name][0] for m, _ in bucket]
                yield _Bucket(metas, [p for _, p in bucket], [kept[m.name][1] for m, _ in bucket])
            else:
                yield _Bucket([m for m, _ in bucket], [p for _, p in bucket], None)

    def _post(self, bucket: _Bucket) -> tuple[list[Any], list[Any], torch.Tensor]:
        """Post one bucket to every server: its metadata by HTTP, its bytes by broadcast in that server's
        group (async: the next bucket converts meanwhile)."""
        device = compute_device()
        st = self.stats
        st.buckets += 1
        st.sent_tensors += len(bucket.metas)
        if bucket.nnz is not None:
            st.sparse_tensors += sum(1 for k in bucket.nnz if k >= 0)
            flat, fmt = flatten_sparse([p.to(device) for p in bucket.payloads]), SPARSE_FORMAT
        else:
            fmt = self.load_format
            flat = flatten_bucket([p.to(device) for p in bucket.payloads]) if fmt == "flattened_bucket" else None
        path = UPDATE_FROM_DISTRIBUTED
        futures = [in_daemon_thread(post_json, url, path,
                                    update_payload(bucket.metas, name, flush_cache=False, weight_version=None,
                                                   load_format=fmt, nnz=bucket.nnz),
                                    self.http_timeout, self.keys)
                   for url, name in zip(self.urls, self.group_names)]
        works = []
        for pg in self._pgs or []:
            if flat is not None:
                works.append(dist.broadcast(flat, src=0, group=pg, async_op=True))
            else:  # one broadcast per tensor, in `names` order
                works += [dist.broadcast(p.to(device).contiguous(), src=0, group=pg, async_op=True)
                          for p in bucket.payloads]
        nbytes = flat.numel() if flat is not None else sum(p.numel() * p.element_size() for p in bucket.payloads)
        st.sent_bytes += nbytes * len(self.urls)
        st.messages += len(works) + len(futures)
        return works, futures, bucket.metas

    def _finish(self, inflight: tuple[list[Any], list[Any], Any]) -> str | None:
        """Wait for a posted bucket: its broadcasts, then every server's answer."""
        works, futures, metas = inflight
        per_server = max(1, len(works) // max(1, len(self.urls)))
        for i, w in enumerate(works):
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001 - a server that died mid-broadcast
                url = self.urls[min(i // per_server, len(self.urls) - 1)]
                return (f"server {url}: the broadcast of a bucket of {len(metas)} tensors ({metas[0].name}, ...) "
                        f"failed: {_describe(e)}")
        return first_error(self.urls, UPDATE_FROM_DISTRIBUTED, futures)

    def _last_word(self, last: tuple[str, torch.Tensor] | None, version: int) -> str | None:
        """Rank 0, after every source finished: the weight version (and the cache flush) in a call that
        comes after every bucket at every server."""
        if last is None or not self._pgs:
            error = self._call_all(UPDATE_WEIGHT_VERSION, {"new_version": str(version),
                                                              "abort_all_requests": False}, session=False)
            if error is None and self.flush_cache:
                error = self._call_all(FLUSH_CACHE, {}, session=False)
            return error
        name, t = last
        device = compute_device()
        meta = TensorMeta.of(name, t)
        path = UPDATE_FROM_DISTRIBUTED
        futures = [in_daemon_thread(post_json, url, path,
                                    update_payload([meta], group, flush_cache=self.flush_cache,
                                                   weight_version=str(version), load_format=self.load_format),
                                    self.http_timeout, self.keys)
                   for url, group in zip(self.urls, self.group_names)]
        flat = flatten_bucket([t.to(device)]) if self.load_format == "flattened_bucket" else t.to(device).contiguous()
        works = [dist.broadcast(flat, src=0, group=pg, async_op=True) for pg in self._pgs]
        self.stats.messages += len(works) + len(futures)
        self.stats.sent_bytes += flat.numel() * flat.element_size() * len(self.urls)
        return self._finish((works, futures, [meta]))

    def _checksum(self, t: torch.Tensor) -> Future:
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="weight-sync-checksum")
        return self._hasher.submit(tensor_checksum, t)

    def _verify(self, version: int) -> list[str]:
        """Every server's checksums against what the sources sent (collective)."""
        t0 = time.perf_counter()
        self._sums = {n: (s.result() if isinstance(s, Future) else s) for n, s in self._sums.items()}
        sent = all_gather_objects(dict(self._sums) if self._pgs else {}, self.group)
        problems: list[str] = []
        if rank(self.group) == 0:
            merged = {k: v for per_rank in sent for k, v in per_rank.items()}
            replies = []
            for url, status, body in post_all(self.urls, WEIGHTS_CHECKER, {"action": "checksum"},
                                              self.http_timeout, self.keys):
                err = body if status is None else reply_error(url, WEIGHTS_CHECKER, status, body)
                if err:
                    problems.append(err)
                else:
                    replies.append((url, body))
            problems += mismatches(merged, replies, version, self.tp_sizes)
        problems, self.stats.verify_s = _from_rank0((problems, time.perf_counter() - t0), self.group)
        return problems

    def _server_info(self, url: str) -> dict[str, Any]:
        return self._get(url, SERVER_INFO)

    def _model_info(self, url: str) -> dict[str, Any]:
        return self._get(url, MODEL_INFO)

    def _get(self, url: str, path: str) -> dict[str, Any]:
        import urllib.request

        headers = self.keys.header(path) if self.keys is not None else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=30) as r:
                body = json.loads(r.read())
        except (OSError, ValueError):
            return {}
        return body if isinstance(body, dict) else {}

    def _call_all(self, path: str, payload: Any, session: bool = True) -> str | None:
        """POST to every server: a session endpoint (`session_call`), or another call that must succeed."""
        if session:
            error, self._session = session_call(self.urls, path, self.http_timeout, self.keys, self._session)
            return error
        errors = [body if status is None else reply_error(url, path, status, body)
                  for url, status, body in post_all(self.urls, path, payload, self.http_timeout, self.keys)]
        return "; ".join(e for e in errors if e) or None
