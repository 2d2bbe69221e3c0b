"""`/generate` on the wire: SGLang's `GenerateReqInput` parsed into engine requests, and each sample's
reply (`output_ids`, `meta_info`: finish reason, log-probs, routed experts, weight version).

Parsed by hand because the product does not depend on sglang (its request types import CUDA-only
modules); tests/contract/ checks these rules against sglang's own types and messages.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from moe_rl.rollout.engine import GenerateRequest, GenerateResult, SamplingContractError, SamplingParams
from moe_rl.rollout.server.common import BadRequest, ContractError, _is_int
from moe_rl.routes import encode_b64


@dataclass
class GenerateCall:
    """One /generate body, parsed: its requests (one per prompt), whether the reply is a single dict,
    per prompt return_logprob, per sample (prompt-major) rid, and the reply options."""

    reqs: list[GenerateRequest]
    is_single: bool
    return_logprob: list[bool]
    rids: list[str]
    routes_start: int
    text_in_logprobs: bool
    stream: bool
    arrival: float


def _per_prompt(value: Any, default: Any, name: str, n: int, check) -> list[Any]:
    """SGLang's normalize_param: a scalar for every prompt, or a list of one per prompt."""
    values = list(value) if isinstance(value, list) else [default if value is None else value] * n
    if len(values) != n or not all(check(v) for v in values):
        raise BadRequest(f"{name} must be one value or a list with one per prompt ({n}), got {value!r}")
    return values


def parse_generate(body: Any, engine: Any, return_routes: bool) -> GenerateCall:
    """SGLang `GenerateReqInput` JSON -> a GenerateCall. `return_routes`: the server was started with
    --enable-return-routed-experts (without it SGLang has no route capturer and returns none, silently)."""
    arrival = time.monotonic()
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    ids = body.get("input_ids")
    text = body.get("text")
    if ids is None and text is None:
        raise BadRequest("send input_ids (a list of token ids, or a list of such lists) or text")
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
    except SamplingContractError as e:  # SGLang's contract gate: {"error": "<its message>"}
        raise ContractError(str(e)) from None
    except (TypeError, ValueError) as e:
        raise BadRequest(f"invalid sampling_params: {e}") from None
    if len({p.n for p in params}) > 1:
        raise BadRequest("sampling_params.n must be the same for every prompt of a batch")
    n = len(batch)
    rls = _per_prompt(body.get("return_logprob"), False, "return_logprob", n, lambda v: isinstance(v, bool))
    starts = _per_prompt(body.get("logprob_start_len"), -1, "logprob_start_len", n, _is_int)
    tops = _per_prompt(body.get("top_logprobs_num"), 0, "top_logprobs_num", n, lambda v: _is_int(v) and v >= 0)
    tid = body.get("token_ids_logprob") or None
    if tid is not None and not (isinstance(tid, list) and (all(_is_int(t) for t in tid) or (
            len(tid) == n and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in tid)))):
        raise BadRequest("token_ids_logprob must be a list of token ids, or one such list per prompt")
    tids = [None if tid is None else tuple(tid[k] if tid and isinstance(tid[0], list) else tid) for k in range(n)]
    rre = body.get("return_routed_experts", False)
    if not isinstance(rre, bool):
        raise BadRequest("return_routed_experts must be a bool")
    start = body.get("routed_experts_start_len") or 0
    if not _is_int(start):
        raise BadRequest("routed_experts_start_len must be an integer")
    reqs = []
    ctx = getattr(engine, "max_positions", None)
    for k, (p, s) in enumerate(zip(batch, params)):
        if ctx:  # TokenizerManager._validate_one_request: SGLang refuses, it does not cap
            if len(p) >= ctx:
                raise BadRequest(f"The input ({len(p)} tokens) is longer than the model's context length ({ctx} tokens).")
            asked = sps[k].get("max_new_tokens")
            if asked is not None and asked + len(p) > ctx:
                raise BadRequest(f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                                 f"You requested a total of {asked + len(p)} tokens: {len(p)} tokens from the input "
                                 f"messages and {asked} tokens for the completion. Please reduce the number of tokens "
                                 "in the input messages or the completion to fit within the limit.")
        if rre and start < 0:  # the scheduler's checks and wording (scheduler.py handle_generate_request)
            raise BadRequest(f"recv_req.routed_experts_start_len={start} is lower than 0. "
                             "Please use a non-negative routed_experts_start_len.")
        if rre and start > len(p):
            raise BadRequest(f"recv_req.routed_experts_start_len={start} is higher than the number of input "
                             f"tokens len(req.origin_input_ids)={len(p)}. Please use a smaller routed_experts_start_len.")
        # SGLang ignores logprob_start_len without return_logprob, and -1 means the output tokens only
        ls = starts[k] if rls[k] else -1
        if ls > len(p):
            raise BadRequest(f"req.logprob_start_len={ls} is higher than the number of input tokens "
                             f"len(req.origin_input_ids)={len(p)}. Please use a smaller logprob_start_len.")
        if ls < -1:
            raise BadRequest(f"logprob_start_len must be -1 (output tokens only) or in [0, {len(p)}], got {ls}")
        try:
            req = GenerateRequest(p, s, return_routed_experts=rre and return_routes,
                                  routed_experts_start_len=min(max(start, 0), len(p)) if rre else 0,
                                  logprob_start_len=ls, top_logprobs_num=tops[k] if rls[k] else 0,
                                  token_ids_logprob=tids[k] if rls[k] else None)
            engine.validate(req)
        except ValueError as e:
            raise BadRequest(f"input {k}: {e}") from None
        reqs.append(req)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a bool")
    return GenerateCall(reqs, is_single, [bool(x) for x in rls], _rids(body.get("rid"), n, params[0].n, is_single),
                        start if rre and return_routes else 0, bool(body.get("return_text_in_logprobs", False)),
                        stream, arrival)


