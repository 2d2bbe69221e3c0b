"""`moe-rl serve`: SGLang's native HTTP API over `LocalEngine` (CPU rollouts, tests, demos).

The JSON shapes mirror SGLang (read from the sglang 0.5.x wheel):

  POST /generate                 body: `GenerateReqInput` (sglang/srt/managers/io_struct.py):
                                 input_ids (list or list of lists) | text, sampling_params (dict or
                                 list), return_logprob, return_routed_experts,
                                 routed_experts_start_len, rid.
                                 reply: one dict per sample, {"output_ids", "meta_info", ["text"]}
                                 (TokenizerManager._handle_batch_output, sglang/srt/managers/
                                 tokenizer_manager.py); a single dict for one prompt with n == 1,
                                 else a list in prompt-major order (prompt 0 samples 0..n-1, ...),
                                 as TokenizerManager._handle_batch_request expands it.
  meta_info                      id, finish_reason ({"type": "stop", "matched": token} |
                                 {"type": "length", "length": max_new_tokens} | {"type": "abort",
                                 "message", "status_code", "err_type"}: BaseFinishReason.to_json in
                                 sglang/srt/managers/schedule_batch.py), prompt_tokens,
                                 completion_tokens, cached_tokens, weight_version, num_retractions,
                                 output_token_logprobs [[logprob, token_id, None], ...]
                                 (detokenize_logprob_tokens), routed_experts: base64 of int32
                                 [len(prompt + output) - 1, num_hidden_layers, topk]
                                 (DetokenizerManager._b64_encode_per_request; rows of dense layers
                                 are 0, as SGLang's zero-initialised capture buffer leaves them).
  errors                         {"error": {"message": ...}} with status 400 (http_server.py
                                 _create_error_response); 413 for a body over --max-body-mb.
  POST /update_weights_from_disk {"model_path", "weight_version"?, "abort_all_requests"?} ->
                                 {"success", "message", "num_paused_requests"}, 200 or 400
                                 (UpdateWeightFromDiskReqInput / ...ReqOutput).
  GET|POST /flush_cache          200, plain text, as SGLang.
  POST /pause_generation         {"mode": "abort" | "retract" | "in_place"} (PauseGenerationReqInput)
  POST /continue_generation      -> {"message": ..., "status": "ok"}
  GET /health                    200, empty body, without generating (503 when the engine is down).
  GET /health_generate           generates one greedy token from [0]; 200 when it (or any other
                                 forward step) completes within --health-check-timeout, else 503.
  GET /model_info                SGLang's keys (model_path, is_generation, weight_version, ...)
                                 plus moe-rl extras that SGLang leaves out: num_hidden_layers,
                                 moe_layer_ids, num_experts, num_experts_per_tok, vocab_size.
                                 /get_model_info is its deprecated alias, as in SGLang 0.5.23.
  GET /server_info               launch options (tp_size, dp_size, model_path, context_length, ...);
                                 /get_server_info is the deprecated alias.
  Distributed weight sync (the trainer is rank 0 of a process group it creates with the servers;
  `NcclSync` in weight_sync/nccl.py drives it; gloo stands in for NCCL on CPU). Replies are
  {"success", "message"}, 200 or 400, as SGLang's:
  POST /init_weights_update_group   InitWeightsUpdateGroupReqInput {master_address, master_port,
                                 rank_offset, world_size, group_name, backend}: join as rank
                                 rank_offset (one tp rank); answers once the group is formed.
  POST /destroy_weights_update_group  {group_name}
  POST /begin_weight_update, /end_weight_update   open / close the update session; a second begin
                                 or an end without begin is refused, as SGLang's scheduler does.
                                 Generation goes on during a session (SGLang blocks it only while
                                 each update call runs); each call's load is atomic between decode steps.
  POST /update_weights_from_distributed  UpdateWeightsFromDistributedReqInput {names, dtypes, shapes,
                                 group_name, flush_cache, abort_all_requests, weight_version,
                                 load_format}: receives rank 0's broadcast (one uint8 bucket for
                                 "flattened_bucket", else one per name), then loads it. Refused
                                 (400, nothing loaded) outside a session, for an unknown name or a
                                 wrong shape (the message names the tensor), or while released.
                                 With flush_cache while a generate call is in the engine, the
                                 weights load but the call fails, as SGLang's refused flush does.
  POST /update_weight_version    {new_version, abort_all_requests} -> {"success", "message", "new_version"}
  GET|POST /release_memory_occupation, /resume_memory_occupation   {tags?: subset of
                                 ["kv_cache", "weights", "cuda_graph"]}: 200 with a null body, as
                                 SGLang. Needs --enable-memory-saver (400 without: SGLang would
                                 free nothing). Nothing is freed on CPU, but what SGLang loses is
                                 lost: released weights become noise (kept with
                                 --enable-weights-cpu-backup), and while released /generate and
                                 /health_generate fail and weight loads are refused, as they would
                                 on a GPU. Releasing twice is a no-op; resuming what is not
                                 released is a 400 (SGLang raises there too).

Differences from SGLang, on purpose: `sampling_seed` is always honoured (SGLang needs
--enable-deterministic-inference), and with n > 1 sample j uses seed s + j (SGLang
gives every copy the same seed); log-probs are log_softmax(logits / T) as SGLang's
(see --logprob-mode and local_engine.py); there is no prefix cache, so /flush_cache is a no-op.

Generation runs in one worker thread. Each /generate call is cut into chunks of at most
--max-batch samples, and every engine call takes the next chunk of each waiting call in
turn, so /health keeps answering, concurrent calls are safe and a small request waits one
chunk behind a huge one, not the whole of it. A call whose client disconnects is
cancelled: its chunks not yet in the engine are dropped. Weight updates load and validate
in another thread and swap between two decode steps.

Access (SGLang's scheme, moe_rl/rollout/auth.py): `--config FILE` with `api-key:` /
`admin-api-key:` lines makes every endpoint but /health* need `Authorization: Bearer KEY`
(the weight and control endpoints the admin key), 401 otherwise. /update_weights_from_disk
loads only from under a `--trusted-dir` (default: the directory holding --model), 403
otherwise. `--served-model-name` is what /server_info reports, so a trainer can tell its
own servers from whatever else answers on the port.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from aiohttp import web

from moe_rl.rollout.auth import decide, read_key_file
from moe_rl.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from moe_rl.rollout.memory import MemoryReleasedError
from moe_rl.rollout.weight_sync import TensorMeta, new_custom_group, unflatten_bucket

log = logging.getLogger(__name__)

DEFAULT_PORT = 30000  # SGLang's default

ENGINE: web.AppKey[Any] = web.AppKey("engine", object)
BATCHER: web.AppKey["_Batcher"] = web.AppKey("batcher", object)
UPDATE_EXECUTOR: web.AppKey[ThreadPoolExecutor] = web.AppKey("update_executor", ThreadPoolExecutor)
MAX_BODY: web.AppKey[int] = web.AppKey("client_max_size", int)
GROUPS: web.AppKey["_UpdateGroups"] = web.AppKey("update_groups", object)
SERVER_ARGS: web.AppKey[dict] = web.AppKey("server_args", dict)
HEALTH_TIMEOUT: web.AppKey[float] = web.AppKey("health_timeout", float)
MAX_REQUEST_TOKENS: web.AppKey[int] = web.AppKey("max_request_tokens", int)
KEYS: web.AppKey[tuple] = web.AppKey("keys", tuple)
TRUSTED: web.AppKey[Any] = web.AppKey("trusted_dirs", object)
DEFAULT_MAX_REQUEST_TOKENS = 1 << 18  # 256k new tokens: a full RL step of the demo is ~4k

HEALTH_CHECK_TIMEOUT = 20.0  # s; SGLang's default (SGLANG_HEALTH_CHECK_TIMEOUT, http_server.py)


class BadRequest(ValueError):
    """A malformed request: answered with 400 and the message."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


