"""Model families besides Qwen3-MoE against HF transformers: Mixtral, Qwen2-MoE and GLM-4.5, each a
tiny checkpoint whose shapes are unlike the Qwen3 fixtures' (Mixtral: 6 heads of 8 over 2 query
groups, 6 experts, no QK-norm; Qwen2-MoE: head_dim 10, q/k/v biases, a dense first layer, a gated
shared expert, top-k not renormalised; GLM-4.5: head_dim 12 with RoPE on half of it, q/k/v biases
and QK-norm, a dense first layer, a shared expert, a sigmoid router whose selection bias is drawn
non-zero, routed_scaling_factor 2.5; DeepSeek-V3: multi-latent attention with YaRN RoPE, 8 experts
top-4 in 4 groups of which 2 are kept, a dense first layer, a shared expert, a drawn selection bias),
read from its config.json. Per family: log-probs within 1e-4 of
HF in several layouts and the HF -> megatron -> HF round trip bit-exact; `moe-rl serve`'s engine
with HF's log-probs and routes, before and after a weight push under the checkpoint's own names;
R2 and R3 replay in EP2. Qwen3-Next and Qwen3.5-MoE (gated delta net and gated full attention) share the
serve, push and replay tests (unpacked rows: megatron's gated delta net has no packed sequences); their
reading and layout tests are at the end."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moe_rl.policy.convert import HFCheckpoint
from moe_rl.policy.parity import compare, hf_logprobs, layout_worker, sample_sequences
from moe_rl.testing import (make_tiny_deepseek_v3, make_tiny_glm4_moe, make_tiny_mixtral, make_tiny_qwen2_moe,
                            make_tiny_qwen3_5_moe, make_tiny_qwen3_next, run_ranks)

# YaRN as DeepSeek-V3's released checkpoints use it (factor 40, beta 32 / 1, mscale 1 / 1), over an
# original context of 64 so that the tiny RoPE's frequencies really mix interpolated and kept ones.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _deepseek_v3_yarn(out_dir, seed=0):
    return make_tiny_deepseek_v3(out_dir, seed=seed, rope_parameters=YARN, max_position_embeddings=2560)


BUILDERS = {"mixtral": make_tiny_mixtral, "qwen2_moe": make_tiny_qwen2_moe, "glm4_moe": make_tiny_glm4_moe,
            "deepseek_v3": _deepseek_v3_yarn}
# The gated delta net families share the serve, push and replay tests; their layouts have their own tests
# below (longer sequences, no packed rows).
HYBRID = {"qwen3_next": make_tiny_qwen3_next, "qwen3_5_moe": make_tiny_qwen3_5_moe}


_BUILT: dict[str, object] = {}


def _tiny(name, tmp_path_factory):
    """The tiny checkpoint of `name`, built once for this module (`family` and the fixtures below share it)."""
    if name not in _BUILT:
        _BUILT[name] = {**BUILDERS, **HYBRID}[name](tmp_path_factory.mktemp(f"tiny_{name}"), seed=0)
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(BUILDERS) + sorted(HYBRID))
def family(request, tmp_path_factory):
    """(family name, tiny checkpoint directory)."""
    return request.param, _tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def sequences():
    return sample_sequences(vocab_size=96, num=8, max_len=16, seed=1)


def test_each_family_is_read_as_itself():
    from moe_rl.policy.model import read_hf_config

    def read(builder, tmp):
        return read_hf_config(builder(tmp))

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        mixtral = read(make_tiny_mixtral, f"{tmp}/m")
        qwen2 = read(make_tiny_qwen2_moe, f"{tmp}/q")
        glm = read(make_tiny_glm4_moe, f"{tmp}/g")
        ds = read(_deepseek_v3_yarn, f"{tmp}/d")
    assert (mixtral.family, mixtral.hf_architecture) == ("mixtral", "MixtralForCausalLM")
    assert not mixtral.qk_layernorm and mixtral.norm_topk_prob  # HF renormalises Mixtral's top-k probabilities
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk, mixtral.moe_layers, mixtral.kv_channels) == (6, 2, (0, 1), 8)
    assert (qwen2.family, qwen2.qkv_bias, qwen2.qk_layernorm, qwen2.norm_topk_prob) == ("qwen2_moe", True, False, False)
    assert (qwen2.shared_expert_size, qwen2.shared_expert_gate, qwen2.moe_layers, qwen2.kv_channels) == (24, True,
                                                                                                        (1, 2, 3), 10)
    assert (glm.family, glm.router_score, glm.expert_bias, glm.routed_scaling_factor) == ("glm4_moe", "sigmoid", True, 2.5)
    assert (glm.moe_layers, glm.shared_expert_size, glm.shared_expert_gate, glm.rotary_percent) == ((1, 2, 3), 16, False, 0.5)
    assert (glm.qkv_bias, glm.qk_layernorm, glm.kv_channels, glm.expert_bias_update_rate) == (True, True, 12, 0.0)
    assert (ds.family, ds.router_score, ds.router_groups, ds.routed_scaling_factor) == ("deepseek_v3", "sigmoid", (4, 2),
                                                                                         2.5)
    assert (ds.moe_layers, ds.shared_expert_size, ds.num_query_groups, ds.kv_channels) == ((1, 2, 3), 16, 4, 8)
    assert (ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.mla.qk_rope_head_dim) == (24, 16, 4)
    assert dict(ds.mla.yarn)["rotary_scaling_factor"] == 40.0 and dict(ds.mla.yarn)["mscale_all_dim"] == 1.0


def test_sigmoid_routers_megatron_cannot_match_are_refused_by_name():
    from moe_rl.policy.model import UnsupportedModel, arch_from_hf_dict
    from moe_rl.policy.families.glm4_moe import TINY as TINY_GLM4_MOE

    base = {**TINY_GLM4_MOE, "architectures": ["Glm4MoeForCausalLM"]}
    with pytest.raises(UnsupportedModel, match="norm_topk_prob=false"):
        arch_from_hf_dict({**base, "norm_topk_prob": False})
    with pytest.raises(UnsupportedModel, match="top-2 scores"):  # groups ranked by their top-1 in megatron
        arch_from_hf_dict({**base, "n_group": 2, "topk_group": 2})
    assert arch_from_hf_dict({**base, "n_group": 3, "topk_group": 1, "num_experts_per_tok": 2}).router_groups == (3, 1)
    with pytest.raises(UnsupportedModel, match="supported: .*DeepseekV3ForCausalLM, Glm4MoeForCausalLM"):
        arch_from_hf_dict({**base, "architectures": ["Glm4ForCausalLM"]})
    from moe_rl.policy.families.deepseek_v3 import TINY as TINY_DEEPSEEK_V3

    ds = {**TINY_DEEPSEEK_V3, "architectures": ["DeepseekV3ForCausalLM"]}
    with pytest.raises(UnsupportedModel, match="rope_interleave=false"):
        arch_from_hf_dict({**ds, "rope_interleave": False})
    with pytest.raises(UnsupportedModel, match="attention_factor"):
        arch_from_hf_dict({**ds, "rope_parameters": {**YARN, "attention_factor": 1.2}})
    assert arch_from_hf_dict({**ds, "num_nextn_predict_layers": 1}).extra == {"mtp_layers": 1}
    from moe_rl.policy.parallel import LayoutError, ParallelLayout

    with pytest.raises(LayoutError, match="kv_lora_rank \\+ qk_rope_head_dim=21 is not divisible by tp=2"):
        ParallelLayout(tp=2, world_size=2).validate(arch_from_hf_dict({**ds, "kv_lora_rank": 17}))


@pytest.mark.parametrize("family", sorted(BUILDERS), indirect=True)
@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2", "pp2-first1"])
def test_layouts_give_hfs_logprobs_and_export_the_checkpoint(family, layout, sequences, tmp_path):
    from moe_rl.policy.parallel import ParallelLayout

    name, model_dir = family
    if (name, layout) == ("mixtral", "pp2"):  # suite time: Qwen2-MoE's pp2 also splits around a dense layer
        pytest.skip("pp2 splits Mixtral's all-MoE layers as it splits Qwen3-MoE's (tests/distributed/test_policy_layouts.py)")
    if (name, layout) == ("glm4_moe", "pp2"):  # suite time: the same split as Qwen2-MoE's
        pytest.skip("pp2 splits GLM-4.5 after its dense first layer as it splits Qwen2-MoE")
    if layout == "ep2" and name in ("mixtral", "glm4_moe"):  # suite time: their replay test loads them in EP2
        pytest.skip("EP2 parity runs on DeepSeek-V3 (sigmoid router, groups) and Qwen2-MoE (shared expert, "
                    "dense layer); Mixtral and GLM-4.5 load in EP2 in their replay test")
    if layout.startswith("pp2") and (layout == "pp2-first1") != (name == "deepseek_v3"):
        pytest.skip("DeepSeek-V3 (whose 61 layers need them) runs uneven pipeline stages, 1 + 3 layers; the "
                    "others split evenly")
    out = tmp_path / "export"
    results = run_ranks(layout_worker, ParallelLayout.parse(layout).world_size, layout, str(model_dir), sequences,
                        export_dir=str(out), timeout=600)
    mx, _ = compare(results, hf_logprobs(model_dir, sequences))
    assert mx <= 1e-4, (name, layout, mx)
    src, back = HFCheckpoint(model_dir), HFCheckpoint(out)
    assert sorted(back.weight_map) == sorted(src.weight_map)  # the family's own names
    assert all(torch.equal(back.get(n), src.get(n)) for n in src.weight_map)


def test_deepseek_v3_without_a_query_bottleneck_gives_hfs_logprobs(sequences, tmp_path):
    # q_lora_rank null (DeepSeek-V2-Lite, Moonlight's smaller cousins): megatron's linear_q_proj is HF's q_proj
    model_dir = make_tiny_deepseek_v3(tmp_path / "ds", seed=1, q_lora_rank=None)
    results = run_ranks(layout_worker, 1, "single", str(model_dir), sequences, timeout=600)
    assert compare(results, hf_logprobs(model_dir, sequences))[0] <= 1e-4


def test_moe_rl_serve_engine_routes_as_hf_and_takes_a_push_in_the_familys_names(family):
    from transformers import AutoModelForCausalLM

    from moe_rl.drift.routes import hf_forward
    from moe_rl.rollout.engine import GenerateRequest, SamplingParams
    from moe_rl.rollout.local_engine import LocalEngine

    name, model_dir = family

    def served(eng):
        (res,), = eng.generate([GenerateRequest([5, 6, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                                               seed=3), return_routed_experts=True)])
        return res

    def reference(model, res):
        fwd = hf_forward(model, torch.tensor([list(res.prompt_ids) + list(res.output_ids)]))
        return fwd.logprobs[0, len(res.prompt_ids) - 1:].numpy(), fwd.routes[0, :-1].numpy()

    def hf_model():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    ckpt = HFCheckpoint(model_dir)
    g = torch.Generator().manual_seed(0)
    pushed = {n: t + torch.randn(t.shape, generator=g) * (0.5 if n.endswith(".gate.weight") else 0.02)
              for n, t in ((n, ckpt.get(n)) for n in ckpt.weight_map)}  # the routers move most
    eng = LocalEngine(model_dir, seed=0, max_batch=8)
    try:
        before = served(eng)
        eng.update_weights_from_tensors(list(pushed.items()), version="2")  # the names SGLang's loader reads
        after = served(eng)
    finally:
        eng.close()
    lp, routes = reference(hf_model(), before)
    np.testing.assert_allclose(before.output_logprobs, lp, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(before.routed_experts.astype(np.int64), routes)
    model = hf_model()
    model.load_state_dict(_in_memory(model, pushed))
    lp, routes = reference(model, after)
    np.testing.assert_allclose(after.output_logprobs, lp, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(after.routed_experts.astype(np.int64), routes)
    assert not np.array_equal(routes, reference(hf_model(), after)[1]), name  # the push changed some route


def test_moe_rl_serve_refuses_a_push_that_splits_a_pair_sglang_fuses(tmp_path):
    # SGLang's DeepSeek loader fuses q_a_proj and kv_a_proj_with_mqa inside one load and drops a lone
    # one (that layer keeps its old weights); moe-rl serve refuses it and changes nothing
    from moe_rl.rollout.local_engine import LocalEngine

    model_dir = make_tiny_deepseek_v3(tmp_path / "ds", seed=0)
    a = "model.layers.2.self_attn."
    ckpt = HFCheckpoint(model_dir)
    eng = LocalEngine(model_dir, seed=0)
    try:
        before = eng.model.state_dict()[f"{a}q_a_proj.weight"].clone()
        with pytest.raises(ValueError, match="q_a_proj.weight without .*kv_a_proj_with_mqa.weight"):
            eng.update_weights_from_tensors([(f"{a}q_a_proj.weight", ckpt.get(f"{a}q_a_proj.weight") + 1)])
        assert torch.equal(eng.model.state_dict()[f"{a}q_a_proj.weight"], before)
        pair = [(f"{a}{n}.weight", ckpt.get(f"{a}{n}.weight") + 1) for n in ("q_a_proj", "kv_a_proj_with_mqa")]
        eng.update_weights_from_tensors(pair)
        assert torch.equal(eng.model.state_dict()[f"{a}q_a_proj.weight"], before + 1)
    finally:
        eng.close()


def _in_memory(model, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors as transformers' module state: Mixtral's names (block_sparse_moe,
    w1/w2/w3) as Qwen's, and each layer's experts fused (gate_up_proj = [gate; up], down_proj)."""
    renames = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w2.", ".down_proj."),
               (".w3.", ".up_proj."))
    plain = {}
    for key, t in named.items():
        for old, new in renames:
            key = key.replace(old, new)
        plain[key] = t
    out = {}
    for key, t in model.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            prefix = key.rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
            out[key] = torch.stack([torch.cat([plain[f"{prefix}.{e}.{p}.weight"] for p in parts])
                                    for e in range(t.shape[0])])
        else:
            out[key] = plain[key]
    return out


