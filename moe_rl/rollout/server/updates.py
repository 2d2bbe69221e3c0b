"""Distributed weight updates: the process groups joined with trainers, the update session, and their
endpoints (`/init_weights_update_group`, `/begin_weight_update`, `/update_weights_from_distributed`, ...)."""
from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from aiohttp import web

from moe_rl.rollout.memory import MemoryReleasedError
from moe_rl.rollout.server.common import (_CHECK_FIELDS, _GROUP_NAME_FIELDS, _INIT_GROUP_FIELDS, _UPDATE_FIELDS,
                                          _VERSION_FIELDS,
                                          ENGINE, GROUPS, UPDATE_EXECUTOR, UPDATE_LOCK, BadRequest, _fields, _is_int,
                                          _outcome, _read_json, refused_flush)
from moe_rl.rollout.sglang_api import (DESTROY_GROUP, INIT_GROUP, SPARSE_FORMAT, UPDATE_FROM_DISTRIBUTED,
                                       UPDATE_WEIGHT_VERSION, WEIGHTS_CHECKER)
from moe_rl.rollout.weight_load import checkpoint_names, served_view
from moe_rl.rollout.weight_sync import (TensorMeta, new_custom_group, tensor_checksum, unflatten_bucket,
                                        unflatten_sparse)
from moe_rl.rollout.weight_sync.delta import sparse_bucket_nbytes

class _UpdateGroups:
    """Process groups joined with trainers, by name, and the open weight-update session.

    SGLang keeps the same state in its model runner (`_model_update_group`) and
    scheduler (`_WeightUpdateSession`); this server is one tp rank (tp_size 1). Every
    method runs on the one update thread, so calls apply in the order they arrived
    and the broadcasts pair up with the trainer's.
    """

    def __init__(self, engine: Any, group_timeout: timedelta):
        self.engine, self.group_timeout = engine, group_timeout
        self.groups: dict[str, tuple[Any, str]] = {}  # name -> (process group, backend)
        self.session_open = False
        self.session_loaded = False  # a bucket was loaded in the open session

    def init_group(self, body: dict[str, Any]) -> tuple[bool, str]:
        name, backend = body["group_name"], body["backend"]
        if name in self.groups:
            return False, (f"Failed to initialize custom process group: group {name!r} already exists; "
                           "call /destroy_weights_update_group first.")
        if backend == "nccl" and not torch.cuda.is_available():
            return False, ("Failed to initialize custom process group: backend 'nccl' needs CUDA and this "
                           "server has none; use backend 'gloo' (NcclSync(backend='gloo')).")
        host = body["master_address"]
        init_method = f"tcp://[{host}]:{body['master_port']}" if ":" in host else f"tcp://{host}:{body['master_port']}"
        rank = body["rank_offset"]  # + tp rank, which is 0: this server is one rank
        try:
            pg = new_custom_group(backend, init_method, body["world_size"], rank, name, self.group_timeout)
        except Exception as e:  # noqa: BLE001 - reported to the caller, as SGLang does
            return False, f"Failed to initialize custom process group: {e}."
        self.groups[name] = (pg, backend)
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, name: str) -> tuple[bool, str]:
        if name not in self.groups:
            return False, "The group to be destroyed does not exist."
        pg, _ = self.groups.pop(name)
        try:
            dist.destroy_process_group(pg)
        except Exception as e:  # noqa: BLE001
            return False, f"Failed to destroy custom process group: {e}."
        return True, "Succeeded to destroy custom process group."

    def begin(self) -> tuple[bool, str]:
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open, self.session_loaded = True, False
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    def update(self, body: dict[str, Any]) -> tuple[bool, str]:
        """Receive one bucket from rank 0 of the group, then load it into the engine.

        The bytes are received before anything is checked, so a refused update never
        leaves the trainer blocked in its broadcast; a refused load changes no weight
        (LocalEngine checks every name and shape before copying).
        """
        name = body["group_name"]
        if name not in self.groups:
            return False, (f"Failed to receive weights: Group {name} not in {list(self.groups)}. "
                           "Please call `init_weights_update_group` first.")
        metas = [TensorMeta(n, tuple(s), d) for n, d, s in zip(body["names"], body["dtypes"], body["shapes"])]
        try:
            weights = self._receive(metas, body["load_format"], body["nnz"], *self.groups[name])
        except Exception as e:  # noqa: BLE001 - the group is probably broken: say so
            return False, f"Failed to receive weights: {e}"
        if not self.session_open:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        return self._load(weights, body)

    @staticmethod
    def _receive(metas: list[TensorMeta], load_format: str | None, nnz: list[int] | None, pg: Any,
                 backend: str) -> list[Any]:
        """What rank 0 broadcasts: one uint8 bucket ("flattened_bucket"), one tensor per name, or the
        changed elements of each (SPARSE_FORMAT: (name, values, indices or None))."""
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        if load_format == SPARSE_FORMAT:
            flat = torch.empty(sparse_bucket_nbytes(metas, nnz or []), dtype=torch.uint8, device=device)
            dist.broadcast(flat, src=0, group=pg)
            return unflatten_sparse(flat, metas, nnz or [])
        if load_format == "flattened_bucket":
            flat = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device=device)
            dist.broadcast(flat, src=0, group=pg)
            return unflatten_bucket(flat, metas)
        out = []
        for m in metas:
            t = torch.empty(m.shape, dtype=getattr(torch, m.dtype), device=device)
            dist.broadcast(t, src=0, group=pg)
            out.append((m.name, t))
        return out

    def _load(self, weights: list[tuple[str, torch.Tensor]], body: dict[str, Any]) -> tuple[bool, str]:
        engine = self.engine
        if body["abort_all_requests"]:
            engine.pause_generation("abort")
        try:
            if body["load_format"] == SPARSE_FORMAT:
                engine.update_weights_sparse(weights, body["weight_version"])
            else:
                engine.update_weights_from_tensors(weights, body["weight_version"])
        except (ValueError, MemoryReleasedError) as e:
            earlier = (" Earlier updates of this session were loaded: the served weights mix versions."
                       if self.session_loaded else "")
            return False, f"Failed to update parameter online: {e}.{earlier}"
        finally:
            if body["abort_all_requests"]:
                engine.continue_generation()
        self.session_loaded = True
        refused = refused_flush(engine) if body["flush_cache"] else None
        if refused:
            return False, refused
        return True, "Succeeded to update parameter online."