# ------------------------------------------------------------------- request parsing
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_generate(body: Any, engine: Any) -> tuple[list[GenerateRequest], bool, list[bool], list[str], int]:
    """SGLang `GenerateReqInput` JSON -> (requests, is_single, return_logprob per prompt, rids,
    routed_experts_start_len)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by moe-rl serve")
    ids = body.get("input_ids")
    text = body.get("text")
    if ids is None and text is None:
        raise BadRequest("send input_ids (a list of token ids, or a list of such lists)")
    if ids is not None and text is not None:
        raise BadRequest("send either input_ids or text, not both")
    if ids is None:
        tok = engine.tokenizer
        if tok is None:
            raise BadRequest("this model directory has no tokenizer files, so `text` cannot be "
                             "tokenized: send `input_ids` (token ids) instead")
        if isinstance(text, str):
            ids = tok(text)["input_ids"]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            ids = [tok(t)["input_ids"] for t in text]
        else:
            raise BadRequest("text must be a string or a non-empty list of strings")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids or a list of such lists")
    is_single = _is_int(ids[0])
    batch = [ids] if is_single else ids
    for k, p in enumerate(batch):
        if not isinstance(p, list) or not p or not all(_is_int(t) for t in p):
            raise BadRequest(f"input_ids[{k}] must be a non-empty list of integers" if not is_single
                             else "input_ids must be a list of integers")
    sp = body.get("sampling_params")
    if sp is None or isinstance(sp, dict):
        sps = [sp or {}] * len(batch)
    elif isinstance(sp, list) and len(sp) == len(batch) and all(isinstance(s, dict) for s in sp):
        sps = sp
    else:
        raise BadRequest("sampling_params must be an object, or a list of objects, one per prompt")
    try:
        params = [SamplingParams.from_sglang(s) for s in sps]
    except (TypeError, ValueError) as e:
        raise BadRequest(f"invalid sampling_params: {e}") from None
    if len({p.n for p in params}) > 1:
        raise BadRequest("sampling_params.n must be the same for every prompt of a batch")
    rl = body.get("return_logprob", False)
    rls = list(rl) if isinstance(rl, list) else [bool(rl)] * len(batch)
    if len(rls) != len(batch):
        raise BadRequest("return_logprob must be a bool or a list with one bool per prompt")
    rre = body.get("return_routed_experts", False)
    if not isinstance(rre, bool):
        raise BadRequest("return_routed_experts must be a bool")
    start = body.get("routed_experts_start_len") or 0
    if not _is_int(start) or not 0 <= start <= min(len(p) for p in batch):
        raise BadRequest("routed_experts_start_len must be an integer in [0, prompt_tokens]")
    reqs = [GenerateRequest(p, s, return_routed_experts=rre) for p, s in zip(batch, params)]
    for k, r in enumerate(reqs):
        try:
            engine.validate(r)
        except ValueError as e:
            raise BadRequest(f"input {k}: {e}") from None
    rid = body.get("rid")
    n_out = len(batch) * params[0].n
    if isinstance(rid, list) and len(rid) == n_out:
        rids = [str(r) for r in rid]
    elif isinstance(rid, str) and n_out == 1:
        rids = [rid]
    else:
        rids = [uuid.uuid4().hex for _ in range(n_out)]
    return reqs, is_single, [bool(x) for x in rls], rids, start


# ----------------------------------------------------------------- response building
def _finish_json(res: GenerateResult, req: GenerateRequest) -> dict[str, Any]:
    """`BaseFinishReason.to_json()` (sglang/srt/managers/schedule_batch.py)."""
    if res.finish_reason == "stop":
        return {"type": "stop", "matched": res.output_ids[-1]}  # FINISH_MATCHED_TOKEN
    if res.finish_reason == "length":
        return {"type": "length", "length": len(res.output_ids)}  # FINISH_LENGTH
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT


def encode_routes(routes: np.ndarray, moe_layer_ids: list[int], num_hidden_layers: int) -> str:
    """Routes [N, num_moe_layers, k] -> SGLang's base64 of int32 [N, num_hidden_layers, k]."""
    n, _, k = routes.shape
    full = np.zeros((n, num_hidden_layers, k), dtype="<i4")
    full[:, moe_layer_ids, :] = routes
    return base64.b64encode(full.tobytes()).decode("ascii")