def test_routing_replay_r2_and_r3_in_ep2(family):
    # R2: replayed routes are the recorded ones even after the routers moved; R3: the trainer
    # routes every token exactly as the rollout engine (moe-rl serve's) did
    from moe_rl.rollout.engine import GenerateRequest, SamplingParams
    from moe_rl.rollout.local_engine import LocalEngine
    from moe_rl.testing.replay_worker import replay_worker

    name, model_dir = family
    engine = LocalEngine(model_dir, seed=0)
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
    for r in run_ranks(replay_worker, 2, "ep2", str(model_dir), sequences, micro_batch_size=2,
                       engine_routes=engine_routes, timeout=600):
        assert (r["logp_replay"] - r["logp_record"]).abs().max() <= 1e-5
        assert (r["logp_free_perturbed"] - r["logp_record"]).abs().max() > 1e-3  # the routers moved
        for j, i in enumerate(r["index"]):
            n = len(sequences[i]) - 1
            assert torch.equal(ordered(r["routes_used_perturbed"][j, :n]), ordered(r["recorded_routes"][j, :n]))
            assert torch.equal(ordered(r["routes_used_r3"][j, :n]), ordered(engine_routes[i])), (name, i)
            assert torch.equal(ordered(r["recorded_routes"][j, :n]), ordered(engine_routes[i])), (name, i)


