"""SGLang's native /generate reply, as the client reads it (the request bodies and the endpoints:
moe_rl/rollout/sglang_api.py).

Request / response shapes (sglang/srt/managers/io_struct.py `GenerateReqInput`,
sglang/srt/managers/tokenizer_manager.py `_handle_batch_output`): we POST
{"input_ids": [...], "sampling_params": {..., "n": n}, "return_logprob": true,
"return_routed_experts": bool} and get one dict (n == 1) or a list of n dicts
{"output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
"output_token_logprobs": [[logprob, token_id, text_or_None], ...], "prompt_tokens",
"weight_version", "weight_versions": [{"version", "start", "end"}, ...] over the output tokens, "num_retractions",
"routed_experts": base64(int32 [len(prompt+output)-1, num_hidden_layers, topk])}}.
The routes are decoded as `extract_routed_experts_from_meta_info` does
(sglang/srt/state_capturer/routed_experts.py: frombuffer int32), shape-checked,
restricted to the MoE layers and stored in the smallest integer dtype once the ids fit it
(moe_rl/routes.py `decode_b64`), then checked row by row, once, as the `GenerateResult` is made (no id
repeated within a top-k, no padding rows). A malformed payload is a `RolloutError`, rows no router
produced are `BadRoutes`, each naming the server.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from moe_rl.rollout.engine import GenerateRequest, GenerateResult, RolloutError, check_version_spans
from moe_rl.routes import BadRoutes, Geometry, RouteWireError, decode_b64


def parse_reply(url: str, req: GenerateRequest, data: Any, geo: Geometry | None) -> list[GenerateResult]:
    """SGLang /generate JSON -> results, with every shape checked (errors name the server)."""
    n = req.sampling.n
    items = data if isinstance(data, list) else [data]
    if len(items) != n:
        raise RolloutError(f"server {url}: /generate returned {len(items)} samples, expected n={n}")
    P = len(req.prompt_ids)
    out = []
    for k, item in enumerate(items):
        where = f"server {url}: /generate sample {k}"
        if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict) \
                or not isinstance(item.get("output_ids"), list):
            raise RolloutError(f"{where}: expected an object with output_ids and meta_info, got "
                               f"{str(item)[:200]}")
        meta = item["meta_info"]
        output_ids = [int(t) for t in item["output_ids"]]
        T = len(output_ids)
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else fr
        if ftype not in ("stop", "length", "abort"):
            raise RolloutError(f"{where}: unexpected finish_reason {fr!r}")
        if meta.get("prompt_tokens") is not None and int(meta["prompt_tokens"]) != P:
            raise RolloutError(f"{where}: prompt_tokens {meta['prompt_tokens']} != len(prompt_ids) {P}")
        lps = meta.get("output_token_logprobs")
        if not isinstance(lps, list) or len(lps) != T:
            raise RolloutError(f"{where}: output_token_logprobs has "
                               f"{len(lps) if isinstance(lps, list) else lps!r} entries, expected {T}")
        try:
            vals = [float(e[0]) for e in lps]
            ids = [int(e[1]) for e in lps]
        except (TypeError, ValueError, IndexError):
            raise RolloutError(f"{where}: output_token_logprobs entries must be "
                               f"[logprob, token_id, text]; got {str(lps[:2])[:200]}") from None
        if ids != output_ids:
            raise RolloutError(f"{where}: output_token_logprobs token ids differ from output_ids")
        routes = None
        if req.return_routed_experts and geo is not None and geo.moe_layers \
                and not (ftype == "abort" and meta.get("routed_experts") is None):
            routes = decode_routes(where, meta.get("routed_experts"), P + T - 1 - req.routed_experts_start_len, geo)
        wv = meta.get("weight_version")
        out.append(GenerateResult(prompt_ids=list(req.prompt_ids), output_ids=output_ids,
                                  output_logprobs=np.asarray(vals, dtype=np.float32), finish_reason=ftype,
                                  routed_experts=routes, weight_version=None if wv is None else str(wv),
                                  server=url, weight_versions=parse_version_spans(where, meta, T),
                                  num_retractions=int(meta.get("num_retractions") or 0),
                                  routes_start=req.routed_experts_start_len if routes is not None else 0,
                                  route_geometry=geo if routes is not None else None))
    return out


def parse_version_spans(where: str, meta: dict[str, Any], num_tokens: int) -> tuple[tuple[str, int, int], ...] | None:
    """meta_info["weight_versions"]: [{"version", "start", "end"}, ...] over the output tokens (SGLang's
    add_weight_versions_to_meta_info), or None when the server sent none."""
    spans = meta.get("weight_versions")
    if spans is None:
        return None
    try:
        out = tuple((str(s["version"]), int(s["start"]), int(s["end"])) for s in spans)
        check_version_spans(out, num_tokens)
    except (TypeError, KeyError, ValueError) as e:
        raise RolloutError(f"{where}: meta_info.weight_versions {str(spans)[:200]}: {e}") from None
    return out


def in_place_spans(spans: tuple[tuple[str, int, int], ...] | None, sent: str, labels: list[str]
                   ) -> tuple[tuple[str, int, int], ...] | None:
    """A sample's version spans as the weights that sampled each token, from the labels an overlapping
    SGLang server gives under in-place pushes.

    With the overlap scheduler (SGLang's default), the forward of each running request's next token is
    in flight when an in-place pause lands (scheduler.py `event_loop_overlap` leaves its result unprocessed,
    `pause_generation` in_place returns at once), so the version change counts the tokens before it
    (`record_weight_version_events`: `len(req.output_ids)`) and that token, sampled from the old weights,
    opens the new version's span. Each boundary therefore moves one token later. A request whose prefill
    was in flight has no tokens when the version changes and no event at all: its first token is labelled
    with the new version. It cannot be told from a request still queued at the push (whose first token is
    the new version's), so a first token labelled with a version pushed after the request was `sent` counts
    with the version before it: never newer than the weights that sampled it, so the staleness bound holds.
    `labels`: the versions the servers served, in order ("default" first)."""
    if not spans or spans[-1][2] == 0:
        return spans
    last = len(spans) - 1
    moved = [[v, a + (i > 0), b + (i < last)] for i, (v, a, b) in enumerate(spans)]
    first = spans[0][0]
    if sent in labels and first in labels and labels.index(first) > labels.index(sent):
        moved[0][1] += 1
        moved.insert(0, [labels[labels.index(first) - 1], 0, 1])
    out: list[list[Any]] = []
    for v, a, b in moved:
        if a >= b:
            continue
        if out and out[-1][0] == v:
            out[-1][2] = b
        else:
            out.append([v, a, b])
    return tuple((str(v), int(a), int(b)) for v, a, b in out)


def decode_routes(where: str, b64: Any, rows: int, geo: Geometry) -> np.ndarray:
    """A reply's `routed_experts` as compact routes (moe_rl/routes.py `decode_b64`): a malformed payload is the
    server's RolloutError, an id that does not fit its BadRoutes, both naming `where` (the router's rules run
    once, on the `GenerateResult`)."""
    if not isinstance(b64, str):
        raise RolloutError(f"{where}: meta_info.routed_experts is missing (launch SGLang with "
                           f"--enable-return-routed-experts)")
    try:
        return decode_b64(b64, rows, geo.num_layers, geo.topk, geo.moe_layers, geo.num_experts)
    except BadRoutes as e:  # the server's fault, not an outage: the run stops naming it (see BadRoutes)
        raise BadRoutes(f"{where}: routed_experts: {e}") from None
    except RouteWireError as e:
        raise RolloutError(f"{where}: {e}") from None


def read_hf_config(model_path: Any) -> dict[str, Any]:
    """config.json of a local HF checkpoint dir (the text config for multimodal models), or {}."""
    if not isinstance(model_path, str):
        return {}
    p = Path(model_path) / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return cfg.get("text_config") or cfg if isinstance(cfg, dict) else {}