def _sample_json(res: GenerateResult, req: GenerateRequest, rid: str, return_logprob: bool,
                 engine: Any, routes_start: int = 0) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_json(res, req),
        "prompt_tokens": len(res.prompt_ids),
        "weight_version": res.weight_version,
        "num_retractions": 0,
    }
    if return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[float(lp), int(t), None]
                                         for lp, t in zip(res.output_logprobs.tolist(), res.output_ids)]
        meta["output_token_logprobs_length"] = len(res.output_ids)
    meta.update({"reasoning_tokens": 0, "completion_tokens": len(res.output_ids), "cached_tokens": 0})
    if req.return_routed_experts and res.routed_experts is not None:
        # rows [routed_experts_start_len, len - 1), as SGLang's get_topk(start_len=...)
        meta["routed_experts"] = encode_routes(res.routed_experts[routes_start:], engine.moe_layer_ids,
                                               engine.num_hidden_layers)
    out: dict[str, Any] = {}
    tok = engine.tokenizer
    if tok is not None:  # without tokenizer files the reply has no "text", as SGLang with skip_tokenizer_init
        out["text"] = tok.decode(res.output_ids)
    out["output_ids"] = list(res.output_ids)
    out["meta_info"] = meta
    return out


# -------------------------------------------------------------------------- batcher
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


