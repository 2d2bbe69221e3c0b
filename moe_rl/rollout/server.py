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
  GET /health, /health_generate  200, empty body (503 when the engine is down).
  GET /get_model_info, /model_info   SGLang's keys (model_path, is_generation, weight_version, ...)
                                 plus moe-rl extras that SGLang leaves out: num_hidden_layers,
                                 moe_layer_ids, num_experts, num_experts_per_tok, vocab_size.

Differences from SGLang, on purpose: `sampling_seed` is always honoured (SGLang needs
--enable-deterministic-inference), and with n > 1 sample j uses seed s + j (SGLang
gives every copy the same seed); log-probs are temperature-1 by default (see
--logprob-mode and local_engine.py); there is no prefix cache, so /flush_cache is a no-op.

Generation runs in one worker thread; requests that arrive while it is busy are
batched together into the next engine call (up to --max-batch samples), so
/health keeps answering and concurrent /generate calls are safe. Weight updates
load and validate in another thread and swap between two decode steps.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from aiohttp import web

from moe_rl.rollout.engine import GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_PORT = 30000  # SGLang's default

ENGINE: web.AppKey[Any] = web.AppKey("engine", object)
BATCHER: web.AppKey["_Batcher"] = web.AppKey("batcher", object)
UPDATE_EXECUTOR: web.AppKey[ThreadPoolExecutor] = web.AppKey("update_executor", ThreadPoolExecutor)
MAX_BODY: web.AppKey[int] = web.AppKey("client_max_size", int)


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
class _Batcher:
    """Collects /generate calls that arrive while the engine is busy into one engine call."""

    def __init__(self, engine: Any, max_batch: int):
        self.engine = engine
        self.max_batch = max(1, int(max_batch))
        self.queue: asyncio.Queue = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rl-generate")
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, reqs: list[GenerateRequest]) -> list[list[GenerateResult]]:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((reqs, fut))
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self.queue.get()
            batch = [item]
            rows = sum(r.sampling.n for r in item[0])
            while rows < self.max_batch and not self.queue.empty():
                nxt = self.queue.get_nowait()
                batch.append(nxt)
                rows += sum(r.sampling.n for r in nxt[0])
            batch = [(reqs, fut) for reqs, fut in batch if not fut.done()]  # caller went away
            if not batch:
                continue
            flat = [r for reqs, _ in batch for r in reqs]
            try:
                results = await loop.run_in_executor(self.executor, self.engine.generate, flat)
            except Exception as e:  # noqa: BLE001 - reported to every caller of this batch
                log.exception("generation failed")
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            k = 0
            for reqs, fut in batch:
                if not fut.done():
                    fut.set_result(results[k:k + len(reqs)])
                k += len(reqs)


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


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


async def _generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _read_json(request)
    reqs, is_single, return_logprob, rids, routes_start = _parse_generate(body, engine)
    try:
        results = await request.app[BATCHER].submit(reqs)
    except ValueError as e:
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


def make_app(engine: Any, *, max_batch: int = 32, max_body_mb: float = 64.0) -> web.Application:
    """The aiohttp application serving `engine` (a LocalEngine) over SGLang's native API."""
    size = int(max_body_mb * 1024 * 1024)
    app = web.Application(client_max_size=size, middlewares=[_json_errors])
    app[ENGINE] = engine
    app[MAX_BODY] = size
    app[BATCHER] = _Batcher(engine, max_batch)
    app[UPDATE_EXECUTOR] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rl-weights")

    async def on_startup(app: web.Application) -> None:
        app[BATCHER].start()

    async def on_cleanup(app: web.Application) -> None:
        engine.continue_generation()  # release a generate call parked by a pause
        await app[BATCHER].stop()
        app[UPDATE_EXECUTOR].shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_route("POST", "/generate", _generate)
    app.router.add_route("PUT", "/generate", _generate)
    app.router.add_post("/update_weights_from_disk", _update_weights_from_disk)
    app.router.add_route("*", "/flush_cache", _flush_cache)
    app.router.add_post("/pause_generation", _pause)
    app.router.add_post("/continue_generation", _continue)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, _health)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, _model_info)
    return app


# ------------------------------------------------------------------- in-process server
class ServerThread:
    """Serve an engine from a background thread (tests, notebooks, single-process demos).

    `with ServerThread(engine) as srv: SGLangClient([srv.url]) ...`; port 0 picks a free port.
    """

    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 32,
                 max_body_mb: float = 64.0):
        self.engine, self.host, self.port = engine, host, port
        self._app_kw = dict(max_batch=max_batch, max_body_mb=max_body_mb)
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
        runner = web.AppRunner(make_app(self.engine, **self._app_kw), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = _bound_port(site, self.port)
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
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--logprob-mode", default="raw", choices=["raw", "scaled"],
                        help="raw: log_softmax(logits) at temperature 1 (SGLang with "
                             "SGLANG_RETURN_ORIGINAL_LOGPROB=1); scaled: log_softmax(logits / T) (SGLang's default)")
    parser.add_argument("--weight-version", default="default", help="initial weight_version (SGLang: 'default')")
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body accepted (413 beyond)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    from moe_rl.rollout.local_engine import LocalEngine

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LocalEngine(args.model, seed=args.seed, dtype=args.dtype, device=args.device,
                         max_batch=args.max_batch, logprob_mode=args.logprob_mode,
                         weight_version=args.weight_version)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        runner = web.AppRunner(make_app(engine, max_batch=args.max_batch, max_body_mb=args.max_body_mb),
                               access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = _bound_port(site, args.port)
        print(f"serving {args.model} on http://{args.host}:{port}", flush=True)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        engine.close()
    return 0