def _check_update_body(body: dict[str, Any]) -> None:
    """names / dtypes / shapes describe the same tensors; dtypes are torch names; shapes are sizes."""
    path = UPDATE_FROM_DISTRIBUTED
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(f"{path}: names, dtypes and shapes must be non-empty lists of one length, got "
                         f"{len(names)}, {len(dtypes)} and {len(shapes)}")
    for i, (n, d, s) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(n, str):
            raise BadRequest(f"{path}: names[{i}] must be a string, got {n!r}")
        if not isinstance(d, str) or not isinstance(getattr(torch, d, None), torch.dtype):
            raise BadRequest(f"{path}: dtypes[{i}] ({n}) must name a torch dtype (\"bfloat16\"), got {d!r}")
        if not isinstance(s, list) or not all(_is_int(x) and x >= 0 for x in s):
            raise BadRequest(f"{path}: shapes[{i}] ({n}) must be a list of sizes, got {s!r}")
    if body["load_format"] not in (None, "flattened_bucket", SPARSE_FORMAT):
        raise BadRequest(f"{path}: load_format must be null (one broadcast per tensor), \"flattened_bucket\" or "
                         f"\"{SPARSE_FORMAT}\" (this server's element deltas), got {body['load_format']!r}")
    nnz = body["nnz"]
    if (nnz is not None) != (body["load_format"] == SPARSE_FORMAT):
        raise BadRequest(f"{path}: field 'nnz' goes with load_format \"{SPARSE_FORMAT}\" and only with it")
    if nnz is not None and (len(nnz) != len(names) or not all(_is_int(k) and k >= -1 for k in nnz)):
        raise BadRequest(f"{path}: nnz must hold one count >= -1 per tensor ({len(names)}), got {nnz!r:.200}")


