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
