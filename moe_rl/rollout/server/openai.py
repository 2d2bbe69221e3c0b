"""SGLang's OpenAI-compatible endpoints over `moe-rl serve` (sglang/srt/entrypoints/openai/, 0.5.23): what
agent harnesses and the `openai` client speak.

  GET  /v1/models                 the served model (--served-model-name, else the model path)
  POST /v1/completions            prompt: a string, strings, token ids or lists of them
  POST /v1/chat/completions       messages rendered by the checkpoint tokenizer's chat template
  POST /tokenize, /v1/tokenize    {prompt | messages, add_special_tokens} -> {tokens, count, max_model_len}
  POST /detokenize, /v1/detokenize  {tokens, skip_special_tokens} -> {text}

Each request becomes a native /generate call (protocol.py), so sampling, log-probs and the prefix cache are
the same. Supported fields: model (any name, as SGLang takes), max_tokens (completions default 16;
chat: max_completion_tokens or max_tokens, default the rest of the context), temperature, top_p, top_k, n,
seed, stop, stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, stream, stream_options
{include_usage}, logprobs (completions: an int, the top ones per token; chat: a bool, with top_logprobs),
user, rid, and for chat continue_final_message and chat_template_kwargs. Refused with a 400 naming the
field when set to anything but their neutral value: echo, suffix, best_of, logit_bias, frequency_penalty,
presence_penalty, repetition_penalty, min_p, min_tokens, response_format, json_schema, regex, ebnf,
stop_regex, tools, tool_choice, functions, function_call, lora_path; a chat message whose content has a
part other than text. Other fields are ignored, as SGLang's request models ignore them. Replies are
SGLang's shapes (id, object, created, model, choices with finish_reason and matched_stop, usage,
metadata.weight_version); errors are SGLang's {"object": "error", "message", "type", "param", "code"}.
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from aiohttp import web

from moe_rl.rollout.server.common import ENGINE, RETURN_ROUTES, SERVER_ARGS, BadRequest, _read_json
from moe_rl.rollout.server.generate import check_size, event, replies, run_call, sample_events, sse
from moe_rl.rollout.server.protocol import parse_generate
from moe_rl.rollout.sglang_api import GENERATE

_SAMPLING = ("temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
             "no_stop_trim")
_NEUTRAL = {"echo": False, "suffix": None, "best_of": 1, "logit_bias": None, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0,
            "response_format": None, "json_schema": None, "regex": None, "ebnf": None, "stop_regex": None,
            "tools": None, "tool_choice": "none", "functions": None, "function_call": None, "lora_path": None}


def _error(message: str, status: int = 400) -> web.Response:
    """SGLang's OpenAI error (serving_base.create_error_response)."""
    return web.json_response({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                              "code": status}, status=status)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, neutral in _NEUTRAL.items():
        if body.get(key) not in (neutral, None, [], {}):
            raise BadRequest(f"{key} is not supported by moe-rl serve's OpenAI endpoints: leave it out (see "
                             "moe_rl/rollout/server/openai.py for what is)")


