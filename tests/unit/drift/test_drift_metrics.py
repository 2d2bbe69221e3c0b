"""Route volatility, log-prob mismatch and expert load against hand-computed numbers."""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.drift.metrics import (ROLLOUT_MISMATCH, VOLATILITY, DriftShapeError, LogprobStats, RouteStats,
                                  expert_load, load_change, load_violation, logprob_mismatch,
                                  route_stats)
from moe_rl.routes import route_dtype
from moe_rl.testing import run_ranks

# K=2, 3 tokens, 2 layers. Rows are tokens; each inner pair is one layer's top-2.
BEFORE = torch.tensor([
    [[0, 1], [2, 3]],   # t0
    [[1, 2], [0, 3]],   # t1
    [[3, 0], [1, 2]],   # t2
])
AFTER = torch.tensor([
    [[1, 0], [2, 3]],   # t0: L0 same set reordered -> 1 - 2/2 = 0;  L1 same -> 0
    [[1, 3], [1, 2]],   # t1: L0 {1,2}∩{1,3} = {1} -> 1 - 1/2 = 0.5;  L1 {0,3}∩{1,2} = {} -> 1
    [[3, 0], [2, 0]],   # t2: L0 same -> 0;  L1 {1,2}∩{2,0} = {2} -> 0.5
])
# By hand: per-layer sums L0 = 0 + 0.5 + 0 = 0.5, L1 = 0 + 1 + 0.5 = 1.5
#   volatility L0 = 0.5/3 = 1/6, L1 = 1.5/3 = 1/2, overall = (0.5 + 1.5) / (3*2) = 1/3
#   exact matches: L0 {t0, t2} = 2, L1 {t0} = 1 -> 3/6 = 1/2
#   tokens changed in any layer: t1, t2 -> 2/3


def test_hand_example():
    s = route_stats(BEFORE, AFTER)
    assert s.layer_volatility_sum.tolist() == [0.5, 1.5]
    assert s.exact_match.tolist() == [2, 1]
    assert int(s.changed_any) == 2 and int(s.num_tokens) == 3
    out = s.summary()
    assert out == pytest.approx({
        "drift/volatility": 1 / 3,
        "drift/volatility/exact_match": 1 / 2,
        "drift/volatility/tokens_changed_any_layer": 2 / 3,
        "drift/volatility/layer_00": 1 / 6,
        "drift/volatility/layer_01": 1 / 2,
        "drift/volatility/num_tokens": 3.0,
    })


def test_summary_prefix_and_layer_ids():
    out = route_stats(BEFORE, AFTER).summary(ROLLOUT_MISMATCH, layer_ids=[1, 3])
    assert set(out) == {ROLLOUT_MISMATCH, f"{ROLLOUT_MISMATCH}/exact_match",
                        f"{ROLLOUT_MISMATCH}/tokens_changed_any_layer", f"{ROLLOUT_MISMATCH}/layer_01",
                        f"{ROLLOUT_MISMATCH}/layer_03", f"{ROLLOUT_MISMATCH}/num_tokens"}
    assert out[f"{ROLLOUT_MISMATCH}/layer_03"] == pytest.approx(0.5)


def test_identical_routes_give_exactly_zero():
    g = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(50 * 3)]).view(50, 3, 4)
    out = route_stats(routes, routes.clone()).summary()
    assert out[VOLATILITY] == 0.0
    assert out[f"{VOLATILITY}/exact_match"] == 1.0
    assert out[f"{VOLATILITY}/tokens_changed_any_layer"] == 0.0


def test_order_within_topk_is_ignored():
    shuffled = BEFORE.flip(-1)
    assert route_stats(BEFORE, shuffled).summary()[VOLATILITY] == 0.0
    assert route_stats(BEFORE.flip(-1), AFTER).summary() == route_stats(BEFORE, AFTER).summary()


def test_mask_respected():
    # Dropping t1: L0 = 0/2, L1 = 0.5/2; changed any layer: only t2 -> 1/2.
    mask = torch.tensor([True, False, True])
    out = route_stats(BEFORE, AFTER, mask).summary()
    assert out["drift/volatility/layer_00"] == 0.0
    assert out["drift/volatility/layer_01"] == pytest.approx(0.25)
    assert out["drift/volatility/tokens_changed_any_layer"] == pytest.approx(0.5)
    assert out["drift/volatility/num_tokens"] == 2.0
    # masked tokens are not validated either: padding may hold anything
    junk = AFTER.clone()
    junk[1] = 99
    assert route_stats(BEFORE, junk, torch.tensor([1, 0, 1]), num_experts=4).summary() == out


def _random_routes(n: int, layers: int, k: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n * layers)]).view(n, layers, k)