# ---------------------------------------------------------------------------- app
@web.middleware
async def _json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        text = e.text or e.reason
        if e.status == 413:
            text = (f"request body too large ({e.reason}); the server accepts at most "
                    f"{request.app[MAX_BODY]} bytes (--max-body-mb)")
        return _error(e.status, text)
    except BadRequest as e:
        return _error(400, str(e))
    except Exception as e:  # noqa: BLE001
        log.exception("error in %s %s", request.method, request.path)
        return _error(500, f"{type(e).__name__}: {e}")


@web.middleware
async def _auth(request: web.Request, handler):
    """SGLang's Bearer-key check (moe_rl/rollout/auth.py): 401 before any work is done."""
    api_key, admin_key = request.app[KEYS]
    if decide(request.path, request.method, request.headers.get("Authorization"), api_key, admin_key):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def _untrusted(path: str, trusted: Any) -> str | None:
    """Why `path` may not be loaded (None when it lies under a --trusted-dir, or none were set)."""
    if trusted is None:
        return None
    real = Path(path).resolve()
    if any(real == d or d in real.parents for d in trusted):
        return None
    return (f"{path} is not under a trusted directory ({', '.join(map(str, trusted)) or 'none'}); "
            "start the server with --trusted-dir to allow it")


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the request body nests JSON too deeply") from None


async def _generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _read_json(request)
    reqs, is_single, return_logprob, rids, routes_start = _parse_generate(body, engine)
    work = sum(len(r.prompt_ids) + r.sampling.n * r.sampling.max_new_tokens for r in reqs)
    if work > request.app[MAX_REQUEST_TOKENS]:
        raise BadRequest(f"this request asks for {work} tokens (prompt tokens + n x max_new_tokens, summed over "
                         f"its prompts); the server takes at most {request.app[MAX_REQUEST_TOKENS]} per request "
                         "(--max-request-tokens): send it in smaller requests")
    try:
        results = await request.app[BATCHER].submit(reqs)
    except (ValueError, MemoryReleasedError) as e:  # released memory: refused loudly, as a GPU would fail
        raise BadRequest(str(e)) from None
    out = []
    k = 0
    for req, rl, res_list in zip(reqs, return_logprob, results):
        for res in res_list:
            out.append(_sample_json(res, req, rids[k], rl, engine, routes_start))
            k += 1
    return web.json_response(out[0] if is_single and len(out) == 1 else out)


async def _update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
        raise BadRequest("send {\"model_path\": \"<HF checkpoint dir>\", \"weight_version\": ...}")
    refused = _untrusted(body["model_path"], request.app[TRUSTED])
    if refused:
        return web.json_response({"success": False, "message": refused, "num_paused_requests": 0}, status=403)
    version = body.get("weight_version")
    abort = bool(body.get("abort_all_requests", False))
    loop = asyncio.get_running_loop()

    def work() -> None:
        if abort:
            engine.pause_generation("abort")
        try:
            engine.update_weights_from_disk(body["model_path"], None if version is None else str(version))
        finally:
            if abort:
                engine.continue_generation()

    try:
        await loop.run_in_executor(request.app[UPDATE_EXECUTOR], work)
    except Exception as e:  # noqa: BLE001 - refused update: old weights keep serving
        return web.json_response({"success": False, "message": f"Failed to update weights: {e}",
                                  "num_paused_requests": 0}, status=400)
    return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                              "num_paused_requests": 0})


async def _flush_cache(request: web.Request) -> web.Response:
    request.app[ENGINE].flush_cache()
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                             "(When there are running or waiting requests, the operation will not be performed.)\n")


async def _pause(request: web.Request) -> web.Response:
    body = await _read_json(request)
    mode = (body or {}).get("mode", "abort") if isinstance(body, dict) else "abort"
    try:
        request.app[ENGINE].pause_generation(mode)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def _continue(request: web.Request) -> web.Response:
    request.app[ENGINE].continue_generation()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE].health() else 503)


async def _health_generate(request: web.Request) -> web.Response:
    """GET /health_generate: 200 once the engine generates, 503 if it cannot within the timeout.

    As SGLang's handler: one greedy token from prompt [0]; a forward step of other
    requests after the probe arrived counts as healthy too (a busy engine is alive).
    A released engine refuses the probe, so it answers 503 until resumed.
    """
    engine = request.app[ENGINE]
    if not engine.health():
        return web.Response(status=503)
    tic = time.monotonic()
    probe = GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0, seed=0))
    task = asyncio.ensure_future(request.app[BATCHER].submit([probe]))
    try:
        while time.monotonic() < tic + request.app[HEALTH_TIMEOUT]:
            if task.done():
                if task.exception() is None:
                    return web.Response(status=200)
                log.warning("health check generation failed: %s", task.exception())
                return web.Response(status=503)
            if getattr(engine, "last_forward_time", 0.0) > tic:
                return web.Response(status=200)
            await asyncio.sleep(0.02)
        log.error("health check failed: no forward step within %.0f s", request.app[HEALTH_TIMEOUT])
        return web.Response(status=503)
    finally:
        task.cancel()  # a probe still queued is dropped by the batcher