def _rids(rid: Any, prompts: int, n: int, is_single: bool) -> list[str]:
    """Per sample rids as SGLang's GenerateReqInput._normalize_rid makes them: the given rid for one
    sample, `rid_i` per prompt of a batch from one string, a list as given; the samples of n > 1 get
    fresh ids (tokenizer_manager regenerates them)."""
    if n > 1:
        return [uuid.uuid4().hex for _ in range(prompts * n)]
    if rid is None:
        return [uuid.uuid4().hex for _ in range(prompts)]
    if isinstance(rid, str):
        return [rid] if is_single else [f"{rid}_{i}" for i in range(prompts)]
    if isinstance(rid, list) and len(rid) == prompts and all(isinstance(r, str) for r in rid):
        return list(rid)
    raise BadRequest("The specified rids length mismatch with the batch_size for batch processing." if
                     isinstance(rid, list) else "The rid should be a string or a list of strings.")


def finish_json(res: GenerateResult) -> dict[str, Any] | None:
    """`BaseFinishReason.to_json()` (sglang/srt/managers/schedule_batch.py); None while running."""
    if res.finish_reason == "stop":
        if res.matched_stop is not None:
            return {"type": "stop", "matched": res.matched_stop}  # FINISH_MATCHED_STR
        return {"type": "stop", "matched": res.output_ids[-1]}  # FINISH_MATCHED_TOKEN
    if res.finish_reason == "length":
        return {"type": "length", "length": len(res.output_ids)}  # FINISH_LENGTH
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT


def reply_text(res: GenerateResult, req: GenerateRequest, tok: Any) -> str:
    """The reply's text (DetokenizerManager.trim_matched_stop): a matched stop string is cut off (kept with
    no_stop_trim), as is a matched stop token, whose text is not decoded."""
    ids = list(res.output_ids)
    if res.finish_reason == "stop" and res.matched_stop is None and ids and not req.sampling.no_stop_trim:
        ids = ids[:-1]
    text = tok.decode(ids, skip_special_tokens=req.sampling.skip_special_tokens)
    if res.matched_stop is not None and (pos := text.find(res.matched_stop)) != -1:
        text = text[:pos + len(res.matched_stop)] if req.sampling.no_stop_trim else text[:pos]
    return text


def _with_text(pairs: list[tuple[float | None, int]], tok: Any, text: bool) -> list[list[Any]]:
    """detokenize_logprob_tokens: [logprob, token id, token text or None]."""
    texts = tok.batch_decode([[t] for _, t in pairs]) if text and tok is not None else [None] * len(pairs)
    return [[lp, t, x] for (lp, t), x in zip(pairs, texts)]


def _ranked(rows: list[Any] | None, tok: Any, text: bool) -> list[Any]:
    """detokenize_top_logprobs_tokens: per position [[logprob, token id, text], ...] or None."""
    return [None if row is None else _with_text(list(zip(*row)), tok, text) for row in rows or []]


def sample_json(res: GenerateResult, req: GenerateRequest, rid: str, return_logprob: bool, engine: Any,
                routes_start: int = 0, text_in_logprobs: bool = False, finished: bool = True,
                arrival: float | None = None) -> dict[str, Any]:
    """One sample's reply, as TokenizerManager._handle_batch_output builds it (a running sample's too,
    for streaming: no finish reason, no routes)."""
    tok = engine.tokenizer
    text_lp = text_in_logprobs and tok is not None
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_json(res) if finished else None,
        "prompt_tokens": len(res.prompt_ids),
        "weight_version": res.weight_version,
        "num_retractions": res.num_retractions,
    }
    if return_logprob:
        prompt = list(res.prompt_ids)
        start = len(prompt) - len(res.input_logprobs or [])
        meta["input_token_logprobs"] = _with_text(list(zip(res.input_logprobs or [], prompt[start:])), tok, text_lp)
        meta["output_token_logprobs"] = _with_text(list(zip((float(x) for x in res.output_logprobs.tolist()),
                                                            res.output_ids)), tok, text_lp)
        meta["output_token_logprobs_length"] = len(res.output_ids)
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = _ranked(res.input_top_logprobs, tok, text_lp)
            meta["output_top_logprobs"] = _ranked(res.output_top_logprobs, tok, text_lp)
        if req.token_ids_logprob is not None:
            meta["input_token_ids_logprobs"] = _ranked(res.input_token_ids_logprobs, tok, text_lp)
            meta["output_token_ids_logprobs"] = _ranked(res.output_token_ids_logprobs, tok, text_lp)
    meta.update({"reasoning_tokens": 0, "completion_tokens": len(res.output_ids), "cached_tokens": res.cached_tokens})
    if res.weight_versions is not None:  # add_weight_versions_to_meta_info (sglang/srt/utils/weight_versions.py)
        meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in res.weight_versions]
        meta["weight_version"] = res.weight_versions[-1][0]
    if finished and req.return_routed_experts and res.routed_experts is not None:
        # rows [routed_experts_start_len, len - 1), as SGLang's get_topk(start_len=...)
        meta["routed_experts"] = encode_b64(res.routed_experts[routes_start:], engine.moe_layer_ids,
                                            engine.num_hidden_layers)
    if finished and arrival is not None:
        meta["e2e_latency"] = time.monotonic() - arrival
    out: dict[str, Any] = {}
    if tok is not None:  # without tokenizer files the reply has no "text", as SGLang with skip_tokenizer_init
        out["text"] = reply_text(res, req, tok) if finished else tok.decode(
            res.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    out["output_ids"] = list(res.output_ids)
    out["meta_info"] = meta
    return out