def expert_bias_worker(layout_name: str, hf_dir: str, sequences: list[torch.Tensor], rate: float) -> dict:
    """One update of a GLM-4.5 policy with `model.expert_bias_update_rate = rate`: its step metrics and
    the HF-named selection biases (what a weight push sends) before and after."""
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    policy = Policy(PolicySpec(hf_dir, ParallelLayout.parse(layout_name), OptimConfig(lr=1e-3), micro_batch_size=4,
                               expert_bias_update_rate=rate))

    def biases():
        return {k: v.clone() for k, v in policy.hf_tensors() if k.endswith("e_score_correction_bias")}

    def loss(logp, mb):
        return -(logp * mb.loss_mask).sum() / mb.loss_mask.sum() / 2, {}

    before = biases()
    out = policy.update(sequences, {}, loss)
    return {"before": before, "after": biases(), "step": out.step}


def test_the_selection_bias_is_frozen_by_default_and_balances_when_asked(tmp_path, sequences):
    # frozen (the default, rate 0): routes stay put between updates; a rate moves every MoE layer's
    # bias by exactly +-rate (or 0 at the mean load) towards an even load (megatron's aux-loss-free
    # balancing), the move is logged, and the tensors a weight push sends carry it
    from moe_rl.policy.model import read_hf_config, transformer_config
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import PolicySpec

    model_dir = make_tiny_glm4_moe(tmp_path / "glm", seed=0)
    assert PolicySpec("x", ParallelLayout(), None).expert_bias_update_rate == 0.0
    config = transformer_config(read_hf_config(model_dir), ParallelLayout())
    assert (config.moe_router_enable_expert_bias, config.moe_router_bias_update_rate) == (True, 0.0)
    src = HFCheckpoint(model_dir)
    (moving,) = run_ranks(expert_bias_worker, 1, "single", str(model_dir), sequences[:4], 0.01)
    names = sorted(moving["before"])
    assert names == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)]
    assert all(torch.equal(moving["before"][n], src.get(n)) for n in names)
    for n in names:
        step = moving["after"][n] - moving["before"][n]
        assert all(min(abs(v - 0.01), abs(v + 0.01), abs(v)) < 1e-7 for v in step.tolist()), (n, step)
        assert (step > 0).any() and (step < 0).any(), n  # the loaded experts down, the idle ones up
    assert moving["step"]["moe/expert_bias_change"] == pytest.approx(0.01, abs=1e-7)