def model_info(engine: Any) -> dict[str, Any]:
    cfg = engine.config
    return {
        # SGLang's /model_info keys (sglang/srt/entrypoints/http_server.py)
        "model_path": engine.model_path,
        "served_model_name": engine.model_path,
        "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "load_format": None,
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
        # moe-rl extras
        "num_hidden_layers": engine.num_hidden_layers,
        "moe_layer_ids": engine.moe_layer_ids,
        "num_experts": engine.num_experts,
        "num_experts_per_tok": engine.topk or None,
        "vocab_size": engine.vocab_size,
    }


async def _model_info(request: web.Request) -> web.Response:
    return web.json_response(model_info(request.app[ENGINE]))


def server_info(engine: Any, server_args: dict[str, Any]) -> dict[str, Any]:
    """GET /server_info: the `ServerArgs` fields SGLang 0.5.23 reports that mean something here.

    SGLang returns every resolved launch option plus the scheduler's limits
    (http_server.py `server_info`, utils/common.py `build_server_info`); a client or
    sglang-router reads the parallel sizes, the model and the limits. moe-rl serve is
    one process on one device: tp/dp/pp/ep sizes are 1.
    """
    ctx = engine.max_positions
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
        "served_model_name": server_args.get("served_model_name") or engine.model_path,
        "skip_tokenizer_init": engine.tokenizer is None,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
        "page_size": 1,
        "context_length": ctx,
        "max_req_input_len": ctx - 1 if ctx else None,  # validate() refuses prompts of >= ctx tokens
        "max_running_requests": server_args.get("max_running_requests"),
        "load_format": "auto",
        "disaggregation_mode": "null",
        "enable_return_routed_experts": bool(engine.moe_layer_ids),
        "enable_memory_saver": bool(getattr(getattr(engine, "memory", None), "memory_saver", False)),
        "enable_weights_cpu_backup": bool(getattr(getattr(engine, "memory", None), "weights_cpu_backup", False)),
        "weight_version": engine.weight_version,
        **{k: v for k, v in server_args.items() if k not in ("max_running_requests", "served_model_name")},
        # SGLang's internal_states hold scheduler state per dp rank; here, this engine's
        "internal_states": [{"memory_released": engine.memory_released,
                             "generating": bool(getattr(engine, "busy", False))}],
        "frontend": "moe-rl serve",
    }


async def _server_info(request: web.Request) -> web.Response:
    return web.json_response(server_info(request.app[ENGINE], request.app[SERVER_ARGS]))


# ---------------------------------------------------------- distributed weight updates
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
            weights = self._receive(metas, body["load_format"], *self.groups[name])
        except Exception as e:  # noqa: BLE001 - the group is probably broken: say so
            return False, f"Failed to receive weights: {e}"
        if not self.session_open:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        return self._load(weights, body)

    @staticmethod
    def _receive(metas: list[TensorMeta], load_format: str | None, pg: Any,
                 backend: str) -> list[tuple[str, torch.Tensor]]:
        """The tensors rank 0 broadcasts: one uint8 bucket ("flattened_bucket") or one per name."""
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
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
            engine.update_weights_from_tensors(weights, body["weight_version"])
        except (ValueError, MemoryReleasedError) as e:
            earlier = (" Earlier updates of this session were loaded: the served weights mix versions."
                       if self.session_loaded else "")
            return False, f"Failed to update parameter online: {e}.{earlier}"
        finally:
            if body["abort_all_requests"]:
                engine.continue_generation()
        self.session_loaded = True
        # SGLang flushes only an idle scheduler, and a refused flush fails the call although
        # the weights were loaded (flush_cache_after_weight_update): a trainer that syncs while
        # generation runs learns it here too.
        if body["flush_cache"] and (getattr(engine, "busy", False) or not engine.flush_cache()):
            return False, ("Weights were updated, but the cache was not flushed because requests are still "
                           "running or queued. Retract or finish them, then call /flush_cache.")
        return True, "Succeeded to update parameter online."


