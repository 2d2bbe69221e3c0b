"""`route_confidence` against a per-token loop: a softmax router's logit margin and probability mass,
and a sigmoid router's margin on what it ranks (sigmoid score + selection bias) with its mass of
sigmoid scores (GLM-4.5, DeepSeek-V3)."""
from __future__ import annotations

import math

import torch

from moe_rl.policy.replay import route_confidence


class _Router:
    def __init__(self, weight, score_function="softmax", expert_bias=None):
        self.weight, self.score_function, self.expert_bias = weight, score_function, expert_bias

    def gating(self, hidden):
        return hidden @ self.weight.T


def _loop(logits, k, sigmoid, bias):
    out = []
    for row in logits.tolist():
        if sigmoid:
            scores = [1 / (1 + math.exp(-x)) for x in row]
            select = [s + b for s, b in zip(scores, bias)]
        else:
            z = sum(math.exp(x) for x in row)
            scores, select = [math.exp(x) / z for x in row], row
        order = sorted(range(len(row)), key=lambda e: -select[e])
        out.append([sum(scores[e] for e in order[:k]) / sum(scores), select[order[k - 1]] - select[order[k]]])
    return torch.tensor(out)


def test_confidence_is_on_the_score_the_router_ranks():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(6, 8, generator=g)
    logits = (hidden.reshape(-1, 8) @ weight.T).double()
    bias = torch.randn(6, generator=g) * 0.5
    soft = route_confidence(_Router(weight), hidden, k=2)
    torch.testing.assert_close(soft, _loop(logits, 2, False, None).float(), rtol=0, atol=1e-5)
    sig = route_confidence(_Router(weight, "sigmoid", bias), hidden, k=2)
    torch.testing.assert_close(sig, _loop(logits, 2, True, bias.tolist()).float(), rtol=0, atol=1e-5)
    # the bias changes what is ranked: without it the margins differ
    plain = route_confidence(_Router(weight, "sigmoid", None), hidden, k=2)
    assert (plain[:, 1] - sig[:, 1]).abs().max() > 1e-2
