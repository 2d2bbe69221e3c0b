"""The aiohttp application: SGLang 0.5.23's native routes over a `LocalEngine` (`make_app`)."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

from aiohttp import web

from moe_rl.rollout.auth import decide
from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.server.batcher import _Batcher
from moe_rl.rollout.server.common import (_MEMORY_FIELDS, BATCHER, DEFAULT_MAX_REQUEST_TOKENS, ENGINE, GROUPS,
                                          HEALTH_CHECK_TIMEOUT, HEALTH_TIMEOUT, KEYS, LIVE, MAX_BODY,
                                          MAX_REQUEST_TOKENS, RETURN_ROUTES, SERVER_ARGS, TRUSTED, UPDATE_EXECUTOR,
                                          UPDATE_LOCK, BadRequest, ContractError, _error, _fields, _read_json,
                                          refused_flush)
from moe_rl.rollout.server.generate import abort_request, generate
from moe_rl.rollout.server.live import LiveRequests
from moe_rl.rollout.server.openai import ROUTES as OPENAI_ROUTES
from moe_rl.rollout.server.update_lock import ModelUpdateLock
from moe_rl.rollout.server.updates import (_begin_weight_update, _destroy_weights_update_group, _end_weight_update,
                                           _init_weights_update_group, _update_weight_version, _weights_checker,
                                           _update_weights_from_distributed, _UpdateGroups)
from moe_rl.rollout.sglang_api import (ABORT_REQUEST, BEGIN_UPDATE, CONTINUE_GENERATION, DESTROY_GROUP, END_UPDATE,
                                       FLUSH_CACHE, GENERATE, HEALTH, HEALTH_GENERATE, INIT_GROUP, MODEL_INFO,
                                       MODEL_INFO_OLD, PAUSE_GENERATION, RELEASE_MEMORY, RESUME_MEMORY, SERVER_INFO,
                                       SERVER_INFO_OLD, UPDATE_FROM_DISK, UPDATE_FROM_DISTRIBUTED,
                                       UPDATE_WEIGHT_VERSION, WEIGHTS_CHECKER)

log = logging.getLogger(__name__)

# /server_info's "version": the SGLang release whose HTTP API this server speaks (its "frontend" says it is
# moe-rl serve), so a client gating features on SGLang's version reads the API it gets.
SGLANG_API_VERSION = "0.5.23"

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
    except ContractError as e:
        return web.json_response({"error": str(e)}, status=400)
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


async def _update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
        raise BadRequest("send {\"model_path\": \"<HF checkpoint dir>\", \"weight_version\": ...}")
    refused = _untrusted(body["model_path"], request.app[TRUSTED])
    if refused:  # SGLang answers a path it cannot load with 400 and this body
        return web.json_response({"success": False, "message": f"Failed to get weights iterator: {refused}.",
                                  "num_paused_requests": 0}, status=400)
    version = body.get("weight_version")
    abort = bool(body.get("abort_all_requests", False))
    flush = bool(body.get("flush_cache", True))  # SGLang's default
    loop = asyncio.get_running_loop()

    def work() -> None:
        if abort:
            engine.pause_generation("abort")
        try:
            engine.update_weights_from_disk(body["model_path"], None if version is None else str(version))
        finally:
            if abort:
                engine.continue_generation()

    refused = None
    try:
        async with request.app[UPDATE_LOCK].exclusive(engine):  # after the running requests, unless paused
            await loop.run_in_executor(request.app[UPDATE_EXECUTOR], work)
            # the flush goes with the load, before a waiting request is let in (SGLang's scheduler does both
            # in one step): else that request could read a prefix the old weights computed
            refused = refused_flush(engine) if flush else None
    except Exception as e:  # noqa: BLE001 - refused update: old weights keep serving
        return web.json_response({"success": False, "message": f"Failed to update weights: {e}",
                                  "num_paused_requests": 0}, status=400)
    if refused:
        return web.json_response({"success": False, "message": refused, "num_paused_requests": 0}, status=400)
    return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                              "num_paused_requests": 0})


async def _flush_cache(request: web.Request) -> web.Response:
    """SGLang's /flush_cache[?timeout=s]: empties the prefix cache when the engine is idle (requests paused by
    a retract count as idle), else 400; with a timeout it waits that long for the engine to become idle."""
    try:
        timeout = float(request.query.get("timeout", 0.0))
    except ValueError:
        raise BadRequest(f"timeout must be a number of seconds >= 0, got {request.query.get('timeout')!r}") from None
    engine, batcher = request.app[ENGINE], request.app[BATCHER]
    deadline = time.monotonic() + max(0.0, timeout)

    def flushed() -> bool:  # SGLang counts its waiting queue too, unless generation is paused
        return not (batcher.jobs and not getattr(engine, "paused", False)) and engine.flush_cache()

    ok = flushed()
    while not ok and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        ok = flushed()
    if ok:
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")
    return web.Response(status=400, text="Timed out waiting for idle state." if timeout > 0
                        else "Flush cache failed.\n")


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
        "enable_return_routed_experts": bool(server_args.get("enable_return_routed_experts")),
        "disable_radix_cache": getattr(engine, "prefix_cache", None) is None,
        "max_total_num_tokens": getattr(getattr(engine, "prefix_cache", None), "max_tokens", None),
        "disable_overlap_schedule": not getattr(engine, "overlap_labels", False),
        "enable_memory_saver": bool(getattr(getattr(engine, "memory", None), "memory_saver", False)),
        "enable_weights_cpu_backup": bool(getattr(getattr(engine, "memory", None), "weights_cpu_backup", False)),
        "weight_version": engine.weight_version,
        "moe_rl_sparse_updates": True,  # takes load_format "moe_rl_sparse" (element deltas); SGLang has none
        **{k: v for k, v in server_args.items() if k not in ("max_running_requests", "served_model_name",
                                                             "enable_return_routed_experts")},
        # SGLang's internal_states hold scheduler state per dp rank; here, this engine's
        "internal_states": [{"memory_released": engine.memory_released,
                             "generating": bool(getattr(engine, "busy", False))}],
        "version": SGLANG_API_VERSION,
        "frontend": "moe-rl serve",
    }


async def _server_info(request: web.Request) -> web.Response:
    return web.json_response(server_info(request.app[ENGINE], request.app[SERVER_ARGS]))


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


_release_memory = _memory_handler(RELEASE_MEMORY, "release_memory_occupation")


_resume_memory = _memory_handler(RESUME_MEMORY, "resume_memory_occupation")


# (methods, paths, handler): SGLang 0.5.23's native routes this server answers. A deprecated
# alias sits next to its new name, as SGLang keeps both.
ROUTES: list[tuple[tuple[str, ...], tuple[str, ...], Callable[[web.Request], Any]]] = [
    (("POST", "PUT"), (GENERATE,), generate),
    (("POST",), (ABORT_REQUEST,), abort_request),
    (("GET",), (HEALTH,), _health),
    (("GET",), (HEALTH_GENERATE,), _health_generate),
    (("GET",), (MODEL_INFO, MODEL_INFO_OLD), _model_info),
    (("GET",), (SERVER_INFO, SERVER_INFO_OLD), _server_info),
    (("GET", "POST"), (FLUSH_CACHE,), _flush_cache),
    (("POST",), (PAUSE_GENERATION,), _pause),
    (("POST",), (CONTINUE_GENERATION,), _continue),
    (("POST",), (UPDATE_FROM_DISK,), _update_weights_from_disk),
    (("POST",), (INIT_GROUP,), _init_weights_update_group),
    (("POST",), (DESTROY_GROUP,), _destroy_weights_update_group),
    (("POST",), (BEGIN_UPDATE,), _begin_weight_update),
    (("POST",), (END_UPDATE,), _end_weight_update),
    (("POST",), (UPDATE_FROM_DISTRIBUTED,), _update_weights_from_distributed),
    (("POST",), (UPDATE_WEIGHT_VERSION,), _update_weight_version),
    (("GET", "POST"), (WEIGHTS_CHECKER,), _weights_checker),
    (("GET", "POST"), (RELEASE_MEMORY,), _release_memory),
    (("GET", "POST"), (RESUME_MEMORY,), _resume_memory),
]


def make_app(engine: Any, *, max_batch: int = 32, max_body_mb: float = 64.0,
             health_timeout: float = HEALTH_CHECK_TIMEOUT, group_timeout: timedelta = timedelta(minutes=10),
             server_args: dict[str, Any] | None = None,
             max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS, api_key: str | None = None,
             admin_api_key: str | None = None, trusted_dirs: Sequence[str | Path] | None = None,
             enable_return_routed_experts: bool = False) -> web.Application:
    """The aiohttp application serving `engine` (a LocalEngine) over SGLang's native API.

    api_key / admin_api_key: SGLang's Bearer keys (moe_rl/rollout/auth.py). trusted_dirs:
    the only directories /update_weights_from_disk loads from (None = any). enable_return_routed_experts:
    SGLang's flag; without it no reply carries routed_experts (SGLang has no route capturer then).

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
    app[UPDATE_LOCK] = ModelUpdateLock()
    app[SERVER_ARGS] = {"max_running_requests": max_batch, **(server_args or {})}
    app[HEALTH_TIMEOUT] = float(health_timeout)
    app[MAX_REQUEST_TOKENS] = int(max_request_tokens)
    app[RETURN_ROUTES] = bool(enable_return_routed_experts)
    app[SERVER_ARGS]["enable_return_routed_experts"] = bool(enable_return_routed_experts)
    app[LIVE] = LiveRequests()

    async def on_startup(app: web.Application) -> None:
        app[BATCHER].start()

    async def on_cleanup(app: web.Application) -> None:
        engine.continue_generation()  # release a generate call parked by a pause
        await app[BATCHER].stop()
        app[UPDATE_EXECUTOR].shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    for methods, paths, handler in ROUTES + OPENAI_ROUTES:
        for path in paths:
            for method in methods:
                if method == "GET":
                    app.router.add_get(path, handler)  # HEAD too, as before
                else:
                    app.router.add_route(method, path, handler)
    return app