# Request fields (sglang 0.5.23 io_struct.py): name -> (accepted types, default; _REQUIRED = no default).
_REQUIRED = object()
_INIT_GROUP_FIELDS = {"master_address": (str, _REQUIRED), "master_port": (int, _REQUIRED),
                      "rank_offset": (int, _REQUIRED), "world_size": (int, _REQUIRED),
                      "group_name": (str, "weight_update_group"), "backend": (str, "nccl")}
_UPDATE_FIELDS = {"names": (list, _REQUIRED), "dtypes": (list, _REQUIRED), "shapes": (list, _REQUIRED),
                  "group_name": (str, "weight_update_group"), "flush_cache": (bool, True),
                  "abort_all_requests": (bool, False), "weight_version": ((str, type(None)), None),
                  "load_format": ((str, type(None)), None)}
_GROUP_NAME_FIELDS = {"group_name": (str, "weight_update_group")}
_VERSION_FIELDS = {"new_version": (str, _REQUIRED), "abort_all_requests": (bool, True)}
_MEMORY_FIELDS = {"tags": ((list, type(None)), None)}


def _fields(body: Any, path: str, spec: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The request's fields with their defaults; a missing or mistyped one is a 400 naming it.

    Unknown fields (rid, selector, ...) are ignored.
    """
    if not isinstance(body, dict):
        raise BadRequest(f"{path}: the request body must be a JSON object")
    out = {}
    for name, (types, default) in spec.items():
        if name not in body:
            if default is _REQUIRED:
                raise BadRequest(f"{path}: field {name!r} is required")
            out[name] = default
            continue
        value = body[name]
        plain = types if isinstance(types, tuple) else (types,)
        if not isinstance(value, plain) or (isinstance(value, bool) and bool not in plain):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in plain)
            raise BadRequest(f"{path}: field {name!r} must be {want}, got {value!r}")
        out[name] = value
    return out


def _check_update_body(body: dict[str, Any]) -> None:
    """names / dtypes / shapes describe the same tensors; dtypes are torch names; shapes are sizes."""
    path = "/update_weights_from_distributed"
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
    if body["load_format"] not in (None, "flattened_bucket"):
        raise BadRequest(f"{path}: load_format must be null (one broadcast per tensor) or \"flattened_bucket\", "
                         f"got {body['load_format']!r}")


def _outcome(ok: bool, message: str, **extra: Any) -> web.Response:
    """SGLang's {"success", "message"} reply: 200, or 400 when not successful."""
    return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)