def _native(body: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """The native /generate body of an OpenAI request (SGLang's _build_sampling_params)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _refuse_unsupported(body)
    sp = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    sp["max_new_tokens"] = max_new_tokens
    if body.get("seed") is not None:
        sp["sampling_seed"] = body["seed"]
    native: dict[str, Any] = {"sampling_params": sp, "return_text_in_logprobs": True}
    if body.get("rid") is not None:
        native["rid"] = body["rid"]
    return native


def _usage(samples: list[dict[str, Any]], n: int) -> dict[str, Any]:
    prompt = sum(samples[i]["meta_info"]["prompt_tokens"] for i in range(0, len(samples), n))
    completion = sum(s["meta_info"]["completion_tokens"] for s in samples)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None, "reasoning_tokens": 0}


def _finish(meta: dict[str, Any]) -> tuple[str | None, Any]:
    fr = meta.get("finish_reason")
    return (fr["type"], fr.get("matched")) if fr else (None, None)


def _served_name(request: web.Request) -> str:
    return request.app[SERVER_ARGS].get("served_model_name") or request.app[ENGINE].model_path


async def models(request: web.Request) -> web.Response:
    name = _served_name(request)
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
        "parent": None, "max_model_len": request.app[ENGINE].max_positions}]})


# ----------------------------------------------------------------------------------------------- completions
def _completion_logprobs(meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
    """to_openai_style_logprobs of the output tokens from `start`: tokens, token_logprobs, top_logprobs,
    text_offset (-1: not supported, as SGLang)."""
    out = meta.get("output_token_logprobs", [])[start:]
    return {"tokens": [t for _, _, t in out], "token_logprobs": [lp for lp, _, _ in out],
            "top_logprobs": [None if row is None else {t: lp for lp, _, t in row}
                             for row in meta.get("output_top_logprobs", [])[start:]],
            "text_offset": [-1] * len(out)}


async def completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await _read_json(request)
        native = _native(body, int(body.get("max_tokens") or 16) if isinstance(body, dict) else 16)
        prompt = body.get("prompt")
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            raise BadRequest("Prompt cannot be empty")
        if isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], str)):
            native["text"] = prompt
        else:
            native["input_ids"] = prompt
        if body.get("logprobs") is not None:
            native.update(return_logprob=True, top_logprobs_num=int(body["logprobs"]))
        call = parse_generate(native, request.app[ENGINE], request.app[RETURN_ROUTES])
        check_size(request, call.reqs)
    except BadRequest as e:
        return _error(str(e))
    created, model, n = int(time.time()), body.get("model", "default"), call.reqs[0].sampling.n

    def choice(index: int, meta: dict[str, Any], text: str, start: int = 0) -> dict[str, Any]:
        reason, matched = _finish(meta)
        return {"index": index, "text": text, "finish_reason": reason, "matched_stop": matched,
                "logprobs": _completion_logprobs(meta, start) if call.return_logprob[0] else None}

    if body.get("stream"):
        return await sse(request, _completion_stream(request, call, body, created, model, choice))
    try:
        samples = replies(call, await run_call(request.app, call), request.app[ENGINE])
    except BadRequest as e:
        return _error(str(e))
    return web.json_response({
        "id": samples[0]["meta_info"]["id"], "object": "text_completion", "created": created, "model": model,
        "choices": [choice(i, s["meta_info"], s.get("text", "")) for i, s in enumerate(samples)],
        "usage": _usage(samples, n), "metadata": {"weight_version": samples[0]["meta_info"]["weight_version"]}})


async def _completion_stream(request, call, body, created, model, choice) -> AsyncIterator[bytes]:
    sent: dict[int, int] = {}  # text already sent, per choice
    tokens: dict[int, int] = {}  # tokens whose log-probs were sent, per choice
    finals: dict[int, dict[str, Any]] = {}
    async for index, out, finished in sample_events(request.app, call):
        text = out.get("text", "")
        delta, sent[index] = text[sent.get(index, 0):], max(len(text), sent.get(index, 0))
        meta = out["meta_info"]
        if finished:
            finals[index] = out
        elif not delta:
            continue
        c = choice(index, meta, delta, tokens.get(index, 0))
        tokens[index] = meta["completion_tokens"]
        yield event({"id": meta["id"], "object": "text_completion", "created": created, "model": model,
                     "choices": [c]})
    if (body.get("stream_options") or {}).get("include_usage"):
        samples = [finals[i] for i in sorted(finals)]
        yield event({"id": samples[0]["meta_info"]["id"], "object": "text_completion", "created": created,
                     "model": model, "choices": [], "usage": _usage(samples, call.reqs[0].sampling.n)})


# ---------------------------------------------------------------------------------------------------- chat
def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported by moe-rl serve")
            content = "".join(p.get("text", "") for p in content)
        out.append({"role": m["role"], "content": content if content is not None else ""})
    return out


def chat_prompt(tok: Any, body: dict[str, Any]) -> list[int]:
    """The token ids of `messages` under the tokenizer's chat template (SGLang's Jinja path)."""
    if tok is None or not getattr(tok, "chat_template", None):
        raise BadRequest("this model has no chat template (tokenizer files with one): use /v1/completions or "
                         f"{GENERATE}")
    cont = bool(body.get("continue_final_message", False))
    text = tok.apply_chat_template(_messages(body), tokenize=False, add_generation_prompt=not cont,
                                   continue_final_message=cont, **(body.get("chat_template_kwargs") or {}))
    return tok(text, add_special_tokens=False)["input_ids"]


def _chat_logprobs(meta: dict[str, Any]) -> dict[str, Any]:
    tops = meta.get("output_top_logprobs") or []

    def item(lp: float, t: str) -> dict[str, Any]:
        return {"token": t, "bytes": list(t.encode("utf-8")), "logprob": lp}

    return {"content": [{**item(lp, t), "top_logprobs": [item(a, b) for a, _, b in (tops[k] if k < len(tops) and
                                                                                      tops[k] else [])]}
                        for k, (lp, _, t) in enumerate(meta.get("output_token_logprobs", []))]}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await _read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        ids = chat_prompt(engine.tokenizer, body)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        rest = (engine.max_positions or len(ids) + 128) - len(ids)
        native = _native(body, int(limit) if limit else max(rest, 1))
        native["input_ids"] = ids
        if body.get("logprobs"):
            native.update(return_logprob=True, top_logprobs_num=int(body.get("top_logprobs") or 0))
        call = parse_generate(native, engine, request.app[RETURN_ROUTES])
        check_size(request, call.reqs)
    except BadRequest as e:
        return _error(str(e))
    created, model, n = int(time.time()), body.get("model", "default"), call.reqs[0].sampling.n
    if body.get("stream"):
        return await sse(request, _chat_stream(request, call, body, created, model))
    try:
        samples = replies(call, await run_call(request.app, call), engine)
    except BadRequest as e:
        return _error(str(e))
    choices = []
    for i, s in enumerate(samples):
        reason, matched = _finish(s["meta_info"])
        choices.append({"index": i, "message": {"role": "assistant", "content": s.get("text", ""),
                                                "reasoning_content": None, "tool_calls": None},
                        "logprobs": _chat_logprobs(s["meta_info"]) if call.return_logprob[0] else None,
                        "finish_reason": reason, "matched_stop": matched})
    return web.json_response({"id": samples[0]["meta_info"]["id"], "object": "chat.completion", "created": created,
                              "model": model, "choices": choices, "usage": _usage(samples, n),
                              "metadata": {"weight_version": samples[0]["meta_info"]["weight_version"]}})


async def _chat_stream(request, call, body, created, model) -> AsyncIterator[bytes]:
    sent: dict[int, int] = {}
    finals: dict[int, dict[str, Any]] = {}

    def chunk(rid: str, index: int, delta: dict[str, Any], reason: Any = None, matched: Any = None) -> bytes:
        return event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                      "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason,
                                   "matched_stop": matched}]})

    async for index, out, finished in sample_events(request.app, call):
        meta, text = out["meta_info"], out.get("text", "")
        if index not in sent:  # the first chunk of a choice names the role
            sent[index] = 0
            yield chunk(meta["id"], index, {"role": "assistant", "content": ""})
        delta, sent[index] = text[sent[index]:], max(len(text), sent[index])
        if delta:
            yield chunk(meta["id"], index, {"content": delta})
        if finished:
            finals[index] = out
            yield chunk(meta["id"], index, {}, *_finish(meta))
    if (body.get("stream_options") or {}).get("include_usage"):
        samples = [finals[i] for i in sorted(finals)]
        yield event({"id": samples[0]["meta_info"]["id"], "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [], "usage": _usage(samples, call.reqs[0].sampling.n)})


# ---------------------------------------------------------------------------------------- tokenize / detokenize
async def tokenize(request: web.Request) -> web.Response:
    """SGLang's /tokenize (serving_tokenize.py): a prompt (or strings, or chat messages) to token ids."""
    tok = request.app[ENGINE].tokenizer
    body = await _read_json(request)
    if tok is None:
        return _error("this model directory has no tokenizer files: nothing to tokenize with")
    try:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        special = bool(body.get("add_special_tokens", True))
        prompt = body.get("prompt")
        if body.get("messages") is not None:
            tokens: Any = chat_prompt(tok, body)
            count: Any = len(tokens)
        elif isinstance(prompt, str):
            tokens = tok.encode(prompt, add_special_tokens=special)
            count = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [tok.encode(p, add_special_tokens=special) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise BadRequest(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
    except BadRequest as e:
        return _error(str(e))
    return web.json_response({"tokens": tokens, "count": count,
                              "max_model_len": request.app[ENGINE].max_positions or -1})


async def detokenize(request: web.Request) -> web.Response:
    """SGLang's /detokenize: token ids (or lists of them) to text."""
    tok = request.app[ENGINE].tokenizer
    body = await _read_json(request)
    if tok is None:
        return _error("this model directory has no tokenizer files: nothing to detokenize with")
    tokens = body.get("tokens") if isinstance(body, dict) else None
    skip = bool(body.get("skip_special_tokens", True)) if isinstance(body, dict) else True
    if isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return web.json_response({"text": tok.decode(tokens, skip_special_tokens=skip)})
    if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
        return web.json_response({"text": [tok.decode(t, skip_special_tokens=skip) for t in tokens]})
    return _error("tokens must be a list of token ids or a list of such lists")


ROUTES = [
    (("GET",), ("/v1/models",), models),
    (("POST",), ("/v1/completions",), completions),
    (("POST",), ("/v1/chat/completions",), chat_completions),
    (("POST",), ("/tokenize", "/v1/tokenize"), tokenize),
    (("POST",), ("/detokenize", "/v1/detokenize"), detokenize),
]
