"""hf_forward / hf_routes against the model's own router logits and an unpadded forward."""
from __future__ import annotations

import pytest
import torch

from moe_rl.drift.routes import RouteCaptureError, hf_forward, hf_routes, pad_right, router_modules


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()


def test_routes_equal_topk_of_router_logits(model):
    ids = torch.randint(3, 128, (3, 11), generator=torch.Generator().manual_seed(0))
    hooks_before = [len(m._forward_hooks) for _, m in router_modules(model)]
    routes = hf_routes(model, ids)
    assert [len(m._forward_hooks) for _, m in router_modules(model)] == hooks_before  # ours are removed
    assert routes.shape == (3, 11, 4, 2)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    # router_logits: one [B*T, E] tensor per MoE layer; Qwen3-MoE picks top-k of the softmax
    want = torch.stack([torch.topk(torch.softmax(r.float(), -1), 2, dim=-1).indices
                        for r in out.router_logits], dim=1).view(3, 11, 4, 2)
    assert torch.equal(routes, want)
    assert [i for i, _ in router_modules(model)] == [0, 1, 2, 3]


def test_logprobs_of_next_tokens(model):
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    fwd = hf_forward(model, ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)
    want = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert fwd.logprobs.shape == (2, 8)
    torch.testing.assert_close(fwd.logprobs, want)


def test_right_padded_batch_matches_single_rows(model):
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 42, 43, 44]]
    ids, mask = pad_right(rows)
    fwd = hf_forward(model, ids, mask)
    assert fwd.logprob_mask.sum().item() == sum(len(r) - 1 for r in rows)
    for i, r in enumerate(rows):
        one = hf_forward(model, torch.tensor([r]))
        assert torch.equal(fwd.routes[i, :len(r)], one.routes[0])
        torch.testing.assert_close(fwd.logprobs[i, :len(r) - 1], one.logprobs[0], atol=1e-5, rtol=0)


def test_dense_model_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(RouteCaptureError, match="no MoE router"):
        hf_routes(LlamaForCausalLM(cfg), torch.tensor([[1, 2, 3]]))
