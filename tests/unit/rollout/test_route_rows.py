"""Route rows no router produced are refused where they enter, naming the server and the layer:
an id repeated within a top-k (padding written as zeros), ids out of range (the rules themselves,
moe_rl/routes.py `check`: tests/unit/test_routes.py)."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from moe_rl.rollout.engine import GenerateRequest, GenerateResult, RolloutError, SamplingParams
from moe_rl.rollout.wire import decode_routes, parse_reply
from moe_rl.routes import BadRoutes, Geometry

URL = "http://10.0.0.7:30000"
WHERE = f"server {URL}: /generate sample 1"


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode()


def _routes(rows: int, layers: int, k: int, experts: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    return np.stack([g.permutation(experts)[:k] for _ in range(rows * layers)]).reshape(rows, layers, k)


def _reply(routes: np.ndarray, prompt: list[int], out: list[int]) -> dict:
    return {"output_ids": out, "meta_info": {"finish_reason": {"type": "stop"}, "routed_experts": _b64(routes),
                                             "output_token_logprobs": [[-0.5, t, None] for t in out]}}


def test_wire_refuses_padding_rows_naming_the_server_and_the_layer():
    geo = Geometry(num_layers=3, topk=2, num_experts=8, moe_layers=[1, 2])  # layer 0 dense
    req = GenerateRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(n=1), return_routed_experts=True)
    good = _routes(5, 3, 2, 8)
    assert decode_routes(WHERE, _b64(good), 5, geo).shape == (5, 2, 2)
    assert parse_reply(URL, req, _reply(good, [1, 2, 3], [4, 5, 6]), geo)[0].routed_experts.shape == (5, 2, 2)
    padded = good.copy()
    padded[3:, 2] = 0  # the last two tokens' routes of layer 2 left as zeros
    with pytest.raises(BadRoutes, match=r"10\.0\.0\.7.*row 3, layer 2 repeats an expert id.*\[0, 0\].*2 of 5 rows") as e:
        parse_reply(URL, req, _reply(padded, [1, 2, 3], [4, 5, 6]), geo)
    # the server's output is at fault, not its availability: not the lost-server path (RolloutError)
    assert not isinstance(e.value, RolloutError)
    wild = good.copy()
    wild[1, 1, 0] = 8
    with pytest.raises(BadRoutes, match=r"10\.0\.0\.7.*out of range \[0, 8\).*row 1, layer 1"):
        decode_routes(WHERE, _b64(wild), 5, geo)  # an id past the narrow type's range: before it is cast


def test_every_engine_result_is_checked_naming_the_engine():
    rows = _routes(4, 2, 2, 4)
    GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", rows.astype(np.uint8), server="inprocess")
    rows[2, 1] = [3, 3]
    with pytest.raises(ValueError, match="inprocess: routed_experts: row 2, MoE layer 1 repeats"):
        GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", rows.astype(np.uint8), server="inprocess")