async def _on_update_thread(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking weight-group call on the update thread; the event loop keeps serving /health."""
    return await asyncio.get_running_loop().run_in_executor(request.app[UPDATE_EXECUTOR], fn, *args)


async def _init_weights_update_group(request: web.Request) -> web.Response:
    """Join the trainer's update group as rank `rank_offset`; returns once the group is formed."""
    body = _fields(await _read_json(request), INIT_GROUP, _INIT_GROUP_FIELDS)
    if not 1 <= body["rank_offset"] < body["world_size"]:
        raise BadRequest(f"/init_weights_update_group: rank_offset must be in [1, world_size) (rank 0 is the "
                         f"trainer), got rank_offset={body['rank_offset']}, world_size={body['world_size']}")
    return _outcome(*await _on_update_thread(request, request.app[GROUPS].init_group, body))


async def _destroy_weights_update_group(request: web.Request) -> web.Response:
    body = _fields(await _read_json(request), DESTROY_GROUP, _GROUP_NAME_FIELDS)
    return _outcome(*await _on_update_thread(request, request.app[GROUPS].destroy_group, body["group_name"]))


async def _exclusive_update(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    """A weight-update call as SGLang runs it: after the running /generate requests (new ones wait),
    unless generation is paused (moe_rl/rollout/server/update_lock.py)."""
    async with request.app[UPDATE_LOCK].exclusive(request.app[ENGINE]):
        return await _on_update_thread(request, fn, *args)


async def _begin_weight_update(request: web.Request) -> web.Response:
    await _read_json(request)  # BeginWeightUpdateReqInput: only `selector`, and this server has one runner
    return _outcome(*await _exclusive_update(request, request.app[GROUPS].begin))


async def _end_weight_update(request: web.Request) -> web.Response:
    await _read_json(request)
    return _outcome(*await _exclusive_update(request, request.app[GROUPS].end))


async def _update_weights_from_distributed(request: web.Request) -> web.Response:
    body = _fields(await _read_json(request), UPDATE_FROM_DISTRIBUTED, _UPDATE_FIELDS)
    _check_update_body(body)
    return _outcome(*await _exclusive_update(request, request.app[GROUPS].update, body))


def weight_checksums(engine: Any, skip: list[str] | None = None) -> dict[str, Any]:
    """`/weights_checker` action "checksum" as SGLang 0.5.23 answers it (srt/utils/weight_checker.py),
    one rank: each tensor's checksum under the checkpoint's HF names, which are this server's names."""
    sums = {}
    state = dict(engine.model.named_parameters()) | dict(engine.model.named_buffers())
    for name in checkpoint_names(engine.model_path):
        if skip and any(s in name for s in skip):
            continue
        view = served_view(state, name)
        if view is not None:
            sums[name] = tensor_checksum(view)
    per_gpu = hashlib.sha256()
    for name in sorted(sums):
        per_gpu.update(name.encode())
        per_gpu.update(sums[name].encode())
    info = {"checksums": sums, "per_gpu_checksum": per_gpu.hexdigest(),
            "parallelism_info": {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                 "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}}
    return {"ranks": [info], "per_engine_checksum": hashlib.sha256(info["per_gpu_checksum"].encode()).hexdigest()}


async def _weights_checker(request: web.Request) -> web.Response:
    """Only the "checksum" action (SGLang also snapshots, compares and resets weights, for its own tests)."""
    body = _fields(await _read_json(request), WEIGHTS_CHECKER, _CHECK_FIELDS)
    if body["action"] != "checksum":
        return _outcome(False, f"Unsupported action={body['action']!r}: this server computes checksums only")
    engine = request.app[ENGINE]
    result = await _on_update_thread(request, weight_checksums, engine, body["skip_tensor_list"])
    return _outcome(True, "Success", **result)


async def _update_weight_version(request: web.Request) -> web.Response:
    body = _fields(await _read_json(request), UPDATE_WEIGHT_VERSION, _VERSION_FIELDS)
    engine = request.app[ENGINE]
    if body["abort_all_requests"]:  # SGLang aborts the running requests first
        engine.pause_generation("abort")
        engine.continue_generation()
    engine.set_weight_version(body["new_version"])
    return _outcome(True, f"Weight version updated to {body['new_version']}", new_version=body["new_version"])