async def _on_update_thread(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking weight-group call on the update thread; the event loop keeps serving /health."""
    return await asyncio.get_running_loop().run_in_executor(request.app[UPDATE_EXECUTOR], fn, *args)


async def _init_weights_update_group(request: web.Request) -> web.Response:
    """Join the trainer's update group as rank `rank_offset`; returns once the group is formed."""
    body = _fields(await _read_json(request), "/init_weights_update_group", _INIT_GROUP_FIELDS)
    if not 1 <= body["rank_offset"] < body["world_size"]:
        raise BadRequest(f"/init_weights_update_group: rank_offset must be in [1, world_size) (rank 0 is the "
                         f"trainer), got rank_offset={body['rank_offset']}, world_size={body['world_size']}")
    return _outcome(*await _on_update_thread(request, request.app[GROUPS].init_group, body))


async def _destroy_weights_update_group(request: web.Request) -> web.Response:
    body = _fields(await _read_json(request), "/destroy_weights_update_group", _GROUP_NAME_FIELDS)
    return _outcome(*await _on_update_thread(request, request.app[GROUPS].destroy_group, body["group_name"]))


async def _begin_weight_update(request: web.Request) -> web.Response:
    await _read_json(request)  # BeginWeightUpdateReqInput: only `selector`, and this server has one runner
    return _outcome(*await _on_update_thread(request, request.app[GROUPS].begin))


async def _end_weight_update(request: web.Request) -> web.Response:
    await _read_json(request)
    return _outcome(*await _on_update_thread(request, request.app[GROUPS].end))


async def _update_weights_from_distributed(request: web.Request) -> web.Response:
    body = _fields(await _read_json(request), "/update_weights_from_distributed", _UPDATE_FIELDS)
    _check_update_body(body)
    return _outcome(*await _on_update_thread(request, request.app[GROUPS].update, body))


async def _update_weight_version(request: web.Request) -> web.Response:
    body = _fields(await _read_json(request), "/update_weight_version", _VERSION_FIELDS)
    engine = request.app[ENGINE]
    if body["abort_all_requests"]:  # SGLang aborts the running requests first
        engine.pause_generation("abort")
        engine.continue_generation()
    engine.set_weight_version(body["new_version"])
    return _outcome(True, f"Weight version updated to {body['new_version']}", new_version=body["new_version"])


def _memory_handler(path: str, method: str) -> Callable[[web.Request], Any]:
    """POST|GET `path` ({tags}: Release/ResumeMemoryOccupationReqInput): the engine's `method`;
    SGLang answers 200 with a null body."""
    async def handler(request: web.Request) -> web.Response:
        body = _fields(await _read_json(request), path, _MEMORY_FIELDS)
        try:
            getattr(request.app[ENGINE], method)(body["tags"])
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return web.json_response(None)

    return handler


_release_memory = _memory_handler("/release_memory_occupation", "release_memory_occupation")
_resume_memory = _memory_handler("/resume_memory_occupation", "resume_memory_occupation")


# (methods, paths, handler): SGLang 0.5.23's native routes this server answers. A deprecated
# alias sits next to its new name, as SGLang keeps both.
ROUTES: list[tuple[tuple[str, ...], tuple[str, ...], Callable[[web.Request], Any]]] = [
    (("POST", "PUT"), ("/generate",), _generate),
    (("GET",), ("/health",), _health),
    (("GET",), ("/health_generate",), _health_generate),
    (("GET",), ("/model_info", "/get_model_info"), _model_info),
    (("GET",), ("/server_info", "/get_server_info"), _server_info),
    (("GET", "POST"), ("/flush_cache",), _flush_cache),
    (("POST",), ("/pause_generation",), _pause),
    (("POST",), ("/continue_generation",), _continue),
    (("POST",), ("/update_weights_from_disk",), _update_weights_from_disk),
    (("POST",), ("/init_weights_update_group",), _init_weights_update_group),
    (("POST",), ("/destroy_weights_update_group",), _destroy_weights_update_group),
    (("POST",), ("/begin_weight_update",), _begin_weight_update),
    (("POST",), ("/end_weight_update",), _end_weight_update),
    (("POST",), ("/update_weights_from_distributed",), _update_weights_from_distributed),
    (("POST",), ("/update_weight_version",), _update_weight_version),
    (("GET", "POST"), ("/release_memory_occupation",), _release_memory),
    (("GET", "POST"), ("/resume_memory_occupation",), _resume_memory),
]


def make_app(engine: Any, *, max_batch: int = 32, max_body_mb: float = 64.0,
             health_timeout: float = HEALTH_CHECK_TIMEOUT, group_timeout: timedelta = timedelta(minutes=10),
             server_args: dict[str, Any] | None = None,
             max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS, api_key: str | None = None,
             admin_api_key: str | None = None, trusted_dirs: Sequence[str | Path] | None = None) -> web.Application:
    """The aiohttp application serving `engine` (a LocalEngine) over SGLang's native API.

    api_key / admin_api_key: SGLang's Bearer keys (moe_rl/rollout/auth.py). trusted_dirs:
    the only directories /update_weights_from_disk loads from (None = any).

    health_timeout: seconds /health_generate waits for a forward step; group_timeout: how
    long joining a weight-update group (and each broadcast) may take; server_args: launch
    options reported by /server_info (host, port, random_seed, ...).
    """
    size = int(max_body_mb * 1024 * 1024)
    app = web.Application(client_max_size=size, middlewares=[_auth, _json_errors])
    app[KEYS] = (api_key, admin_api_key)
    app[TRUSTED] = None if trusted_dirs is None else [Path(d).resolve() for d in trusted_dirs]
    app[ENGINE] = engine
    app[MAX_BODY] = size
    app[BATCHER] = _Batcher(engine, max_batch)
    app[UPDATE_EXECUTOR] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rl-weights")
    app[GROUPS] = _UpdateGroups(engine, group_timeout)
    app[SERVER_ARGS] = {"max_running_requests": max_batch, **(server_args or {})}
    app[HEALTH_TIMEOUT] = float(health_timeout)
    app[MAX_REQUEST_TOKENS] = int(max_request_tokens)

    async def on_startup(app: web.Application) -> None:
        app[BATCHER].start()

    async def on_cleanup(app: web.Application) -> None:
        engine.continue_generation()  # release a generate call parked by a pause
        await app[BATCHER].stop()
        app[UPDATE_EXECUTOR].shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for methods, paths, handler in ROUTES:
        for path in paths:
            for method in methods:
                if method == "GET":
                    app.router.add_get(path, handler)  # HEAD too, as before
                else:
                    app.router.add_route(method, path, handler)
    return app


# ------------------------------------------------------------------- in-process server
class ServerThread:
    """Serve an engine from a background thread (tests, notebooks, single-process demos).

    `with ServerThread(engine) as srv: SGLangClient([srv.url]) ...`; port 0 picks a free port.
    """

    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 32,
                 max_body_mb: float = 64.0, health_timeout: float = HEALTH_CHECK_TIMEOUT):
        self.engine, self.host, self.port = engine, host, port
        self._app_kw = dict(max_batch=max_batch, max_body_mb=max_body_mb, health_timeout=health_timeout)
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


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port (default {DEFAULT_PORT}, as SGLang; 0 picks a free one)")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without sampling_seed")
    parser.add_argument("--max-batch", type=int, default=32, help="samples per engine batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto",
                        help="torch device; auto (default) = cuda when a GPU is visible (the nccl weight sync "
                             "receives on it), else cpu")
    parser.add_argument("--logprob-mode", default="scaled", choices=["scaled", "raw"],
                        help="scaled: log_softmax(logits / T), the distribution sampled from (SGLang's default, "
                             "what the trainer recomputes); raw: log_softmax(logits) at any T (SGLang with "
                             "SGLANG_RETURN_ORIGINAL_LOGPROB=1), for comparisons")
    parser.add_argument("--weight-version", default="default", help="initial weight_version (SGLang: 'default')")
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body accepted (413 beyond)")
    parser.add_argument("--max-request-tokens", type=int, default=DEFAULT_MAX_REQUEST_TOKENS,
                        help="most tokens one /generate request may cost, prompt tokens + n x max_new_tokens over "
                             f"its prompts (400 beyond; default {DEFAULT_MAX_REQUEST_TOKENS}), so that one request "
                             "cannot hold the server for long")
    parser.add_argument("--health-check-timeout", type=float, default=HEALTH_CHECK_TIMEOUT,
                        help="seconds /health_generate waits for a forward step before answering 503 (SGLang: 20)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--config", default=None,
                        help="YAML file with 'api-key: KEY' and 'admin-api-key: KEY' lines (as SGLang's --config): "
                             "every endpoint but /health* then needs 'Authorization: Bearer KEY', weight and "
                             "control endpoints the admin key; keep the file mode 600")
    parser.add_argument("--trusted-dir", action="append", default=None,
                        help="a directory /update_weights_from_disk may load from (repeatable); default: the "
                             "directory that holds --model. Other paths are refused with 403")
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="let /release_memory_occupation release memory (SGLang's flag, for colocated runs); "
                             "without it a release is refused. A released weights region loses its content, as "
                             "SGLang's: load weights after resuming, or pass --enable-weights-cpu-backup")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="keep the weights across a release (SGLang copies them to host memory)")
    parser.add_argument("--served-model-name", default=None,
                        help="name /server_info reports (SGLang's flag; the launcher sets the run id, so a "
                             "trainer recognises its own servers)")


