"""SGLang's HTTP API as this project speaks it, in one place: the endpoints, the request bodies and
what a failed reply says. The client (`sglang_client.py`, `server_pool.py`), the update-group and
disk weight syncs (`weight_sync/`), the launcher and the key scheme (`auth.py`) call SGLang through
these names, and `moe-rl serve` (`rollout/server/`) answers at the same ones, so a path or a body
changes in one file. How a /generate reply is read (logprobs, version spans, routes) is `wire.py`'s.

Paths are sglang 0.5.23's (`sglang/srt/entrypoints/http_server.py`); each body is the request type
named beside it (`sglang/srt/managers/io_struct.py`), checked against SGLang's own types by
tests/contract/. The transports stay two, each where its caller runs: the rollout client's is
asynchronous (aiohttp, in its event loop, thousands of /generate calls in flight), the weight
syncs' and the launcher's blocking (urllib, on the trainer's thread, a few calls per push).
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from moe_rl.rollout.engine import GenerateRequest

# ---------------------------------------------------------------- endpoints

GENERATE = "/generate"                                # GenerateReqInput
ABORT_REQUEST = "/abort_request"                      # AbortReq
HEALTH = "/health"                                    # answers while the server is up
HEALTH_GENERATE = "/health_generate"                  # runs one token of generation
READINESS = "/readiness"                              # sglang-router: 200 once it has a healthy worker
MODEL_INFO = "/model_info"                            # GET; "/get_model_info" before 0.5
MODEL_INFO_OLD = "/get_model_info"
SERVER_INFO = "/server_info"                          # GET; "/get_server_info" before 0.5
SERVER_INFO_OLD = "/get_server_info"
FLUSH_CACHE = "/flush_cache"
PAUSE_GENERATION = "/pause_generation"                # PauseGenerationReqInput {mode}
CONTINUE_GENERATION = "/continue_generation"          # ContinueGenerationReqInput
RELEASE_MEMORY = "/release_memory_occupation"         # ReleaseMemoryOccupationReqInput
RESUME_MEMORY = "/resume_memory_occupation"           # ResumeMemoryOccupationReqInput
UPDATE_FROM_DISK = "/update_weights_from_disk"        # UpdateWeightFromDiskReqInput
UPDATE_FROM_TENSOR = "/update_weights_from_tensor"    # UpdateWeightsFromTensorReqInput
INIT_GROUP = "/init_weights_update_group"             # InitWeightsUpdateGroupReqInput
DESTROY_GROUP = "/destroy_weights_update_group"       # DestroyWeightsUpdateGroupReqInput
BEGIN_UPDATE = "/begin_weight_update"                 # since 0.5.23; 404 before (updates run without it)
END_UPDATE = "/end_weight_update"
UPDATE_FROM_DISTRIBUTED = "/update_weights_from_distributed"  # UpdateWeightsFromDistributedReqInput
UPDATE_WEIGHT_VERSION = "/update_weight_version"      # UpdateWeightVersionReqInput
WEIGHTS_CHECKER = "/weights_checker"                  # {action: "checksum" | ...}

# Always open, whatever keys are set (sglang/srt/utils/auth.py).
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
# SGLang's ADMIN_OPTIONAL endpoints that moe-rl serve has or that the client calls: the admin key's.
ADMIN_PATHS = frozenset({
    UPDATE_FROM_DISK, INIT_GROUP, DESTROY_GROUP, BEGIN_UPDATE, END_UPDATE, UPDATE_FROM_DISTRIBUTED,
    UPDATE_WEIGHT_VERSION, UPDATE_FROM_TENSOR, "/get_weights_by_name", RELEASE_MEMORY, RESUME_MEMORY,
    FLUSH_CACHE, PAUSE_GENERATION, CONTINUE_GENERATION, ABORT_REQUEST, "/start_profile", "/stop_profile",
    "/set_internal_state", WEIGHTS_CHECKER,
})

# SGLang's label of the weights a server starts with (sglang/srt/arg_groups/fields/serving.py
# `weight_version`): the run's version 0, and the first span of every request alive at the first push.
INITIAL_WEIGHT_VERSION = "default"

# `moe-rl serve`'s sparse update (not SGLang's): per tensor `nnz[i]` changed elements as int32 flat
# indices then values, or the whole tensor where nnz[i] is -1 (moe_rl/rollout/weight_sync/delta.py).
SPARSE_FORMAT = "moe_rl_sparse"


# ---------------------------------------------------------------- request bodies

def generate_payload(req: GenerateRequest) -> dict[str, Any]:
    """Body of POST /generate (GenerateReqInput) for one request of n samples."""
    body = {"input_ids": list(req.prompt_ids), "sampling_params": req.sampling.to_sglang(),
            "return_logprob": True, "return_routed_experts": bool(req.return_routed_experts)}
    if req.return_routed_experts and req.routed_experts_start_len:
        body["routed_experts_start_len"] = req.routed_experts_start_len  # rows [start, len - 1) only
    return body


def group_payload(req: GenerateRequest) -> dict[str, Any]:
    """A seeded request's n samples as one batched /generate: the prompt n times, each copy with
    n=1 and its own `sampling_seed` s, s+1, ... (GenerateReqInput takes a list of input_ids with a
    list of sampling_params, one per item, and replies with a list in order). One request per
    prompt group instead of n: each costs the trainer's client a JSON round trip under the GIL."""
    singles = req.single_samples()
    body = generate_payload(req)
    body["input_ids"] = [list(one.prompt_ids) for one in singles]
    body["sampling_params"] = [one.sampling.to_sglang() for one in singles]
    return body


