"""Model families besides Qwen3-MoE against HF transformers: Mixtral (a tiny checkpoint whose
shapes are unlike the Qwen3 fixtures': 6 heads of 8 over 2 query groups, 6 experts top-2,
no QK-norm), read from its config.json, in several layouts (log-probs within 1e-4 of HF,
the HF -> megatron -> HF round trip bit-exact), and served by `moe-rl serve`'s engine with
HF's routes and a weight push under the checkpoint's own names; R2 and R3 replay in EP2."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.policy.convert import HFCheckpoint
from moe_rl.policy.parity import compare, hf_logprobs, layout_worker, sample_sequences
from moe_rl.testing import make_tiny_mixtral, run_ranks


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return make_tiny_mixtral(tmp_path_factory.mktemp("tiny_mixtral"), seed=0)


@pytest.fixture(scope="module")
def sequences():
    return sample_sequences(vocab_size=96, num=8, max_len=16, seed=1)


def test_mixtral_is_read_as_its_own_family(mixtral_dir):
    from moe_rl.policy.model import read_hf_config

    arch = read_hf_config(mixtral_dir)
    assert (arch.family, arch.hf_architecture) == ("mixtral", "MixtralForCausalLM")
    assert not arch.qk_layernorm and arch.norm_topk_prob  # HF renormalises Mixtral's top-k probabilities
    assert (arch.num_moe_experts, arch.moe_router_topk, arch.moe_layers, arch.kv_channels) == (6, 2, (0, 1), 8)
    assert arch.moe_ffn_hidden_size == 40


@pytest.mark.parametrize("layout", ["single", "tp2", "ep2", "pp2"])
def test_mixtral_layouts_give_hfs_logprobs_and_export_its_checkpoint(layout, mixtral_dir, sequences, tmp_path):
    from moe_rl.policy.parallel import ParallelLayout

    world = 1 if layout == "single" else ParallelLayout.parse(layout).world_size
    out = tmp_path / "export"
    results = run_ranks(layout_worker, world, layout, str(mixtral_dir), sequences, export_dir=str(out), timeout=600)
    mx, _ = compare(results, hf_logprobs(mixtral_dir, sequences))
    assert mx <= 1e-4, (layout, mx)
    src, back = HFCheckpoint(mixtral_dir), HFCheckpoint(out)
    assert sorted(back.weight_map) == sorted(src.weight_map)  # Mixtral's names: block_sparse_moe, w1/w2/w3
    assert all(torch.equal(back.get(n), src.get(n)) for n in src.weight_map)


def test_moe_rl_serve_engine_routes_as_hf_and_takes_a_push_in_mixtral_names(mixtral_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from moe_rl.drift.routes import hf_forward
    from moe_rl.rollout.engine import GenerateRequest, SamplingParams
    from moe_rl.rollout.local_engine import LocalEngine

    def served(eng):
        (res,), = eng.generate([GenerateRequest([5, 6, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                                               seed=3), return_routed_experts=True)])
        return res

    def reference(model, res):
        seq = torch.tensor([list(res.prompt_ids) + list(res.output_ids)])
        fwd = hf_forward(model, seq)
        p = len(res.prompt_ids)
        return fwd.logprobs[0, p - 1:].numpy(), fwd.routes[0, :-1].numpy()

    model = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32).eval()
    ckpt = HFCheckpoint(mixtral_dir)
    g = torch.Generator().manual_seed(0)
    pushed = {n: (t + torch.randn(t.shape, generator=g) * (0.5 if ".gate." in n else 0.02))  # routes move
              for n, t in ((n, ckpt.get(n)) for n in ckpt.weight_map)}
    eng = LocalEngine(mixtral_dir, seed=0, max_batch=8)
    try:
        before = served(eng)
        eng.update_weights_from_tensors(list(pushed.items()), version="2")  # the names SGLang's mixtral.py loads
        after = served(eng)
    finally:
        eng.close()
    lp, routes = reference(model, before)
    np.testing.assert_allclose(before.output_logprobs, lp, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(before.routed_experts.astype(np.int64), routes)
    model.load_state_dict({k: v for k, v in model.state_dict().items()} | _in_memory(model, pushed))
    lp, routes = reference(model, after)
    assert not np.array_equal(routes, reference(AutoModelForCausalLM.from_pretrained(
        mixtral_dir, dtype=torch.float32).eval(), after)[1])  # the push changed some route
    np.testing.assert_allclose(after.output_logprobs, lp, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(after.routed_experts.astype(np.int64), routes)


def _in_memory(model, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named Mixtral tensors as transformers' module state (the experts fused per layer)."""
    state = model.state_dict()
    out = {}
    for key in state:
        if key.endswith("mlp.experts.gate_up_proj"):
            layer = key.split(".")[2]
            e = state[key].shape[0]
            out[key] = torch.stack([torch.cat([named[f"model.layers.{layer}.block_sparse_moe.experts.{i}.w1.weight"],
                                               named[f"model.layers.{layer}.block_sparse_moe.experts.{i}.w3.weight"]])
                                    for i in range(e)])
        elif key.endswith("mlp.experts.down_proj"):
            layer = key.split(".")[2]
            out[key] = torch.stack([named[f"model.layers.{layer}.block_sparse_moe.experts.{i}.w2.weight"]
                                    for i in range(state[key].shape[0])])
        else:
            out[key] = named[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")]
    return out


def test_mixtral_routing_replay_r2_and_r3_in_ep2(mixtral_dir):
    # R2: replayed routes are the recorded ones even after the routers moved; R3: the trainer
    # routes every token exactly as the rollout engine (moe-rl serve's) did
    from moe_rl.rollout.engine import GenerateRequest, SamplingParams
    from moe_rl.rollout.local_engine import LocalEngine
    from moe_rl.testing.replay_worker import replay_worker

    engine = LocalEngine(mixtral_dir, seed=0)
    try:
        results = [r[0] for r in engine.generate([
            GenerateRequest(prompt_ids=[3 + i, 7, 11 + 2 * i, 5][: 2 + i % 3], return_routed_experts=True,
                            sampling=SamplingParams(max_new_tokens=3 + i, seed=i, ignore_eos=True))
            for i in range(6)])]
    finally:
        engine.close()
    sequences = [torch.tensor(list(r.prompt_ids) + list(r.output_ids)) for r in results]
    engine_routes = [torch.as_tensor(r.routed_experts) for r in results]
    ordered = lambda t: t.long().sort(dim=-1).values  # noqa: E731
    for r in run_ranks(replay_worker, 2, "ep2", str(mixtral_dir), sequences, micro_batch_size=2,
                       engine_routes=engine_routes, timeout=600):
        assert (r["logp_replay"] - r["logp_record"]).abs().max() <= 1e-5
        assert (r["logp_free_perturbed"] - r["logp_record"]).abs().max() > 1e-3  # the routers moved
        for j, i in enumerate(r["index"]):
            n = len(sequences[i]) - 1
            assert torch.equal(ordered(r["routes_used_perturbed"][j, :n]), ordered(r["recorded_routes"][j, :n]))
            assert torch.equal(ordered(r["routes_used_r3"][j, :n]), ordered(engine_routes[i])), i
            assert torch.equal(ordered(r["recorded_routes"][j, :n]), ordered(engine_routes[i])), i  # same weights
