"""`/generate` on the wire: SGLang's `GenerateReqInput` parsed into engine requests, and each sample's
reply (`output_ids`, `meta_info`: finish reason, log-probs, routed experts, weight version)."""
from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np

from moe_rl.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from moe_rl.rollout.server.common import BadRequest, _is_int

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
        "num_retractions": res.num_retractions,
    }
    if return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[float(lp), int(t), None]
                                         for lp, t in zip(res.output_logprobs.tolist(), res.output_ids)]
        meta["output_token_logprobs_length"] = len(res.output_ids)
    meta.update({"reasoning_tokens": 0, "completion_tokens": len(res.output_ids), "cached_tokens": 0})
    if res.weight_versions is not None:  # add_weight_versions_to_meta_info (sglang/srt/utils/weight_versions.py)
        meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in res.weight_versions]
        meta["weight_version"] = res.weight_versions[-1][0]
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