# Qwen3-Next (its own tests, not through `family`, for suite time): gated delta net layers 0 and 2, gated
# full attention 1 and 3, sequences of up to 72 tokens so that the delta net's chunks of 64 carry state.
@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return _tiny("qwen3_next", tmp_path_factory)


def test_qwen3_next_is_read_as_itself_and_what_megatron_cannot_match_is_refused_by_name(qwen3_next):
    from moe_rl.config import ConfigError, load_config
    from moe_rl.policy.model import UnsupportedModel, arch_from_hf_dict, read_hf_config
    from moe_rl.policy.parallel import LayoutError, ParallelLayout
    from moe_rl.policy.families.qwen3_next import TINY as TINY_QWEN3_NEXT

    arch = read_hf_config(qwen3_next)
    la = arch.linear_attention
    assert (arch.family, arch.hf_architecture, arch.rotary_percent, arch.kv_channels) == (
        "qwen3_next", "Qwen3NextForCausalLM", 0.25, 24)
    assert (la.layers, la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (
        (0, 2), 2, 4, 6, 10, 4)
    assert arch.attention_output_gate and arch.zero_centered_norms and arch.qk_layernorm
    assert (arch.shared_expert_size, arch.shared_expert_gate, arch.moe_layers) == (24, True, (0, 1, 2, 3))
    base = {k: v for k, v in TINY_QWEN3_NEXT.items() if k != "layer_types"} | {"architectures": ["Qwen3NextForCausalLM"]}
    assert arch_from_hf_dict({**base, "full_attention_interval": 2}).linear_attention.layers == (0, 2)
    assert arch_from_hf_dict({**base, "decoder_sparse_step": 2, "mlp_only_layers": [1]}).moe_layers == (3,)
    for field, value, match in (("attention_bias", True, "attention_bias=true"), ("hidden_act", "gelu", "hidden_act"),
                                ("head_dim", 12, "odd number of dims"),
                                ("layer_types", ["linear_attention"] * 3 + ["sliding_attention"], "layer_types"),
                                ("linear_num_value_heads", 3, "linear_num_value_heads=3")):
        with pytest.raises(UnsupportedModel, match=match):
            arch_from_hf_dict({**base, field: value})
    with pytest.raises(LayoutError, match="linear_num_key_heads=2 .* divisible by tp=4"):
        ParallelLayout(tp=4, world_size=4).validate(arch_from_hf_dict({**base, "num_key_value_heads": 4}))
    with pytest.raises(ConfigError, match="max_tokens_per_microbatch.*gated delta net refuses packed"):
        load_config(None, [f"model.hf_path={qwen3_next}", "parallel.max_tokens_per_microbatch=512"])
    demo = str(Path(__file__).resolve().parents[2] / "launch/configs/tiny_cpu.yaml")  # it packs rows
    with pytest.raises(ConfigError,
                       match=r"model.tiny.family=qwen3_next .*set parallel.max_tokens_per_microbatch=null"):
        load_config(demo, ["model.tiny.family=qwen3_next"])
    assert load_config(demo, ["model.tiny.family=qwen3_next", "parallel.max_tokens_per_microbatch=null"])
    from moe_rl.policy.families.registry import tiny_hf_config
    from moe_rl.policy.tiny import TinyMoEConfig

    tiny = arch_from_hf_dict(tiny_hf_config("qwen3_next", TinyMoEConfig()).to_dict())  # the fresh model's shape
    assert (tiny.family, tiny.linear_attention.layers, tiny.linear_attention.value_heads) == ("qwen3_next", (0, 2), 4)


@pytest.mark.parametrize("layout", ["tp2"])  # suite time: tp2 splits every reorder of the map over two ranks
def test_qwen3_next_layouts_give_hfs_logprobs_and_export_the_checkpoint(qwen3_next, layout, tmp_path):
    from moe_rl.policy.parallel import ParallelLayout

    sequences = sample_sequences(vocab_size=96, num=2, max_len=72, seed=1)
    out = tmp_path / "export"
    results = run_ranks(layout_worker, ParallelLayout.parse(layout).world_size, layout, str(qwen3_next), sequences,
                        export_dir=str(out), timeout=600)
    mx, _ = compare(results, hf_logprobs(qwen3_next, sequences))
    assert mx <= 1e-4, (layout, mx)
    src, back = HFCheckpoint(qwen3_next), HFCheckpoint(out)
    assert sorted(back.weight_map) == sorted(src.weight_map)
    assert all(torch.equal(back.get(n), src.get(n)) for n in src.weight_map)


def _served_as_hf(model_dir, rows: int, architecture: str, route_shape: tuple[int, int] | None = None) -> None:
    """moe-rl serve's engine on `rows` prompts of different lengths finishing at different steps (the
    engine drops finished rows from the delta net's conv and recurrent states as from the attention
    layers' keys and values): log-probs within 1e-5 of HF's forward and routes equal to HF's own."""
    from transformers import AutoModelForCausalLM

    from moe_rl.drift.routes import hf_forward
    from moe_rl.rollout.engine import GenerateRequest, SamplingParams
    from moe_rl.rollout.local_engine import LocalEngine

    eng = LocalEngine(model_dir, seed=0, max_batch=8)
    try:
        served = [r[0] for r in eng.generate([
            GenerateRequest([5, 6, 7, 8][: 2 + i], SamplingParams(max_new_tokens=5 + i, ignore_eos=True, seed=3 + i),
                            return_routed_experts=True) for i in range(rows)])]
    finally:
        eng.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    for res in served:
        fwd = hf_forward(model, torch.tensor([list(res.prompt_ids) + list(res.output_ids)]))
        np.testing.assert_allclose(res.output_logprobs, fwd.logprobs[0, len(res.prompt_ids) - 1:].numpy(),
                                   atol=1e-5, rtol=0)
        if route_shape is not None:
            assert res.routed_experts.shape[1:] == route_shape
        np.testing.assert_array_equal(res.routed_experts.astype(np.int64), fwd.routes[0, :-1].numpy())


def test_qwen3_next_served_by_moe_rl_serve_routes_as_hf(qwen3_next):
    _served_as_hf(qwen3_next, 3, "Qwen3NextForCausalLM")


# Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`): Qwen3-Next's layers with the delta net's input projections stored
# apart, multimodal RoPE and a router that always renormalises; layers 0-2 delta net, 3 full attention.
@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    return _tiny("qwen3_5_moe", tmp_path_factory)


def test_qwen3_5_moe_is_read_as_itself_its_rope_is_plain_at_text_positions_and_refusals_name_the_field(qwen3_5_moe):
    import transformers
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    from moe_rl.config import ConfigError, load_config
    from moe_rl.policy.model import UnsupportedModel, arch_from_hf_dict, read_hf_config
    from moe_rl.policy.families.qwen3_5_moe import TINY as TINY_QWEN3_5_MOE

    arch = read_hf_config(qwen3_5_moe)
    la = arch.linear_attention
    assert (arch.family, arch.hf_architecture, arch.rotary_percent, arch.kv_channels, arch.vocab_size) == (
        "qwen3_5_moe", "Qwen3_5MoeForCausalLM", 0.5, 16, 112)
    assert (la.layers, la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim) == ((0, 1, 2), 2, 6, 8, 6)
    assert arch.attention_output_gate and arch.zero_centered_norms and arch.qk_layernorm and arch.norm_topk_prob
    assert (arch.num_moe_experts, arch.moe_router_topk, arch.moe_layers) == (6, 3, (0, 1, 2, 3))
    assert (arch.shared_expert_size, arch.shared_expert_gate, arch.router_score) == (20, True, "softmax")
    base = TINY_QWEN3_5_MOE | {"architectures": ["Qwen3_5MoeForCausalLM"]}
    for field, value, match in (("attention_bias", True, "Qwen3.5-MoE with attention_bias=true"),
                                ("hidden_act", "gelu", "hidden_act='gelu'"), ("head_dim", 10, "odd number of dims"),
                                ("linear_num_value_heads", 5, "linear_num_value_heads=5"),
                                ("shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0"),
                                ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'")):
        with pytest.raises(UnsupportedModel, match=match):
            arch_from_hf_dict({**base, field: value})
    vision = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": base}
    with pytest.raises(UnsupportedModel, match=r"Qwen3_5MoeForConditionalGeneration.*text-only.*text_config"):
        arch_from_hf_dict(vision)
    with pytest.raises(UnsupportedModel, match=r"supported: .*Qwen3_5MoeForCausalLM") as err:
        arch_from_hf_dict({"architectures": ["Qwen3_5ForCausalLM"]})
    assert "ConditionalGeneration" not in str(err.value)
    with pytest.raises(ConfigError, match="max_tokens_per_microbatch.*Qwen3.5-MoE.*gated delta net refuses packed"):
        load_config(None, [f"model.hf_path={qwen3_5_moe}", "parallel.max_tokens_per_microbatch=512"])
    # HF's multimodal RoPE (sections [2, 1, 1], interleaved) at text positions, the three components
    # equal, against plain RoPE on the first half of each head (megatron's rotary_percent 0.5): cos and
    # sin of position * theta^(-2i / 8), each half repeated
    cfg = transformers.Qwen3_5MoeTextConfig(**TINY_QWEN3_5_MOE)
    positions = torch.arange(300)
    cos, sin = Qwen3_5MoeTextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32),
                                                   positions.view(1, 1, -1).expand(3, 1, -1))
    angle = positions[:, None].float() * 10000.0 ** (-torch.arange(0, 8, 2).float() / 8)
    assert torch.equal(cos[0], torch.cat([angle.cos(), angle.cos()], -1))
    assert torch.equal(sin[0], torch.cat([angle.sin(), angle.sin()], -1))


def test_qwen3_5_moe_tp2_gives_hfs_logprobs_and_exports_the_checkpoint(qwen3_5_moe, tmp_path):
    # tp2 splits each of the four delta-net projections and the conv channels per part over the ranks
    sequences = sample_sequences(vocab_size=112, num=2, max_len=72, seed=1)
    out = tmp_path / "export"
    results = run_ranks(layout_worker, 2, "tp2", str(qwen3_5_moe), sequences, export_dir=str(out), timeout=600)
    mx, _ = compare(results, hf_logprobs(qwen3_5_moe, sequences))
    assert mx <= 1e-4, mx
    src, back = HFCheckpoint(qwen3_5_moe), HFCheckpoint(out)
    assert sorted(back.weight_map) == sorted(src.weight_map)
    assert all(torch.equal(back.get(n), src.get(n)) for n in src.weight_map)


def test_qwen3_5_moe_served_by_moe_rl_serve_routes_as_hf(qwen3_5_moe):
    _served_as_hf(qwen3_5_moe, 2, "Qwen3_5MoeForCausalLM", route_shape=(4, 3))
