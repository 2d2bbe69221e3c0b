"""ParallelLayout validation, layout names, and launch-environment parsing."""
from __future__ import annotations

import pytest

from moe_rl.policy.model import UnsupportedModel, arch_from_hf_dict
from moe_rl.policy.parallel import LayoutError, ParallelLayout, first_host, read_dist_env

QWEN3 = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_experts_per_tok": 2, "num_experts": 4, "norm_topk_prob": True,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
}


@pytest.fixture
def arch():
    return arch_from_hf_dict(QWEN3)


@pytest.mark.parametrize("name,sizes,world", [
    ("tp2", dict(tp=2), 2), ("pp2-vpp2", dict(pp=2, vpp=2), 2), ("ep2", dict(ep=2), 2),
    ("tp2-ep2", dict(tp=2, ep=2), 4), ("tp2-pp2", dict(tp=2, pp=2), 4), ("dp2", dict(), 2),
    ("tp2-pp4-ep8", dict(tp=2, pp=4, ep=8), 64),
])
def test_parse_layout_names(name, sizes, world):
    layout = ParallelLayout.parse(name)
    assert layout.world_size == world
    for key, value in sizes.items():
        assert getattr(layout, key) == value


def test_dp_is_derived_and_sp_defaults_on_with_tp():
    layout = ParallelLayout.parse("tp2-ep2")
    assert layout.dp == 2 and layout.sequence_parallel
    assert not ParallelLayout.parse("pp2").sequence_parallel


@pytest.mark.parametrize("layout,message", [
    (ParallelLayout(tp=3, world_size=3), "num_attention_heads=4 is not divisible by tp=3"),
    (ParallelLayout(tp=4, world_size=4), "num_key_value_heads=2 is not divisible by tp=4"),
    (ParallelLayout(ep=8, world_size=8), "num_experts=4 is not divisible by ep=8"),
    (ParallelLayout(pp=2, vpp=4, world_size=2), "num_layers=4 is not divisible by pp*vpp = 8"),
    (ParallelLayout(pp=3, world_size=3), "num_layers=4 is not divisible by pp*vpp = 3"),
    (ParallelLayout(tp=2, sp=False, world_size=2), "requires sequence parallel"),
    (ParallelLayout(vpp=2, world_size=1), "parallel.vpp=2 needs parallel.pp >= 2"),
    (ParallelLayout(tp=2, pp=2, world_size=6), "world size 6 is not divisible by tp*pp = 2*2"),
    (ParallelLayout(ep=4, world_size=2), "ep*etp = 4*1 must divide world_size/pp = 2"),
])
def test_layout_errors_name_the_dimension(arch, layout, message):
    with pytest.raises(LayoutError, match=message.replace("*", r"\*")):
        layout.validate(arch)


def test_bad_layout_name():
    with pytest.raises(LayoutError, match="bad part 'xp2'"):
        ParallelLayout.parse("tp2-xp2")


def test_read_config_old_and_new_keys():
    old = arch_from_hf_dict(QWEN3)
    new_cfg = dict(QWEN3)
    new_cfg["num_local_experts"] = new_cfg.pop("num_experts")
    new_cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": new_cfg.pop("rope_theta")}
    new = arch_from_hf_dict(new_cfg)
    assert old == new
    assert new.num_moe_experts == 4 and new.rope_theta == 1e6 and new.moe_layers == (0, 1, 2, 3)


def test_dense_layers_from_mlp_only_layers():
    cfg = dict(QWEN3, mlp_only_layers=[0, 3])
    assert arch_from_hf_dict(cfg).moe_layers == (1, 2)


def test_padding_row_is_the_configs_pad_token_and_frozen_only_when_untied():
    from moe_rl.policy.train_step import frozen_rows

    assert arch_from_hf_dict(QWEN3).padding_idx is None  # no pad_token_id: every row trains
    arch = arch_from_hf_dict(dict(QWEN3, pad_token_id=0))
    assert arch.padding_idx == 0 and frozen_rows(arch) == (0,)
    assert arch_from_hf_dict(dict(QWEN3, pad_token_id=128)).padding_idx is None  # outside the vocabulary
    tied = arch_from_hf_dict(dict(QWEN3, pad_token_id=0, tie_word_embeddings=True))
    assert tied.padding_idx == 0 and frozen_rows(tied) == ()  # the row is also the pad token's output row