def test_sum_of_halves_equals_whole():
    before, after = _random_routes(40, 3, 2, 6, 1), _random_routes(40, 3, 2, 6, 2)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(3)) > 0.3
    whole = route_stats(before, after, mask)
    parts = route_stats(before[:17], after[:17], mask[:17]) + route_stats(before[17:], after[17:], mask[17:])
    for name in ("changed_slots", "exact_match", "changed_any", "num_tokens"):
        assert torch.equal(getattr(parts, name), getattr(whole, name)), name
    assert parts.summary() == whole.summary()
    assert sum([route_stats(before[:17], after[:17], mask[:17]),
                route_stats(before[17:], after[17:], mask[17:])]).summary() == whole.summary()
    assert (RouteStats.zeros(3, 2) + whole).summary() == whole.summary()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_small_int_dtypes(dtype):
    assert route_stats(BEFORE.to(dtype), AFTER.to(dtype)).summary() == route_stats(BEFORE, AFTER).summary()
    # mixed storage (rollout uint8, trainer int64) compares by value
    assert route_stats(BEFORE.to(torch.uint8), AFTER.to(dtype)).summary() == route_stats(BEFORE, AFTER).summary()


def test_int16_ids_above_255():
    # 300 experts: 256 and 44 would collide if the ids were truncated to uint8
    before = torch.tensor([[[256, 1]], [[299, 5]]], dtype=torch.int16)
    after = torch.tensor([[[0, 44]], [[299, 5]]], dtype=torch.int16)
    s = route_stats(before, after, num_experts=300)
    assert s.changed_slots.tolist() == [2]  # t0: {256,1} vs {0,44} share nothing
    assert expert_load(before, 300)[0, 256] == 1
    assert route_dtype(256) == torch.uint8 and route_dtype(257) == torch.int16
    assert route_dtype(40000) == torch.int32


def test_route_errors_name_both_shapes():
    with pytest.raises(DriftShapeError, match=r"top-k differs.*K=2.*K=3.*\(3, 2, 2\).*\(3, 2, 3\)"):
        route_stats(BEFORE, torch.zeros(3, 2, 3, dtype=torch.long))
    with pytest.raises(DriftShapeError, match=r"MoE layers differs.*\(3, 2, 2\).*\(3, 4, 2\)"):
        route_stats(BEFORE, torch.zeros(3, 4, 2, dtype=torch.long))
    with pytest.raises(DriftShapeError, match=r"token count differs.*\(3, 2, 2\).*\(5, 2, 2\)"):
        route_stats(BEFORE, torch.zeros(5, 2, 2, dtype=torch.long))
    with pytest.raises(DriftShapeError, match=r"\[N tokens, L layers, K top-k\].*\(3, 2\)"):
        route_stats(BEFORE[:, 0], AFTER[:, 0])
    with pytest.raises(DriftShapeError, match=r"expert id 3.*num_experts=3"):
        route_stats(BEFORE, AFTER, num_experts=3)
    with pytest.raises(DriftShapeError, match=r"mask must be \[N\] = \[3\].*\(2,\)"):
        route_stats(BEFORE, AFTER, torch.ones(2, dtype=torch.bool))
    with pytest.raises(DriftShapeError, match="integer expert ids"):
        route_stats(BEFORE.float(), AFTER.float())
    with pytest.raises(DriftShapeError, match="repeats an expert id"):
        route_stats(torch.tensor([[[1, 1]]]), torch.tensor([[[1, 2]]]))
    with pytest.raises(DriftShapeError, match="cannot add RouteStats"):
        route_stats(BEFORE, AFTER) + RouteStats.zeros(3, 2)


def test_logprob_mismatch_hand_formulas():
    train = torch.tensor([[-1.0, -0.5, -2.0, -3.0]])
    rollout = torch.tensor([[-1.0, -1.5, -1.0, -float("inf")]])  # last position is padding
    mask = torch.tensor([[1, 1, 1, 0]])
    # d = train - rollout = [0, 1, -1]; k3 = exp(d) - 1 - d = [0, e - 2, 1/e]
    out = logprob_mismatch(train, rollout, mask).summary()
    assert out == pytest.approx({
        "drift/logp_k3": (0 + (math.e - 2) + 1 / math.e) / 3,
        "drift/logp_abs_diff": 2 / 3,
        "drift/logp_ratio_outside": 2 / 3,  # ratios e and 1/e lie outside [1/2, 2]
    })
    inside = logprob_mismatch(torch.tensor([math.log(1.9)]), torch.tensor([0.0])).summary()
    assert inside["drift/logp_ratio_outside"] == 0.0
    halves = logprob_mismatch(train[:, :2], rollout[:, :2], mask[:, :2]) + \
        logprob_mismatch(train[:, 2:], rollout[:, 2:], mask[:, 2:])
    assert halves.summary() == pytest.approx(out)
    assert LogprobStats.zeros().summary()["drift/logp_k3"] != LogprobStats.zeros().summary()["drift/logp_k3"]  # NaN


def test_logprob_errors():
    with pytest.raises(DriftShapeError, match=r"\(2, 3\).*\(2, 4\)"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(DriftShapeError, match=r"mask has shape \(3,\).*\(2, 3\)"):
        logprob_mismatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3))