def run(args: argparse.Namespace) -> int:
    from moe_rl.rollout.local_engine import LocalEngine

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        keys = read_key_file(args.config) if args.config else None
    except ValueError as e:
        print(f"moe-rl serve: --config: {e}", file=sys.stderr)
        return 2
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    engine = LocalEngine(args.model, seed=args.seed, dtype=args.dtype, device=device,
                         max_batch=args.max_batch, logprob_mode=args.logprob_mode,
                         weight_version=args.weight_version, memory_saver=args.enable_memory_saver,
                         weights_cpu_backup=args.enable_weights_cpu_backup)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        app = make_app(engine, max_batch=args.max_batch, max_body_mb=args.max_body_mb,
                       health_timeout=args.health_check_timeout, max_request_tokens=args.max_request_tokens,
                       server_args={"host": args.host, "random_seed": args.seed,
                                    "served_model_name": args.served_model_name},
                       api_key=keys.api_key if keys else None, admin_api_key=keys.admin_api_key if keys else None,
                       trusted_dirs=args.trusted_dir or [Path(args.model).resolve().parent])
        # handler_cancellation: a client that disconnects cancels its call (and its queued chunks)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = app[SERVER_ARGS]["port"] = _bound_port(site, args.port)
        print(f"serving {args.model} on http://{args.host}:{port}", flush=True)
        try:
            await stop.wait()
        finally:
            # End in-flight samples now (finish_reason "abort"): a long request must not hold
            # SIGTERM for as long as it would take to finish, nor start its next chunk.
            await app[BATCHER].stop()
            engine.pause_generation("abort")
            await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        engine.close()
    return 0