def test_uneven_pipeline_stages_are_checked_as_megatron_does():
    def fails(layout, layers, needle):
        with pytest.raises(LayoutError, match=needle):
            layout.validate_stages(layers)

    ParallelLayout(pp=2, first_stage_layers=1, world_size=2).validate_stages(4)  # 1 + 3
    ParallelLayout(pp=4, first_stage_layers=13, last_stage_layers=12, world_size=4).validate_stages(61)  # 13+18+18+12
    ParallelLayout(pp=2, vpp=2, first_stage_layers=2, world_size=2).validate_stages(6)  # 2 + 4, 2 per chunk
    fails(ParallelLayout(pp=4, world_size=4), 61, "not divisible by pp\\*vpp = 4; parallel.first_stage_layers")
    fails(ParallelLayout(pp=4, first_stage_layers=12, world_size=4), 61, "49 layers do not split evenly over the other 3")
    fails(ParallelLayout(pp=2, first_stage_layers=1, last_stage_layers=2, world_size=2), 4, "1 layers do not split")
    fails(ParallelLayout(pp=2, vpp=2, first_stage_layers=1, world_size=2), 5, "first_stage_layers=1 must be >= 1 and "
          "divisible by vpp=2")
    fails(ParallelLayout(first_stage_layers=1), 4, "need parallel.pp >= 2")
    assert ParallelLayout.parse("pp2-first1").first_stage_layers == 1 and ParallelLayout.parse("pp2-first1").world_size == 2
    assert ParallelLayout.parse("pp2-first1").name == "pp2-first1"


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedModel, match="'LlamaForCausalLM' is not supported; supported: DeepseekV3ForCausalLM, "
                       "Glm4MoeForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"):
        arch_from_hf_dict({"architectures": ["LlamaForCausalLM"]})


def test_torchrun_env_wins():
    env = read_dist_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0",
                         "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "h0", 1234)


def test_slurm_env():
    env = read_dist_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                         "SLURM_JOB_NODELIST": "gpu[003-010,012],cpu1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 1, "gpu003")


@pytest.mark.parametrize("nodelist,host", [
    ("node7", "node7"), ("a[1-4]", "a1"), ("gpu[003-010,012],cpu1", "gpu003"), ("x-y[10,20]", "x-y10"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_parse_refuses_a_dimension_given_twice():
    with pytest.raises(LayoutError, match="'tp2-tp2': tp is given twice"):
        ParallelLayout.parse("tp2-tp2")


@pytest.mark.parametrize("args,needle", [
    (["--layouts", ""], "--layouts names no layout"),
    (["--layouts", " , "], "--layouts names no layout"),
    (["--layouts", "tp2-tp2"], "tp is given twice"),
    (["--tokens", "0"], "--tokens 0: a sequence needs at least 2 tokens"),
    (["--tolerance", "-1"], "--tolerance -1: must be a finite number > 0"),
    (["--sequences", "0"], "--sequences 0: must be >= 1"),
    (["--hf-model", "/nonexistent/model"], "--hf-model /nonexistent/model: no config.json there"),
    # DeepSeek-V3's group-limited routing where HF and megatron-core rank the groups apart: before any rank
    (["--hf-model", "UNSUPPORTED"], "UNSUPPORTED: group-limited routing with num_experts_per_tok=4, topk_group=1 "
                                    "is not supported"),
])
def test_check_parity_refuses_bad_arguments_in_one_line(tiny_hf_dir, tmp_path, capsys, args, needle):
    import argparse

    from moe_rl.policy.parity import add_arguments, run
    from moe_rl.testing import make_tiny_deepseek_v3

    if "UNSUPPORTED" in args:
        bad = make_tiny_deepseek_v3(tmp_path / "dsv3", n_group=2, topk_group=1, num_experts_per_tok=4)
        args, needle = [str(bad) if a == "UNSUPPORTED" else a for a in args], needle.replace("UNSUPPORTED", str(bad))
        capsys.readouterr()  # the checkpoint writer's progress bar
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--hf-model", str(tiny_hf_dir), *args] if "--hf-model" not in args else args
    assert run(p.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_route_recording_is_reduced_in_the_smallest_type_that_holds_the_experts():
    """The old pass all-reduces `[B, T, L, K]` of expert id + 1 over TP x PP: uint8 up to 255 experts
    (Qwen3-30B-A3B's 128: a quarter of int32's bytes), int16 for DeepSeek-V3's 256, never truncated."""
    import torch

    from moe_rl.routes import record_dtype

    for experts, dtype in ((4, torch.uint8), (128, torch.uint8), (255, torch.uint8), (256, torch.int16),
                           (32766, torch.int16), (40000, torch.int32)):
        assert record_dtype(experts) == dtype
        assert torch.iinfo(dtype).max >= experts  # the largest id + 1 fits


@pytest.mark.parametrize("field,value,why", [("sliding_window", 4096, "sliding_window=4096"),
                                             ("router_jitter_noise", 0.1, "router_jitter_noise > 0")])
def test_mixtral_features_we_do_not_run_are_refused_with_the_reason(field, value, why):
    cfg = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 8, "num_local_experts": 2,
           "num_experts_per_tok": 1, "sliding_window": None, "router_jitter_noise": 0.0}
    assert arch_from_hf_dict(cfg).family == "mixtral"
    with pytest.raises(UnsupportedModel, match=why):
        arch_from_hf_dict({**cfg, field: value})
