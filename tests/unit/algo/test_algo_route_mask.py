"""The route-mismatch mask against a plain per-token loop (its place in the step's objective:
tests/unit/recipes/rl/test_replay_health.py)."""
from __future__ import annotations

import pytest
import torch

from moe_rl.algo.route_mask import route_mask, route_sets_differ


def _routes(B: int, T: int, L: int, K: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).view(B, T, L, K)


def _reference(engine, trainer, mask, max_flips, comparable):
    """One token at a time: the layers whose top-k sets differ, masked when more than max_flips."""
    B, T, L, _ = engine.shape
    keep = torch.ones(B, T, dtype=torch.bool)
    flips = torch.zeros(B, T, L, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            n = 0
            for layer in range(L):
                if comparable[b, t, layer] and set(engine[b, t, layer].tolist()) != set(trainer[b, t, layer].tolist()):
                    flips[b, t, layer] = True
                    n += 1
            keep[b, t] = n <= max_flips
    return keep, flips


@pytest.mark.parametrize("max_flips", [0, 1, 2])
def test_route_mask_matches_the_per_token_loop(max_flips):
    B, T, L, K, E = 3, 7, 4, 2, 4
    engine = _routes(B, T, L, K, E, 0).to(torch.uint8)
    trainer = engine.long().clone()
    other = _routes(B, T, L, K, E, 1)
    g = torch.Generator().manual_seed(2)
    swap = torch.rand(B, T, L, generator=g) < 0.3
    trainer[swap] = other[swap]
    trainer = trainer.flip(-1)  # the order within a top-k does not count
    mask = torch.rand(B, T, generator=g) < 0.8
    comparable = torch.rand(B, T, L, generator=g) < 0.9
    got = route_mask(engine, trainer, mask, max_flips, comparable)
    keep, flips = _reference(engine, trainer, mask, max_flips, comparable)
    assert torch.equal(got.keep, keep) and torch.equal(got.flips, flips)
    assert (~keep).any() and keep[mask].any(), "the draw must mask some tokens and keep others"
    assert not route_sets_differ(engine, engine.long().flip(-1)).any()


def test_route_mask_config_composes_with_the_ratio_modes_and_names_its_keys():
    from moe_rl.algo.config import ratio_mode, route_mask_bound
    from moe_rl.config import ConfigError, load_config

    def algo(*overrides):
        return load_config(None, ["rollout.return_routed_experts=true", *overrides]).algo

    a = algo("algo.replay=r2", "algo.rollout_correction.mode=route_mask")  # the shorthand: the mask alone, N = 0
    assert route_mask_bound(a) == 0 and ratio_mode(a.rollout_correction) is None
    a = algo("algo.replay=off", "algo.rollout_correction.mode=icepop", "algo.rollout_correction.route_mask.max_flips=2")
    assert route_mask_bound(a) == 2 and ratio_mode(a.rollout_correction) == "icepop"
    assert route_mask_bound(algo("algo.replay=r2")) is None
    a = algo("algo.replay=r3", "algo.rollout_correction.route_mask.max_flips=1",
             "algo.rollout_correction.route_mask.native=true")
    assert route_mask_bound(a) == 1
    # the trainer's routes need no engine log-prob ratio: behaviour=engine takes the route mask
    a = algo("algo.replay=r2", "algo.behaviour=engine", "algo.rollout_correction.mode=route_mask")
    assert route_mask_bound(a) == 0
    with pytest.raises(ConfigError, match="route_mask.native=true"):
        algo("algo.replay=r3", "algo.rollout_correction.mode=route_mask")
    with pytest.raises(ConfigError, match="route_mask.*rollout.return_routed_experts=true"):
        load_config(None, ["rollout.return_routed_experts=false", "algo.replay=r2",
                           "algo.rollout_correction.route_mask.max_flips=0"])
    with pytest.raises(ConfigError, match="algo.rollout_correction.route_mask.max_flips: -1 must be >= 0"):
        algo("algo.rollout_correction.route_mask.max_flips=-1")
    with pytest.raises(ConfigError, match="algo.replay_min_coverage: 1.5 must be in"):
        algo("algo.replay_min_coverage=1.5")
