"""Routing replay (R2, R3) on every layout, with several microbatches and activation recompute on.

Per layout (microbatches of 3, so the last one is padded) one set of ranks checks: record-then-replay with unchanged weights gives
the recorded log-probs (to float rounding; the ids used are exactly the recorded
ones), after perturbing the routers a free forward changes routes and log-probs
while a replayed forward uses exactly the recorded ids, a backward under replay
consumes every target once (recompute included), and R3: routes returned by the
local rollout engine, replayed in the trainer, are the routes the trainer uses.
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.policy.parallel import ParallelLayout
from moe_rl.routes import route_dtype
from moe_rl.testing import run_ranks
from moe_rl.testing.replay_worker import bad_routes_worker, replay_worker

# Each mechanism replay needs per layout on two ranks: the sequence-parallel slice (tp2), layer
# offsets of pipeline stages and virtual stages (pp2, pp2-vpp2), global expert ids (ep2), data
# shards (dp2). They are independent of each other; their products on four ranks run in the
# flagship rehearsal (tests/e2e/test_e2e_rehearsal.py: R3 on tp2 + sp + ep2, and tp2-ep2 for the critic
# in tests/distributed/test_critic_layouts.py), which keeps the suite's time.
LAYOUTS = ["tp2", "pp2", "pp2-vpp2", "ep2", "dp2"]


@pytest.fixture(scope="module")
def engine_rollouts(tiny_hf_dir):
    """Prompt + completion sequences and their routes from the local rollout engine (R3 source)."""
    from moe_rl.rollout.engine import GenerateRequest, SamplingParams
    from moe_rl.rollout.local_engine import LocalEngine

    engine = LocalEngine(tiny_hf_dir, seed=0)
    g = torch.Generator().manual_seed(3)
    requests = [GenerateRequest(prompt_ids=torch.randint(3, 128, (int(n),), generator=g).tolist(),
                                sampling=SamplingParams(max_new_tokens=int(m), seed=i, ignore_eos=True),
                                return_routed_experts=True)
                for i, (n, m) in enumerate([(5, 7), (9, 3), (3, 10), (6, 6), (12, 4), (4, 8), (7, 2), (8, 9)])]
    results = [r[0] for r in engine.generate(requests)]
    sequences = [torch.tensor(list(r.prompt_ids) + list(r.output_ids)) for r in results]
    routes = [torch.as_tensor(r.routed_experts) for r in results]
    for s, r in zip(sequences, routes):
        assert r.shape == (len(s) - 1, 4, 2)
    return sequences, routes


@pytest.fixture(scope="module")
def hf_confidence(tiny_hf_dir, engine_rollouts):
    """Per sequence `[T - 1, L, 2]`: top-k gate mass and k-th minus (k+1)-th router logit, from HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    out = []
    for seq in engine_rollouts[0]:
        with torch.no_grad():
            logits = model(seq.view(1, -1), output_router_logits=True).router_logits  # L x [T, E]
        per_layer = []
        for lg in logits:
            top = lg.float().topk(k + 1, dim=-1).values
            mass = torch.softmax(lg.float(), -1).topk(k, dim=-1).values.sum(-1)
            per_layer.append(torch.stack([mass, top[:, k - 1] - top[:, k]], -1))
        out.append(torch.stack(per_layer, 1)[:-1])
    return out


def _sorted(routes: torch.Tensor) -> torch.Tensor:
    return routes.long().sort(dim=-1).values


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_on_layout(layout, tiny_hf_dir, engine_rollouts, hf_confidence):
    sequences, engine_routes = engine_rollouts
    world = ParallelLayout.parse(layout).world_size
    results = run_ranks(replay_worker, world, layout, str(tiny_hf_dir), sequences, micro_batch_size=3,
                        recompute=True, engine_routes=engine_routes, pack_tokens=32, timeout=600)
    for r in results:
        lengths = torch.tensor([len(sequences[i]) for i in r["index"]])
        valid = torch.arange(r["recorded_routes"].shape[1]).view(1, -1) < (lengths - 1).view(-1, 1)
        # Unchanged weights: same log-probs (different expert GEMM batch shapes for the
        # filler-routed last tokens make this float-rounding close, not bitwise).
        assert (r["logp_replay"] - r["logp_record"]).abs().max() <= 1e-5
        # Perturbed routers: a free forward changes routes and log-probs ...
        assert (_sorted(r["routes_free_perturbed"]) != _sorted(r["recorded_routes"]))[valid].any()
        assert (r["logp_free_perturbed"] - r["logp_record"]).abs().max() > 1e-3
        # ... a replayed one uses exactly the recorded ids.
        assert torch.equal(_sorted(r["routes_used_perturbed"])[valid], _sorted(r["recorded_routes"])[valid])
        assert (r["logp_replay_perturbed"] - r["logp_free_perturbed"]).abs().max() > 1e-3
        assert r["grad_norm_sq"] > 0
        # Packed rows: the same routes recorded, and replay uses exactly the recorded ids.
        w = r["recorded_routes_packed"].shape[1]
        assert torch.equal(_sorted(r["recorded_routes_packed"])[valid[:, :w]],
                           _sorted(r["recorded_routes"][:, :w])[valid[:, :w]])
        assert (r["logp_record_packed"] - r["logp_record"][:, :w]).abs().max() <= 1e-5
        used = r["routes_used_perturbed_packed"]
        assert torch.equal(_sorted(used)[valid[:, :w]], _sorted(r["recorded_routes"][:, :w])[valid[:, :w]])
        assert (r["logp_replay_perturbed_packed"] - r["logp_replay_perturbed"][:, :w]).abs().max() <= 1e-5
        # Router confidence (gate mass, logit margin) equals HF's on every routed token.
        for j, i in enumerate(r["index"]):
            n = len(sequences[i]) - 1
            assert (r["route_confidence"][j, :n] - hf_confidence[i]).abs().max() <= 1e-4, (layout, i)
        # R3: the trainer routes every token exactly as the engine did.
        for j, i in enumerate(r["index"]):
            n = len(sequences[i]) - 1
            assert torch.equal(_sorted(r["routes_used_r3"][j, :n]), _sorted(engine_routes[i])), (layout, i)


def test_bad_routes_give_clear_errors(tiny_hf_dir, engine_rollouts):
    sequences, _ = engine_rollouts
    (errors,) = run_ranks(bad_routes_worker, 1, str(tiny_hf_dir), sequences)
    assert "expected [B=8, T-1>=" in errors["short"] and "L=4 MoE layers, K=2" in errors["short"]
    assert "routes have shape (8, " in errors["missing_layer"] and ", 3, 2)" in errors["missing_layer"]
    assert "out of range [0, 4)" in errors["bad_id"] and "num_experts=4" in errors["bad_id"]
    assert "routes have shape (7, " in errors["wrong_batch"]
    assert "MoE layer 0: route targets of microbatches [1, 2, 3] were never consumed" in errors["unconsumed"]


@pytest.mark.parametrize("experts,dtype", [(8, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                            (40000, torch.int32)])
def test_route_dtype_keeps_large_ids(experts, dtype):
    assert route_dtype(experts) == dtype
    ids = torch.tensor([experts - 1])
    assert int(ids.to(route_dtype(experts))) == experts - 1
