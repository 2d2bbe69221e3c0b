"""A route's one room (moe_rl/routes.py): its type, its rules and its wire form, and that the engine,
the server, drift and replay answer with them alike."""
from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_rl import routes
from moe_rl.drift.metrics import DriftShapeError, expert_load, route_stats
from moe_rl.policy.replay import ReplayError, check_routes
from moe_rl.recipes.rl.replay_health import coverage
from moe_rl.rollout.engine import GenerateRequest, GenerateResult, RolloutError, SamplingParams
from moe_rl.rollout.wire import decode_routes, parse_reply
from moe_rl.routes import Geometry
from moe_rl.samples import Samples


def _routes(rows: int, layers: int, k: int, experts: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    return np.stack([g.permutation(experts)[:k] for _ in range(rows * layers)]).reshape(rows, layers, k)


def _b64(arr: np.ndarray) -> str:
    """SGLang's wire form written independently: base64 of little-endian int32."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode()


def test_route_dtype_boundaries():
    assert routes.route_np_dtype(1) == np.uint8
    assert routes.route_np_dtype(256) == np.uint8      # ids 0..255
    assert routes.route_np_dtype(257) == np.int16      # id 256 does not fit in uint8
    assert routes.route_np_dtype(32768) == np.int16
    assert routes.route_np_dtype(32769) == np.int32
    assert routes.record_dtype(255) == torch.uint8 and routes.record_dtype(256) == torch.int16  # id + 1
    with pytest.raises(ValueError):
        routes.route_np_dtype(0)


def test_ids_above_255_survive_server_encoding_and_client_decoding():
    rng = np.random.default_rng(0)
    num_experts, rows, k = 384, 7, 8
    r = np.stack([np.stack([rng.choice(num_experts, k, replace=False) for _ in range(3)]) for _ in range(rows)])
    assert r.max() > 255
    b64 = routes.encode_b64(r, [0, 2, 3], 4)  # 4 hidden layers, layer 1 dense: SGLang leaves its rows 0
    flat = np.frombuffer(base64.b64decode(b64), dtype="<i4").reshape(rows, 4, k)
    assert (flat[:, 1] == 0).all()
    np.testing.assert_array_equal(flat[:, [0, 2, 3]], r)
    got = routes.decode_b64(b64, rows, 4, k, [0, 2, 3], num_experts)
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, r)
    with pytest.raises(routes.BadRoutes, match="out of range"):
        routes.compact(r, 300)  # ids >= 300 must not be wrapped silently


def test_malformed_wire_routes_are_the_servers_rollout_error_naming_it():
    geo = Geometry(num_layers=2, topk=2, num_experts=4, moe_layers=[0, 1])
    good = _b64(_routes(3, 2, 2, 4))
    assert decode_routes("server A", good, 3, geo).shape == (3, 2, 2)
    cases = {"not base64!": "not valid base64", good[:-4]: "not a whole number of int32",
             _b64(_routes(2, 2, 2, 4)): r"has 2 rows, expected \[len\(prompt \+ output\) - 1 = 3"}
    for payload, said in cases.items():
        with pytest.raises(RolloutError, match=f"server A: .*{said}"):
            decode_routes("server A", payload, 3, geo)
    with pytest.raises(RolloutError, match="server A: meta_info.routed_experts is missing.*--enable-return-routed"):
        decode_routes("server A", None, 3, geo)


def test_one_id_in_every_layer_is_refused_only_where_chance_cannot_explain_it():
    rows = _routes(6, 9, 1, 16, seed=1)  # top-1, 16 experts, 9 MoE layers: 16^-8 per token by chance
    routes.check(rows, 16)
    rows[4] = 0
    with pytest.raises(routes.BadRoutes, match="row 4 names expert 0 in all 9 MoE layers"):
        routes.check(rows, 16)
    few = _routes(6, 4, 1, 8, seed=2)  # top-1, 8 experts, 4 layers: 1 token in 512 routes so by chance
    few[2] = 5
    assert routes.compact(few, 8).dtype == np.uint8
    three = _routes(3, 3, 1, 1000)  # three layers never qualify, however many experts
    three[0] = 7
    routes.check(three, 1000)


def test_numpy_and_torch_routes_get_the_same_verdict_and_message():
    good = _routes(5, 3, 2, 8, seed=3)
    cases = {"repeat": (lambda a: a.__setitem__((2, 1), [4, 4]), 8), "range": (lambda a: a.__setitem__((3, 0, 1), 9), 8),
             "negative": (lambda a: a.__setitem__((1, 2, 0), -1), None)}
    for name, (spoil, experts) in cases.items():
        bad = good.astype(np.int32)
        spoil(bad)
        said = []
        for form in (bad, torch.from_numpy(bad)):
            with pytest.raises(routes.BadRoutes) as e:
                routes.check(form, experts)
            said.append(str(e.value))
        assert said[0] == said[1], name
        if name == "repeat":
            assert "row 2, MoE layer 1 repeats an expert id within its top-2: [4, 4] (1 of 5 rows" in said[0]
    with pytest.raises(routes.BadRoutes, match=r"expert id 9 out of range \[0, 8\) \(first at row 3, MoE layer 0"):
        routes.check(torch.from_numpy(np.where(np.arange(5)[:, None, None] == 3, 9, good)), 8)
    with pytest.raises(routes.BadRoutes, match="integer expert ids"):
        routes.check(torch.zeros(2, 3, 2), 8)
    with pytest.raises(routes.BadRoutes, match=r"\[B sequences, T positions, L layers, K top-k\].*\(5, 3, 2\)"):
        routes.check(good, 8, batched=True)
    with pytest.raises(routes.BadRoutes, match="3 MoE layers.*the model has 4"):
        routes.check(good, 8, layers=4)


def test_an_engine_result_refuses_negative_ids_even_without_the_expert_count():
    # the old row rule skipped the range entirely when the count was unknown: -1 written as "no route" passed
    rows = _routes(4, 2, 2, 4).astype(np.int32)
    rows[1, 0, 1] = -1
    with pytest.raises(routes.BadRoutes, match=r"sglang-0: routed_experts: expert id -1 out of range .*row 1, MoE layer 0"):
        GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", rows, server="sglang-0")


def test_engine_drift_and_replay_refuse_by_the_same_rule():
    """One id out of range: the engine's rows, drift's counted tokens and a replay batch all refuse it with
    the rule's words; a repeated top-k is refused where rows must be a router's, not in a replay batch
    (rows past a sequence are padding)."""
    r = torch.from_numpy(_routes(4, 2, 2, 4, seed=5).astype(np.int64))
    wild = r.clone()
    wild[2, 1, 0] = 4
    rule = r"expert id 4 out of range \[0, 4\) \(first at row 2, MoE layer 1"
    with pytest.raises(routes.BadRoutes, match=rule):
        routes.compact(wild.numpy(), 4)
    with pytest.raises(DriftShapeError, match="before: " + rule):
        route_stats(wild, r, num_experts=4)
    with pytest.raises(DriftShapeError, match="routes: " + rule):
        expert_load(wild, 4)
    arch = SimpleNamespace(num_moe_layers=2, num_moe_experts=4, moe_router_topk=2)  # what check_routes reads
    lengths = torch.tensor([3, 3])
    with pytest.raises(ReplayError, match=r"replayed expert id 4 out of range \[0, 4\) \(first at row 2, MoE layer 1"):
        check_routes(wild.view(2, 2, 2, 2), lengths, arch)  # [B, T, L, K]: row 2 is sequence 1's position 0
    padded = r.clone()
    padded[3, 0] = 0  # a padding row's zeros
    check_routes(padded.view(2, 2, 2, 2), torch.tensor([3, 2]), arch)
    with pytest.raises(DriftShapeError, match="repeats an expert id"):
        route_stats(padded, r)


def test_repeated_ids_against_a_set_per_row_for_every_top_k():
    """The pairwise rule (K <= 16) and the sorting one (K > 16) mark exactly the rows whose top-k holds an id
    twice, on numpy and torch, in every dtype a route comes in."""
    g = np.random.default_rng(7)
    for k in (1, 2, 3, 8, 16, 17, 24):
        ids = np.stack([g.permutation(64)[:k] for _ in range(300)]).reshape(100, 3, k)
        dup = g.random((100, 3)) < 0.3
        if k > 1:
            ids[dup, -1] = ids[dup, 0]
        want = np.array([[len(set(r.tolist())) < k for r in row] for row in ids])
        for dt in (np.uint8, np.int16, np.int64):
            np.testing.assert_array_equal(routes.repeated_ids(ids.astype(dt)), want, err_msg=f"k={k} {dt}")
        np.testing.assert_array_equal(routes.repeated_ids(torch.from_numpy(ids)).numpy(), want, err_msg=f"k={k}")
        assert k == 1 or want.any() and not want.all()


def test_an_engine_result_refuses_ids_past_the_expert_count_it_was_given():
    """The engine's geometry reaches the one check: an id past it is refused where the sample arrives, not
    left for R3's coverage to count (what it did before)."""
    rows = _routes(4, 2, 2, 8).astype(np.uint8)
    geo = Geometry(num_layers=3, topk=2, num_experts=8, moe_layers=[1, 2])
    GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", rows, route_geometry=geo)
    rows[2, 1, 0] = 8
    with pytest.raises(routes.BadRoutes, match=r"sglang-0: routed_experts: expert id 8 out of range \[0, 8\) "
                                               r"\(first at row 2, layer 2"):
        GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", rows, server="sglang-0", route_geometry=geo)
    GenerateResult([1, 2, 3], [4, 5], np.zeros(2), "stop", rows)  # count unknown: the replay refuses it


def test_a_samples_routes_are_checked_once_from_the_reply_to_r3s_coverage(monkeypatch):
    """The distinct-ids rule (the costly one) runs once per reply, when its `GenerateResult` is made: not in the
    decode as well, nor again in R3's coverage (three times before)."""
    calls = []
    rule = routes.repeated_ids
    monkeypatch.setattr(routes, "repeated_ids", lambda x: calls.append(x.shape) or rule(x))
    geo = Geometry(num_layers=3, topk=2, num_experts=8, moe_layers=[0, 1, 2])
    prompt, out = [1, 2, 3], [4, 5]
    rows = _routes(len(prompt) + len(out) - 1, 3, 2, 8, seed=3)
    reply = {"output_ids": out, "meta_info": {"finish_reason": {"type": "stop"}, "routed_experts": _b64(rows),
                                              "output_token_logprobs": [[-0.5, t, None] for t in out]}}
    req = GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(n=1), return_routed_experts=True)
    (res,) = parse_reply("server A", req, reply, geo)
    np.testing.assert_array_equal(res.routed_experts, rows)
    samples = Samples([None], [torch.tensor(prompt + out)], torch.tensor([3]), [torch.zeros(2)],
                      [torch.as_tensor(res.routed_experts)], [""])
    got = coverage(samples, torch.tensor([[False, False, True, True]]), [0, 1, 2], min_coverage=1.0)
    assert got["replay/coverage"] == 1.0
    assert calls == [(4, 3, 2)]
    assert res.route_geometry is geo  # the server's geometry reached the check
