"""Routing replay of a model with 256 or more routed experts: DeepSeek-V3's 256 (its released shape: 8
groups of which 4 are kept, top-8) and Kimi-K2's 384. The old pass records expert id + 1 in int16 for
them and merges the ranks' shares over TP x PP (`moe_rl.policy.replay._merge_ids_over_model_parallel`);
gloo refuses an int16 all-reduce ("Invalid scalar type") and NCCL has no 16-bit integer, so before the
merge went as bytes, every recording (R2, drift's free-routes pass) on these models failed.

Per layout, on a tiny DeepSeek-V3 of small experts: the routes recorded in the trainer are HF's own
(transformers' forward, an independent implementation of the same router), R2 replays them (log-probs
unchanged; after the routers move, a replayed forward still uses exactly them) and R3 replays HF's
routes as the rollout engine's, with activation recompute on and a padded last microbatch.
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.policy.parallel import ParallelLayout
from moe_rl.testing import make_tiny_deepseek_v3, run_ranks


def _ordered(routes: torch.Tensor) -> torch.Tensor:
    return routes.long().sort(dim=-1).values


# ep2: each rank records alone (its model-parallel group is itself) but still all-reduces; tp2-pp2:
# four ranks merge sequence-parallel slices and pipeline stages, with 384 experts so that ids >= 255
# put a non-zero high byte on the wire.
@pytest.mark.parametrize("layout,experts", [("ep2", 256), ("tp2-pp2", 384)])
def test_routes_of_hundreds_of_experts_are_recorded_as_hf_routes_them_and_replayed(layout, experts, tmp_path):
    from transformers import AutoModelForCausalLM

    from moe_rl.drift.routes import hf_forward
    from moe_rl.testing.replay_worker import replay_worker

    model_dir = make_tiny_deepseek_v3(tmp_path / "ds", seed=0, n_routed_experts=experts, num_experts_per_tok=8,
                                      n_group=8, topk_group=4, moe_intermediate_size=4)
    g = torch.Generator().manual_seed(2)
    sequences = [torch.randint(3, 96, (n,), generator=g) for n in (9, 5, 12, 7, 10, 6)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_routes = [hf_forward(model, s.view(1, -1)).routes[0, :-1] for s in sequences]  # [T - 1, L, K]
    results = run_ranks(replay_worker, ParallelLayout.parse(layout).world_size, layout, str(model_dir), sequences,
                        micro_batch_size=2, recompute=True, engine_routes=hf_routes, timeout=600)
    top = 0
    for r in results:
        assert (r["logp_replay"] - r["logp_record"]).abs().max() <= 1e-5
        assert (r["logp_free_perturbed"] - r["logp_record"]).abs().max() > 1e-3  # the routers moved
        for j, i in enumerate(r["index"]):
            n = len(sequences[i]) - 1
            recorded = r["recorded_routes"][j, :n]
            assert torch.equal(_ordered(recorded), _ordered(hf_routes[i])), (layout, i)
            assert torch.equal(_ordered(r["routes_used_perturbed"][j, :n]), _ordered(recorded)), (layout, i)
            assert torch.equal(_ordered(r["routes_used_r3"][j, :n]), _ordered(hf_routes[i])), (layout, i)
            top = max(top, int(recorded.max()))
    assert top >= 255, top  # ids whose id + 1 needs the second byte were recorded and merged