def test_expert_load_and_change():
    routes = torch.tensor([[[0, 1]], [[1, 2]], [[1, 3]], [[0, 2]]], dtype=torch.uint8)
    mask = torch.tensor([1, 1, 1, 0])
    cur = expert_load(routes, 4, mask)
    assert cur.tolist() == [[1, 3, 1, 1]]
    prev = torch.tensor([[2, 2, 2, 0]])
    # shares p = [1/3, 1/3, 1/3, 0], q = [1/6, 1/2, 1/6, 1/6]; TV = (1/6 + 1/6 + 1/6 + 1/6) / 2 = 1/3
    out = load_change(prev, cur, layer_ids=[5])
    assert out == pytest.approx({"drift/load_change": 1 / 3, "drift/load_change/layer_05": 1 / 3,
                                 "drift/load_max_share": 1 / 2})
    assert load_change(cur, cur)["drift/load_change"] == 0.0


def test_expert_load_two_layers_and_errors():
    load = expert_load(BEFORE, 4)
    assert load.tolist() == [[2, 2, 1, 1], [1, 1, 2, 2]]
    assert int(load.sum()) == 3 * 2 * 2
    with pytest.raises(DriftShapeError, match=r"expert id 3.*num_experts=2"):
        expert_load(BEFORE, 2)
    with pytest.raises(DriftShapeError, match=r"prev has shape \(2, 4\), cur has shape \(2, 5\)"):
        load_change(load, torch.zeros(2, 5))


def test_load_violation_matches_a_plain_loop():
    """max over experts of load / mean load - 1 per layer (verl's max_vio), and its max over layers,
    against a loop over plain Python numbers; an empty layer is NaN and left out of the max."""
    gen = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(37 * 3)]).view(37, 3, 2)
    load = expert_load(routes, 8).to(torch.float64)
    load[2] = 0  # a layer no token reached
    layer_ids = [1, 3, 14]
    expected = {}
    for i, row in enumerate(load.tolist()):
        mean = sum(row) / len(row)
        expected[f"drift/load_max_vio/layer_{layer_ids[i]:02d}"] = max(row) / mean - 1 if mean else math.nan
    finite = [v for v in expected.values() if not math.isnan(v)]
    out = load_violation(load, layer_ids)
    assert math.isnan(out.pop("drift/load_max_vio/layer_14"))
    assert out.pop("drift/load_max_vio") == pytest.approx(max(finite), abs=1e-12)
    expected.pop("drift/load_max_vio/layer_14")
    assert out == pytest.approx(expected, abs=1e-12)
    assert load_violation(torch.tensor([[3, 3, 3, 3]]))["drift/load_max_vio"] == 0.0  # perfect balance
    assert load_violation(torch.tensor([[0, 8, 0, 0]]))["drift/load_max_vio"] == 3.0  # one expert: E - 1
    with pytest.raises(DriftShapeError, match=r"load must be an \[L, E\] load tensor"):
        load_violation(torch.zeros(4))
    with pytest.raises(DriftShapeError, match="layer_ids has 1 entries for 2 MoE layers"):
        load_violation(torch.ones(2, 4), [0])


def _rank_worker(before, after, mask):
    """One DP rank: count its half of the tokens, all-reduce, summarise."""
    import torch.distributed as dist

    from moe_rl.drift.metrics import all_reduce_counts, expert_load, logprob_mismatch, route_stats

    rank, world = dist.get_rank(), dist.get_world_size()
    part = slice(rank * before.shape[0] // world, (rank + 1) * before.shape[0] // world)
    routes = route_stats(before[part], after[part], mask[part]).all_reduce()
    lp = logprob_mismatch(before[part, 0, :1].double().neg(), after[part, 0, :1].double().neg(),
                          mask[part].view(-1, 1)).all_reduce()
    load = all_reduce_counts(expert_load(after[part], 6, mask[part]))
    return routes.summary(), lp.summary(), load


def test_data_parallel_all_reduce_matches_single_process():
    before, after = _random_routes(30, 3, 2, 6, 4), _random_routes(30, 3, 2, 6, 5)
    mask = torch.rand(30, generator=torch.Generator().manual_seed(6)) > 0.2
    results = run_ranks(_rank_worker, 2, before, after, mask, timeout=120)
    want_routes = route_stats(before, after, mask).summary()
    want_lp = logprob_mismatch(before[:, 0, :1].double().neg(), after[:, 0, :1].double().neg(),
                               mask.view(-1, 1)).summary()
    want_load = expert_load(after, 6, mask)
    for routes, lp, load in results:
        assert routes == want_routes
        assert lp == pytest.approx(want_lp)
        assert torch.equal(load, want_load)
    # without a process group all_reduce is a no-op
    assert route_stats(before, after, mask).all_reduce().summary() == want_routes
