"""GPU performance settings (moe_rl/policy/perf.py): auto is on where megatron-core 0.16.1 can run each
one and off on CPU, an explicit true whose requirement is missing is refused naming the field, and each
resolved setting reaches megatron's TransformerConfig and DDP config."""
from __future__ import annotations

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.policy.perf import FUSIONS, Machine, PerfRequest, PerfSettings, resolve

CPU = Machine(gpu=False, te_version=None, apex_wgrad=False)
GPU_IMAGE = Machine(gpu=True, te_version=(2, 11), apex_wgrad=True)  # what docker/Dockerfile installs
GPU_BARE = Machine(gpu=True, te_version=None, apex_wgrad=False)


def test_auto_is_off_on_cpu_and_on_in_the_gpu_image():
    assert resolve(PerfRequest(), distributed_optimizer=True, machine=CPU) == PerfSettings()
    on = resolve(PerfRequest(), distributed_optimizer=True, machine=GPU_IMAGE)
    assert all(getattr(on, k) for k in (*FUSIONS, "overlap_grad_reduce", "overlap_param_gather"))
    assert not on.moe_router_fusion  # it skips routing replay: only ever on when asked for
    plain = resolve(PerfRequest(), distributed_optimizer=False, machine=GPU_IMAGE)
    assert plain.overlap_grad_reduce and not plain.overlap_param_gather  # the gather is the distributed optimizer's
    bare = resolve(PerfRequest(), distributed_optimizer=False, machine=GPU_BARE)  # no TE, no apex
    assert (bare.bias_activation_fusion, bare.bias_dropout_fusion, bare.overlap_grad_reduce) == (True, True, True)
    assert not (bare.moe_permute_fusion or bare.apply_rope_fusion or bare.gradient_accumulation_fusion)
    assert not resolve(PerfRequest(), distributed_optimizer=False, moe=False, machine=GPU_IMAGE).moe_permute_fusion


@pytest.mark.parametrize("field, machine, needle", [
    ("moe_permute_fusion", CPU, "model.moe_permute_fusion=true needs a GPU with transformer-engine >= 2.1 (no GPU)"),
    ("apply_rope_fusion", GPU_BARE, "transformer-engine >= 1.4 (transformer-engine is not installed)"),
    ("gradient_accumulation_fusion", GPU_BARE, "NVIDIA apex built with --cuda_ext (fused_weight_gradient_mlp_cuda)"),
    ("moe_router_fusion", Machine(gpu=True, te_version=(2, 5), apex_wgrad=True), "transformer-engine >= 2.7"),
    ("overlap_param_gather", GPU_IMAGE, "train.distributed_optimizer=true"),
])
def test_an_explicit_true_that_cannot_run_is_refused(field, machine, needle):
    with pytest.raises(ValueError) as e:
        resolve(PerfRequest(**{field: True}), distributed_optimizer=False, machine=machine)
    assert needle in str(e.value)


def test_explicit_values_win_over_auto():
    got = resolve(PerfRequest(bias_activation_fusion=True, overlap_grad_reduce=True, apply_rope_fusion=False),
                  distributed_optimizer=False, machine=CPU)
    assert got.bias_activation_fusion and got.overlap_grad_reduce
    assert not resolve(PerfRequest(apply_rope_fusion=False), distributed_optimizer=False,
                       machine=GPU_IMAGE).apply_rope_fusion


def test_each_setting_reaches_megatrons_transformer_config(monkeypatch):
    import megatron.core.transformer as mt

    from moe_rl.policy.model import arch_from_hf_dict, transformer_config
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.tiny import TinyMoEConfig

    seen = {}
    monkeypatch.setattr(mt, "TransformerConfig", lambda **kw: seen.update(kw))  # what megatron would get
    arch = arch_from_hf_dict(TinyMoEConfig().to_hf().to_dict(), "tiny")
    for name in (*FUSIONS, "moe_router_fusion"):
        for value in (True, False):
            transformer_config(arch, ParallelLayout(), perf=PerfSettings(**{name: value}))
            assert seen[name] is value, name
    transformer_config(arch, ParallelLayout())
    assert not any(seen[name] for name in (*FUSIONS, "moe_router_fusion"))  # none unless resolved on


def test_the_config_fields_reach_the_policy_request():
    from moe_rl.recipes.build import perf_request

    cfg = load_config(None, ["model.apply_rope_fusion=false", "model.bias_dropout_fusion=true",
                             "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true",
                             "train.distributed_optimizer=true"])
    req = perf_request(cfg)
    assert (req.apply_rope_fusion, req.bias_dropout_fusion, req.overlap_grad_reduce, req.overlap_param_gather) == \
        (False, True, True, True)
    assert req.moe_permute_fusion is None and req.moe_router_fusion is False
    with pytest.raises(ConfigError, match="overlap_param_gather: true needs train.distributed_optimizer"):
        load_config(None, ["parallel.overlap_param_gather=true"])
    with pytest.raises(ConfigError, match="moe_router_fusion: true is not allowed with drift.enabled"):
        load_config(None, ["model.moe_router_fusion=true", "algo.replay=off"])