def disk_update_payload(path: str, version: str | None, flush_cache: bool = True) -> dict[str, Any]:
    """Body of POST /update_weights_from_disk (UpdateWeightFromDiskReqInput; flush_cache defaults to true)."""
    payload: dict[str, Any] = {"model_path": path}
    if version is not None:
        payload["weight_version"] = version
    if not flush_cache:
        payload["flush_cache"] = False
    return payload


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str = "nccl") -> dict[str, Any]:
    """Body of POST /init_weights_update_group (InitWeightsUpdateGroupReqInput): server i's TP rank r
    joins as `rank_offset + r`, the trainer is rank 0."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_payload(bucket: Sequence[Any], group_name: str, *, flush_cache: bool,
                   weight_version: str | None, load_format: str | None = "flattened_bucket",
                   nnz: Sequence[int] | None = None) -> dict[str, Any]:
    """Body of POST /update_weights_from_distributed (UpdateWeightsFromDistributedReqInput) for one bucket
    of tensors (each with `name`, `dtype` as torch names it, `shape`); `nnz` only with SPARSE_FORMAT.

    With `load_format="flattened_bucket"` one uint8 tensor holding the bucket's tensors back to back is
    broadcast from rank 0, each tensor's byte offset a multiple of its element size
    (sglang/srt/weight_sync/tensor_bucket.py); with None each tensor is broadcast on its own, in order."""
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
    if nnz is not None:
        body["nnz"] = [int(n) for n in nnz]
    return body


def bucket_payloads(buckets: Sequence[Sequence[Any]], group_name: str, version: int | str, *,
                    flush_cache: bool = True, load_format: str | None = "flattened_bucket") -> list[dict[str, Any]]:
    """One update body per bucket: only the last one flushes the cache and sets the weight version,
    so a server never reports the new version while it still holds part of the old weights."""
    last = len(buckets) - 1
    return [update_payload(b, group_name, flush_cache=flush_cache and i == last,
                           weight_version=str(version) if i == last else None, load_format=load_format)
            for i, b in enumerate(buckets)]


# ---------------------------------------------------------------- replies

def error_text(body: bytes) -> str:
    """The message of an error reply's body (SGLang's `{"error": {"message": ...}}`, `{"message": ...}`, or text)."""
    try:
        d = json.loads(body)
        if isinstance(d, dict):
            err = d.get("error", d.get("message", d))
            if isinstance(err, dict):
                err = err.get("message", err)
            return str(err)[:500]
    except ValueError:
        pass
    return body[:500].decode("utf-8", "replace")


def reply_error(url: str, path: str, status: int, body: Any) -> str | None:
    """None when SGLang's reply says success (HTTP 200 and no `success: false`), else a line naming the
    server and the call."""
    if status == 200 and (not isinstance(body, dict) or body.get("success", True)):
        return None
    msg = body.get("message", body) if isinstance(body, dict) else body
    return f"server {url} {path} (HTTP {status}): {msg}"
