"""`POST /generate` (whole replies and SGLang's server-sent-event stream) and `POST /abort_request`.

Streaming follows SGLang 0.5.23's default (incremental_streaming_output off): each event is
`data: <json>\\n\\n` holding the sample's text and output_ids so far (cumulative) and its meta_info, one
event per decode step; the sample's last event has its finish_reason (and routed experts); the stream
ends with `data: [DONE]\\n\\n` (http_server.serve_generate_request, tokenizer_manager._handle_batch_output).
Events of a batch or of n > 1 samples carry "index", the sample's place in prompt-major order. An error
once the stream started is an event {"error": {...}} before [DONE], as SGLang sends it.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from aiohttp import web

from moe_rl.rollout.engine import GenerateRequest, GenerateResult
from moe_rl.rollout.memory import MemoryReleasedError
from moe_rl.rollout.server.common import (BATCHER, ENGINE, LIVE, MAX_REQUEST_TOKENS, RETURN_ROUTES, UPDATE_LOCK,
                                          BadRequest, _fields, _read_json)
from moe_rl.rollout.server.live import Hooks, with_hooks
from moe_rl.rollout.server.protocol import GenerateCall, parse_generate, sample_json
from moe_rl.rollout.sglang_api import ABORT_REQUEST


def check_size(request: web.Request, reqs: list[GenerateRequest]) -> None:
    work = sum(len(r.prompt_ids) + r.sampling.n * r.sampling.max_new_tokens for r in reqs)
    if work > request.app[MAX_REQUEST_TOKENS]:
        raise BadRequest(f"this request asks for {work} tokens (prompt tokens + n x max_new_tokens, summed over "
                         f"its prompts); the server takes at most {request.app[MAX_REQUEST_TOKENS]} per request "
                         "(--max-request-tokens): send it in smaller requests")


async def run_call(app: web.Application, call: GenerateCall, on_progress=None) -> list[list[GenerateResult]]:
    """The call's samples through the batcher, each abortable by its rid (and reporting progress)."""
    n = call.reqs[0].sampling.n
    live = app[LIVE]
    loop = asyncio.get_running_loop()
    reqs = [with_hooks(r, Hooks(live, call.rids[k * n:(k + 1) * n],
                                None if on_progress is None else (lambda j, res, k=k: on_progress(k * n + j, res)),
                                loop)) for k, r in enumerate(call.reqs)]
    live.add(call.rids)
    try:
        async with app[UPDATE_LOCK].shared():  # a weight update waits for this request
            return await app[BATCHER].submit(reqs)
    except (ValueError, MemoryReleasedError) as e:  # released memory: refused loudly, as a GPU would fail
        raise BadRequest(str(e)) from None
    finally:
        live.remove(call.rids)


def replies(call: GenerateCall, results: list[list[GenerateResult]], engine: Any) -> list[dict[str, Any]]:
    """Every sample's reply dict, prompt-major."""
    out, k = [], 0
    for req, rl, res_list in zip(call.reqs, call.return_logprob, results):
        for res in res_list:
            out.append(sample_json(res, req, call.rids[k], rl, engine, call.routes_start, call.text_in_logprobs,
                                   arrival=call.arrival))
            k += 1
    return out


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    call = parse_generate(await _read_json(request), engine, request.app[RETURN_ROUTES])
    check_size(request, call.reqs)
    if call.stream:
        return await sse(request, _native_events(request.app, call))
    out = replies(call, await run_call(request.app, call), engine)
    return web.json_response(out[0] if call.is_single and len(out) == 1 else out)


async def sample_events(app: web.Application, call: GenerateCall) -> AsyncIterator[tuple[int, dict[str, Any], bool]]:
    """(sample index, reply dict so far, finished) of a running call: one event per sample and decode step,
    then each sample's final reply. Leaving early (the client went away) aborts its samples."""
    engine = app[ENGINE]
    n = call.reqs[0].sampling.n
    events: asyncio.Queue = asyncio.Queue()

    def progress(index: int, res: GenerateResult) -> None:
        k = index // n
        events.put_nowait((index, sample_json(res, call.reqs[k], call.rids[index], call.return_logprob[k], engine,
                                              call.routes_start, call.text_in_logprobs, finished=False)))

    task = asyncio.ensure_future(run_call(app, call, progress))
    try:
        while not task.done() or not events.empty():
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                index, out = getter.result()
                yield index, out, False
            else:
                getter.cancel()
        for index, out in enumerate(replies(call, task.result(), engine)):
            yield index, out, True
    finally:
        if not task.done():
            for rid in call.rids:
                app[LIVE].abort(rid, False)
            task.cancel()


def event(data: Any) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def sse(request: web.Request, chunks: AsyncIterator[bytes]) -> web.StreamResponse:
    """A server-sent-event stream of `chunks`, then `data: [DONE]`; an error once it started is an event
    {"error": {...}} before [DONE], as SGLang's stream_results sends it."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async for chunk in chunks:
            await resp.write(chunk)
    except BadRequest as e:
        await resp.write(event({"error": {"message": str(e), "type": "invalid_request_error", "code": 400,
                                          "retryable": False}}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _native_events(app: web.Application, call: GenerateCall) -> AsyncIterator[bytes]:
    """/generate's events: the sample's cumulative reply; "index" for a batch or n > 1 samples."""
    indexed = not (call.is_single and call.reqs[0].sampling.n == 1)
    async for index, out, _ in sample_events(app, call):
        if indexed:
            out["index"] = index
        yield event(out)


_ABORT_FIELDS = {"rid": ((str, type(None)), ""), "abort_all": (bool, False)}


async def abort_request(request: web.Request) -> web.Response:
    """SGLang's /abort_request {rid, abort_all}: the samples end at their next step with finish_reason abort
    (queued ones before they start); 200 with an empty body, also when no such rid is live."""
    body = _fields(await _read_json(request), ABORT_REQUEST, _ABORT_FIELDS)
    rid, abort_all = body["rid"] or "", body["abort_all"]
    if abort_all or rid:  # an empty rid without abort_all is ignored (it would match every request)
        request.app[LIVE].abort(rid, abort_all)
    return web.Response(status=200)
