"""RunConfig: shipped YAMLs load, overrides apply, every class of mistake is reported clearly."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, RunConfig, load_config
from moe_rl.policy.parallel import ParallelLayout

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
SHIPPED = ["tiny_cpu.yaml", "qwen3_30b_a3b_gspo.yaml", "tiny_cpu_vapo.yaml", "qwen3_30b_a3b_vapo.yaml",
           "glm45_air_gspo.yaml", "moonlight_16b_a3b_gspo.yaml", "deepseek_v3_671b_gspo.yaml"]


def error_of(overrides: list[str], path: str | Path | None = None) -> str:
    """The ConfigError message that loading with these overrides raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# -- shipped configs ---------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_and_validate(name):
    cfg = load_config(CONFIGS / name)
    assert isinstance(cfg, RunConfig)
    cfg.validate()


def test_tiny_cpu_exercises_a_parallel_dimension():
    cfg = load_config(CONFIGS / "tiny_cpu.yaml")
    assert cfg.model.hf_path is None
    assert cfg.rollout.engine == "local"
    assert (cfg.algo.loss, cfg.algo.replay) == ("gspo", "r2")
    assert cfg.parallel.ep == 2 and cfg.train.world_size == 2


def test_qwen3_config_layout():
    cfg = load_config(CONFIGS / "qwen3_30b_a3b_gspo.yaml")
    p = cfg.parallel
    assert (p.tp, p.pp, p.ep, p.etp) == (2, 4, 8, 1)
    assert ParallelLayout.of(p, 64).sequence_parallel
    assert cfg.model.dtype == "bf16" and cfg.model.recompute
    assert cfg.rollout.engine == "sglang" and cfg.algo.replay == "r3"
    assert cfg.train.distributed_optimizer and cfg.train.lr == pytest.approx(1e-6)
    assert cfg.rollout.max_new_tokens == 8192 and cfg.rollout.n_samples == 8


def test_glm45_air_config_layout_fits_the_published_model():
    # GLM-4.5-Air's published config.json dims: the layout divides them on 64 trainer GPUs
    from moe_rl.policy.model import arch_from_hf_dict

    cfg = load_config(CONFIGS / "glm45_air_gspo.yaml")
    arch = arch_from_hf_dict({"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 4096,
                              "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
                              "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
                              "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
                              "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "n_group": 1,
                              "topk_group": 1, "norm_topk_prob": True, "attention_bias": True,
                              "partial_rotary_factor": 0.5, "rope_theta": 1000000, "num_nextn_predict_layers": 1})
    layout = ParallelLayout.of(cfg.parallel, 64).validate(arch)
    assert (layout.tp, layout.pp, layout.ep, layout.world_size // (layout.tp * layout.pp)) == (2, 2, 16, 16)
    assert arch.moe_layers == tuple(range(1, 46)) and arch.router_score == "sigmoid"
    assert cfg.model.expert_bias_update_rate == 0.0 and cfg.algo.replay == "r3"


@pytest.mark.parametrize("name,world,hf", [
    # the published config.json dims of each (the fields the readers use)
    ("moonlight_16b_a3b_gspo.yaml", 8, {
        "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "norm_topk_prob": True, "rope_theta": 50000}),
    ("deepseek_v3_671b_gspo.yaml", 512, {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
        "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, "rope_theta": 10000}),
])
def test_deepseek_v3_class_configs_fit_the_published_models(name, world, hf):
    from moe_rl.policy.model import arch_from_hf_dict

    cfg = load_config(CONFIGS / name)
    arch = arch_from_hf_dict({"architectures": ["DeepseekV3ForCausalLM"], **hf})
    layout = ParallelLayout.of(cfg.parallel, world).validate(arch)
    assert arch.family == "deepseek_v3" and arch.moe_layers[0] == hf["first_k_dense_replace"]
    assert layout.world_size // (layout.tp * layout.pp) % layout.ep == 0
    assert cfg.algo.replay == "r3" and cfg.model.expert_bias_update_rate == 0.0


@pytest.mark.parametrize("name", ["qwen3_30b_a3b_gspo.yaml", "deepseek_v3_671b_gspo.yaml", "glm45_air_gspo.yaml",
                                  "moonlight_16b_a3b_gspo.yaml"])
def test_flagship_gspo_configs_are_one_step_off_with_retracting_pushes(name):
    """Asynchronous RL is the measured faster shape (docs/results/benchmarks.md: K=1 1.3x the samples/s of K=0); the flagships
    ship it: one step off, pushes that retract (exact versions and routes for R3, no stale prefix cache),
    the decoupled-PPO correction."""
    from moe_rl.algo.config import staleness_bound
    from moe_rl.recipes.build import inflight_client_args
    from moe_rl.rollout.config import pause_mode

    cfg = load_config(CONFIGS / name)
    assert staleness_bound(cfg.algo) == 1 and pause_mode(cfg.rollout, 1) == "retract"  # auto, when asynchronous
    assert cfg.algo.tis_cap == 2.0 and cfg.algo.replay == "r3" and cfg.algo.behaviour == "recompute"
    assert inflight_client_args(cfg) == {"flush_on_update": True, "pushes_in_place": False, "version_lag": 1}


def test_defaults_validate_without_a_file():
    cfg = load_config(None)
    assert cfg == RunConfig()
    assert cfg.algo.loss == "gspo" and cfg.parallel.sp is None
    assert not ParallelLayout.of(cfg.parallel, 1).sequence_parallel


# -- overrides -----------------------------------------------------------------

def test_overrides_change_values():
    cfg = load_config(CONFIGS / "tiny_cpu.yaml", ["algo.loss=sapo", "parallel.tp=2", "train.lr=3e-6",
                                                  "model.tiny.num_experts=8", "data.eval=null",
                                                  "train.eval_every=0"])
    assert cfg.algo.loss == "sapo"
    assert cfg.parallel.tp == 2 and ParallelLayout.of(cfg.parallel, 2).sequence_parallel
    assert cfg.train.lr == pytest.approx(3e-6)
    assert cfg.model.tiny.num_experts == 8
    assert cfg.data.eval is None
    assert cfg.parallel.ep == 2  # untouched YAML value survives


def test_list_overrides():
    cfg = load_config(None, ["rollout.urls=[http://node1:30000,http://node2:30000]",
                             "rollout.sglang_args=[--tp-size,2]"])
    assert cfg.rollout.urls == ["http://node1:30000", "http://node2:30000"]
    assert cfg.rollout.sglang_args == ["--tp-size", "2"]


def test_overrides_win_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  loss: grpo\ntrain:\n  steps: 3\n")
    cfg = load_config(path, ["algo.loss=dapo"])
    assert (cfg.algo.loss, cfg.train.steps) == ("dapo", 3)


def test_empty_section_keeps_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  # everything commented out\nlog:\n  name: x\n")
    cfg = load_config(path)
    assert cfg.algo == RunConfig().algo and cfg.log.name == "x"


# -- errors: values ------------------------------------------------------------

def test_bad_enum_lists_allowed_values():
    msg = error_of(["algo.loss=gspox"])
    assert "algo.loss: 'gspox' is not one of grpo, dapo, gspo, gspo_token, sapo" in msg
    assert "did you mean 'gspo'" in msg


def test_allowed_values_are_the_registries(monkeypatch):
    # adding a loss is one place: a registered loss is a valid algo.loss, with no list to edit in config
    from moe_rl.algo import losses

    assert "algo.loss: 'my_pg' is not one of" in error_of(["algo.loss=my_pg"])
    monkeypatch.setitem(losses.LOSSES, "my_pg", losses.LOSSES["grpo"])
    assert load_config(None, ["algo.loss=my_pg"]).algo.loss == "my_pg"
    from moe_rl.algo import advantages, aggregation, kl
    assert tuple(get_field_choices("algo", "advantage")) == (*advantages.ADVANTAGE_ESTIMATORS, "gae")
    assert tuple(get_field_choices("algo", "aggregation")) == aggregation.AGG_MODES
    assert tuple(get_field_choices("algo", "kl_estimator")) == kl.KL_ESTIMATORS


def get_field_choices(section, name):
    cls = type(getattr(RunConfig(), section))
    return next(f.metadata["choices"] for f in dataclasses.fields(cls) if f.name == name)


def test_negative_int():
    assert "parallel.ep: -2 must be >= 1" in error_of(["parallel.ep=-2"])


def test_probability_range():
    assert "rollout.top_p: 0.0 must be in (0.0, 1.0]" in error_of(["rollout.top_p=0.0"])
    assert "reward.max_failure_frac: 1.5 must be in [0.0, 1.0]" in error_of(["reward.max_failure_frac=1.5"])


def test_truncated_sampling_refused_unless_accepted():
    for override in ("rollout.top_p=0.9", "rollout.top_k=20"):
        msg = error_of([override])
        assert "off-policy" in msg and "rollout.allow_truncated_sampling=true" in msg
    cfg = load_config(None, ["rollout.top_p=0.9", "rollout.top_k=20", "rollout.allow_truncated_sampling=true"])
    assert (cfg.rollout.top_p, cfg.rollout.top_k) == (0.9, 20)
    # greedy training samples would be identical within a group, and log_softmax(logits / 0) is undefined
    assert "rollout.temperature: 0.0 must be > 0.0" in error_of(["rollout.temperature=0"])


def test_wrong_type_names_field_value_and_source():
    msg = error_of(["parallel.tp=two"])
    assert "parallel.tp: 'two' is not an integer" in msg and "parallel.tp=two" in msg


def test_malformed_override():
    assert "expected key.sub=value" in error_of(["algo.loss"])


def test_all_problems_reported_at_once():
    msg = error_of(["algo.loss=nope", "rollout.temperature=-1"])
    assert "2 config errors" in msg and "algo.loss" in msg and "rollout.temperature" in msg


# -- errors: unknown keys ------------------------------------------------------

def test_unknown_override_key_suggests_and_lists_valid_keys():
    msg = error_of(["algo.los=sapo"])
    assert "algo.los: unknown key" in msg
    assert "did you mean 'algo.loss'" in msg
    assert "valid keys of algo: loss, eps_low, eps_high" in msg


def test_unknown_yaml_key_names_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("rollout:\n  n_sample: 4\n")
    msg = error_of([], path)
    assert "rollout.n_sample: unknown key" in msg and str(path) in msg
    assert "did you mean 'rollout.n_samples'" in msg


def test_unknown_section():
    msg = error_of(["optim.lr=1"])
    assert "optim: unknown key" in msg and "valid keys of the top level: model, parallel" in msg


def test_section_given_a_scalar():
    assert "algo: 3 must be a mapping" in error_of(["algo=3"])


# -- errors: cross-field rules -------------------------------------------------

def test_tp_must_divide_heads():
    msg = error_of(["parallel.tp=3"])
    assert "parallel.tp: 3 must divide model.tiny.num_attention_heads=4" in msg


def test_ep_must_divide_experts():
    assert "parallel.ep: 3 must divide model.tiny.num_experts=4" in error_of(["parallel.ep=3"])


def test_pipeline_rules():
    assert "parallel.vpp: 2 needs parallel.pp > 1" in error_of(["parallel.vpp=2"])
    msg = error_of(["parallel.pp=2", "parallel.vpp=4"])
    assert "parallel.vpp: pp*vpp=2*4=8 must divide model.tiny.num_hidden_layers=4" in msg
    load_config(None, ["parallel.pp=2", "parallel.vpp=2"])  # 4 layers: PP2 x VPP2 is fine


def test_tp_needs_sequence_parallel():
    assert "parallel.sp: false is not allowed with parallel.tp=2" in error_of(["parallel.tp=2", "parallel.sp=false"])


def test_hf_config_json_is_checked_when_present(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "num_hidden_layers": 48}))
    load_config(None, [f"model.hf_path={tmp_path}", "parallel.tp=4", "parallel.ep=8"])
    msg = error_of([f"model.hf_path={tmp_path}", "parallel.tp=8"])
    assert "parallel.tp: 8 must divide num_key_value_heads=4" in msg


def test_r3_needs_routed_experts():
    msg = error_of(["algo.replay=r3", "rollout.return_routed_experts=false"])
    assert "algo.replay: 'r3'" in msg and "rollout.return_routed_experts=true" in msg


def test_nccl_runs_on_every_engine():
    # moe-rl serve joins the weight update group over gloo: the CPU rehearsal of SGLang's NCCL path
    assert load_config(None, ["rollout.weight_sync=nccl"]).rollout.weight_sync == "nccl"
    assert load_config(None, ["rollout.weight_sync=nccl", "rollout.engine=sglang",
                              "rollout.weight_sync_port=29600"]).rollout.weight_sync_port == 29600


def test_colocated_refuses_nccl_and_overlap():
    msg = error_of(["rollout.colocated=true", "rollout.engine=sglang", "rollout.weight_sync=nccl"])
    assert "rollout.weight_sync: 'nccl' is not allowed with rollout.colocated=true" in msg
    assert "NCCL refuses two ranks on one GPU" in msg and "use rollout.weight_sync=disk" in msg
    msg = error_of(["rollout.colocated=true", "algo.off_policy_overlap=true"])
    assert "algo.off_policy_overlap=true" in msg
    # colocated with moe-rl serve is the CPU rehearsal of the release/resume protocol
    assert load_config(None, ["rollout.colocated=true"]).rollout.colocated


def test_rollout_engine_rules():
    assert "rollout.weight_sync: 'tensor' copies into an engine in the trainer's own process" in error_of(
        ["rollout.weight_sync=tensor"])
    assert "rollout.ep_size: 4 must divide the servers' tensor-parallel size 2" in error_of(
        ["rollout.tp_size=2", "rollout.ep_size=4"])
    assert "rollout.router: true starts a router" in error_of(
        ["rollout.router=true", "rollout.urls=[http://h:1]"])


def test_router_fusion_refused_with_replay():
    assert "model.moe_router_fusion" in error_of(["model.moe_router_fusion=true"])
    load_config(None, ["model.moe_router_fusion=true", "algo.replay=off", "drift.enabled=false"])


def test_bare_off_in_yaml_means_the_string(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  replay: off\n")  # YAML 1.1 parses bare off as false
    assert load_config(path).algo.replay == "off"


def test_minibatches_must_split_the_step():
    msg = error_of(["algo.num_minibatches=5"])
    assert "algo.num_minibatches: 5 must divide" in msg and "=64" in msg


def test_token_budget_must_hold_the_longest_sequence():
    with pytest.raises(ConfigError, match=r"parallel.max_tokens_per_microbatch: 100 cannot hold .* = 1088"):
        load_config(None, ["parallel.max_tokens_per_microbatch=100", "data.max_prompt_len=1024",
                           "rollout.max_new_tokens=64"])
    cfg = load_config(None, ["parallel.max_tokens_per_microbatch=1088", "data.max_prompt_len=1024",
                             "rollout.max_new_tokens=64"])
    assert cfg.parallel.max_tokens_per_microbatch == 1088


def test_validate_after_programmatic_edit():
    cfg = load_config(None)
    cfg.algo.loss = "ppo"
    with pytest.raises(ConfigError, match="algo.loss: 'ppo' is not one of"):
        cfg.validate()
    cfg.algo.loss = "sapo"
    cfg.parallel.tp = "2"  # a string slipped in from code, not YAML
    with pytest.raises(ConfigError, match="parallel.tp: '2' is not an integer"):
        cfg.validate()


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# -- errors: files -------------------------------------------------------------

def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("algo:\n  loss: gspo\n  replay: [r2\nlog:\n  name: x\n")
    msg = error_of([], path)
    assert str(path) in msg and "line 4" in msg and "YAML syntax error" in msg


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = error_of([], path)
    assert "config file not found" in msg and str(path) in msg


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert "top level must be a mapping" in error_of([], path)


# -- round trip ----------------------------------------------------------------

@pytest.mark.parametrize("name", SHIPPED)
def test_to_yaml_round_trip(name, tmp_path):
    cfg = load_config(CONFIGS / name, ["algo.aggregation=token-mean", "algo.replay=off",
                                              "rollout.urls=[http://h:1]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_to_dict_from_dict_round_trip():
    cfg = load_config(CONFIGS / "tiny_cpu.yaml")
    d = cfg.to_dict()
    assert d["parallel"]["ep"] == 2 and d["model"]["tiny"]["num_experts"] == 4
    assert RunConfig.from_dict(d) == cfg


# -- DPO (train.mode=dpo) ----------------------------------------------------

@pytest.mark.parametrize("name", ["tiny_cpu_dpo.yaml", "qwen3_30b_a3b_dpo.yaml"])
def test_dpo_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.train.mode == "dpo" and cfg.data.train and cfg.dpo.pairs_per_step > 0


def test_dpo_mistakes_name_the_field():
    dpo = ["train.mode=dpo", "data.train=toy:pref-add-easy", "data.eval=toy:pref-add-easy-eval",
           "parallel.max_tokens_per_microbatch=null", "dpo.max_len=64"]
    assert "data.train: 'toy:add-easy' is a prompt task" in error_of(["train.mode=dpo", "data.eval=null"])
    assert "toy:pref-add-easy" in error_of(["train.mode=dpo", "data.eval=null"])
    assert "parallel.micro_batch_size: 3 must be even" in error_of(dpo + ["parallel.micro_batch_size=3"])
    assert "dpo.label_smoothing: 0.1 applies to dpo.loss=sigmoid" in error_of(
        dpo + ["dpo.loss=ipo", "dpo.label_smoothing=0.1"])
    assert "dpo.pairs_per_step: 7 must be a multiple of the data-parallel size 2" in error_of(
        dpo + ["train.world_size=2", "dpo.pairs_per_step=7"])
    assert "parallel.max_tokens_per_microbatch: 100 cannot hold the longest pair, 2 * dpo.max_len = 128" in error_of(
        dpo + ["parallel.max_tokens_per_microbatch=100"])
    assert "train.mode: 'ppo' is not one of rl, dpo" in error_of(["train.mode=ppo"])
    load_config(None, dpo + ["parallel.micro_batch_size=4"])  # a sound DPO config passes
@pytest.mark.parametrize("overrides,mode", [
    (["algo.num_minibatches=1"], "r2"),
    (["algo.num_minibatches=2"], "r2"),
    (["algo.num_minibatches=2", "algo.off_policy_overlap=true"], "r3"),
    (["algo.num_minibatches=4"], "r3"),
])
def test_replay_auto_picks_r2_near_on_policy_and_r3_beyond(overrides, mode):
    from moe_rl.config import replay_mode

    cfg = load_config(None, ["algo.replay=auto", *overrides])
    assert replay_mode(cfg.algo) == mode
    assert replay_mode(load_config(None, ["algo.replay=r2", *overrides]).algo) == "r2"  # explicit modes stay


def test_replay_auto_that_needs_engine_routes_says_so():
    msg = error_of(["algo.replay=auto", "algo.num_minibatches=4", "rollout.return_routed_experts=false"])
    assert "algo.replay: 'auto' chooses 'r3'" in msg and "rollout.return_routed_experts=true" in msg


def test_rollout_correction_bounds_need_a_mask_mode():
    assert "algo.rollout_correction.low/high" in error_of(["algo.rollout_correction.high=3"])
    cfg = load_config(None, ["algo.rollout_correction.mode=icepop", "algo.rollout_correction.high=3"])
    assert cfg.algo.rollout_correction.high == 3.0


def test_inprocess_engine_rules():
    cfg = load_config(None, ["rollout.engine=inprocess", "rollout.weight_sync=tensor"])
    assert (cfg.rollout.engine, cfg.rollout.weight_sync) == ("inprocess", "tensor")
    assert "or rollout.engine=inprocess" in error_of(["rollout.weight_sync=tensor"])
    assert "rollout.urls: set, but rollout.engine=inprocess" in error_of(
        ["rollout.engine=inprocess", "rollout.urls=[http://h:1]"])
    assert "rollout.weight_sync: 'nccl' broadcasts to server processes" in error_of(
        ["rollout.engine=inprocess", "rollout.weight_sync=nccl"])


@pytest.mark.parametrize("args, needle", [
    (["--dp-size", "2"], "--dp-size 2 is not allowed with rollout.weight_sync=nccl"),
    (["--data-parallel-size=2"], "SGLang refuses distributed weight updates to data-parallel replicas"),
    (["--pp-size", "2"], "--pp-size 2 is not allowed with rollout.weight_sync=nccl"),
    (["--tp-size", "two"], "--tp-size needs an integer >= 1, got 'two'"),
])
def test_sglang_parallel_sizes_that_break_the_update_group_are_refused(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.engine=sglang", "rollout.weight_sync=nccl", f"rollout.sglang_args={args}"])
    assert needle in str(e.value)


def test_sglang_data_parallel_is_fine_with_disk_weights():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang_args=[--dp-size,2,--tp-size,2]",
                             "rollout.ep_size=2"])
    assert cfg.rollout.server_tp_size == 2
    with pytest.raises(ConfigError, match="must divide the servers' tensor-parallel size 2"):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang_args=[--tp-size,2]", "rollout.ep_size=4",
                           "rollout.tp_size=4"])


def test_the_handoff_timeout_covers_rank0s_whole_rollout_budget():
    from moe_rl.config import HANDOFF_MARGIN_S, handoff_budget_s, handoff_timeout_s

    cfg = load_config(None, ["rollout.timeout_s=1800", "rollout.retries=3"])  # the flagship's rollout settings
    # 4 attempts, each up to 1800 s to find a healthy server and 1800 s for the answer, and a weight load
    assert handoff_budget_s(cfg) == 4 * 2 * 1800 + 1800
    assert handoff_timeout_s(cfg) == handoff_budget_s(cfg) + HANDOFF_MARGIN_S > cfg.train.collective_timeout_s
    overlap = load_config(None, ["rollout.timeout_s=1800", "rollout.retries=3", "algo.off_policy_overlap=true"])
    assert handoff_budget_s(overlap) == 2 * handoff_budget_s(cfg)  # the prefetch, then a refill round
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.timeout_s=1800", "rollout.retries=3", "train.handoff_timeout_s=3600"])
    assert "train.handoff_timeout_s: 3600 s is shorter than rank 0's rollout budget of 16200 s" in str(e.value)
    assert handoff_timeout_s(load_config(None, ["train.handoff_timeout_s=20000", "rollout.timeout_s=1800"])) == 20000


def test_an_in_place_push_needs_requests_in_flight():
    from moe_rl.recipes.build import inflight_client_args
    from moe_rl.rollout.weight_sync import make_weight_sync

    # in place, SGLang refuses a flush under paused requests; retracted requests hold no cache: the
    # flush after the load succeeds, and is asked for
    for mode, k, flush in (("in_place", 3, False), ("retract", 2, True)):
        assert f"rollout.inflight_update: '{mode}' needs algo.max_staleness >= 1" in error_of(
            [f"rollout.inflight_update={mode}"])
        cfg = load_config(None, [f"rollout.inflight_update={mode}", f"algo.max_staleness={k}"])
        assert inflight_client_args(cfg) == {"flush_on_update": flush, "pushes_in_place": not flush, "version_lag": k}
        nccl = dataclasses.replace(cfg.rollout, weight_sync="nccl", engine="sglang")
        sync = make_weight_sync(nccl, admin_urls=["http://127.0.0.1:1"], master_address="127.0.0.1", master_port=1)
        assert sync.flush_cache is flush
    # auto, the default: wait when synchronous, retract when asynchronous
    from moe_rl.rollout.config import pause_mode

    assert pause_mode(load_config(None).rollout, 0) is None
    assert pause_mode(load_config(None, ["algo.max_staleness=1"]).rollout, 1) == "retract"
    assert pause_mode(load_config(None, ["rollout.inflight_update=in_place", "algo.max_staleness=1"]).rollout, 1) \
        == "in_place"
    assert inflight_client_args(load_config(None, ["algo.max_staleness=2"])) == {"flush_on_update": True,
                                                                                "pushes_in_place": False,
                                                                                "version_lag": 2}


def test_off_policy_overlap_is_the_deprecated_name_of_max_staleness_1(caplog):
    from moe_rl.algo.config import staleness_bound
    from moe_rl.config import handoff_budget_s

    with caplog.at_level("WARNING", logger="moe_rl"):
        old = load_config(None, ["algo.off_policy_overlap=true"])
    assert "algo.off_policy_overlap is deprecated: it means algo.max_staleness=1" in caplog.text
    new = load_config(None, ["algo.max_staleness=1"])
    assert staleness_bound(old.algo) == staleness_bound(new.algo) == 1
    assert handoff_budget_s(old) == handoff_budget_s(new) == 2 * handoff_budget_s(load_config(None))
    assert handoff_budget_s(load_config(None, ["algo.max_staleness=3"])) == 4 * handoff_budget_s(load_config(None))


def test_asynchronous_runs_weigh_stale_samples_by_default_and_the_loss_gets_it(caplog):
    """algo.stale_tis_cap (2) when algo.max_staleness >= 1, pi_old is recomputed and no correction is set;
    never on-policy unless asked; null turns it off (and warns); an explicit cap or a mode wins."""
    from moe_rl.algo.config import tis_cap_of
    from moe_rl.recipes.rl.step import loss_params

    on_policy, stale = load_config(None), load_config(None, ["algo.max_staleness=2"])
    assert tis_cap_of(on_policy.algo) is None and "tis_cap" not in loss_params(on_policy.algo)
    assert tis_cap_of(stale.algo) == 2.0 and loss_params(stale.algo)["tis_cap"] == 2.0
    assert tis_cap_of(load_config(None, ["algo.max_staleness=1", "algo.tis_cap=5"]).algo) == 5.0
    masked = load_config(None, ["algo.max_staleness=1", "algo.rollout_correction.mode=token_mask"]).algo
    assert tis_cap_of(masked) is None and loss_params(masked)["correction"] == "token_mask"
    assert tis_cap_of(load_config(None, ["algo.max_staleness=1", "algo.behaviour=engine"]).algo) is None
    with caplog.at_level("WARNING", logger="moe_rl"):
        off = load_config(None, ["algo.max_staleness=2", "algo.stale_tis_cap=null"])
    assert tis_cap_of(off.algo) is None and "no importance weight for them" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="moe_rl"):
        load_config(None, ["algo.max_staleness=2"])
    assert "no importance weight" not in caplog.text


def test_named_run_dir_is_read_from_the_layers_of_a_config_that_does_not_load(tmp_path):
    from moe_rl.config import named_run_dir

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("log:\n  run_dir: runs/from-yaml\nalgo:\n  loss: gspox\n")
    assert named_run_dir(yaml_file) == "runs/from-yaml"
    assert named_run_dir(yaml_file, ["log.run_dir=runs/override", "train.stepz=3"]) == "runs/override"  # last wins
    assert named_run_dir(yaml_file, ["not-an-override", "log=5"]) == "runs/from-yaml"  # broken layers name nothing
    assert named_run_dir(tmp_path / "missing.yaml", ["train.steps=3"]) is None
    broken = tmp_path / "broken.yaml"
    broken.write_text("log: [unclosed\n")
    assert named_run_dir(broken, ["log.run_dir=r"]) == "r"


def test_auto_staleness_needs_a_largest_k():
    cfg = "launch/configs/tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=r"algo.auto_staleness: lowers K from algo.max_staleness, which is 0"):
        load_config(cfg, ["algo.auto_staleness=true"])
    assert load_config(cfg, ["algo.auto_staleness=true", "algo.max_staleness=2"]).algo.auto_staleness


def test_each_objective_reads_the_keys_its_function_declares_and_a_key_it_ignores_is_refused():
    """The algo keys an objective reads are its registered function's keyword hyperparameters
    (`loss_reads`): set for an objective that ignores it (a dual clip on CISPO, a clip range on SAPO),
    a key is a config error naming it and what the objective reads."""
    from moe_rl.algo.config import loss_reads
    from moe_rl.recipes.rl.step import loss_params

    cfg = "launch/configs/tiny_cpu.yaml"
    assert loss_reads("sapo") == ("tau_pos", "tau_neg") and loss_reads("cispo") == ("eps_low", "eps_high")
    assert set(loss_reads("gspo")) == {"eps_low", "eps_high", "dual_clip"}
    with pytest.raises(ConfigError, match=r"algo.dual_clip: the cispo objective does not read it \(it reads eps_low, "
                                          r"eps_high\)"):
        load_config(cfg, ["algo.loss=cispo", "algo.dual_clip=3"])
    with pytest.raises(ConfigError, match=r"algo.eps_high: the sapo objective does not read it"):
        load_config(cfg, ["algo.loss=sapo", "algo.eps_high=0.3"])
    with pytest.raises(ConfigError, match=r"algo.tau_neg: the grpo objective does not read it"):
        load_config(cfg, ["algo.loss=grpo", "algo.tau_neg=2"])
    a = load_config(cfg, ["algo.loss=gspo", "algo.dual_clip=3", "algo.eps_low=0.001"]).algo
    assert {k: v for k, v in loss_params(a).items() if k in ("eps_low", "eps_high", "dual_clip")} == \
        {"eps_low": 0.001, "dual_clip": 3}  # eps_high unset: the objective's own default
    assert {k: loss_params(load_config(cfg, ["algo.loss=sapo"]).algo)[k] for k in ("tau_pos", "tau_neg")} == \
        {"tau_pos": 1.0, "tau_neg": 1.05}


def test_the_advantage_estimator_is_the_registrys_and_reads_the_keys_its_function_declares():
    """`algo.advantage` names an estimator of moe_rl/algo/advantages.py: a group one (from rewards) or a critic
    one (gae: the run builds a critic); a group estimator reads the `algo.adv_<name>` fields of its keyword
    hyperparameters, and one set for an estimator that ignores it is a config error."""
    from moe_rl.algo.advantages import ADVANTAGE_ESTIMATORS, CRITIC_ESTIMATORS, ESTIMATORS
    from moe_rl.algo.config import advantage_params, uses_critic

    cfg = "launch/configs/tiny_cpu.yaml"
    assert set(ESTIMATORS) == set(ADVANTAGE_ESTIMATORS) | set(CRITIC_ESTIMATORS) and "gae" in CRITIC_ESTIMATORS
    grpo = load_config(cfg, ["algo.advantage=grpo", "algo.adv_eps=0.01"]).algo
    assert advantage_params(grpo) == {"eps": 0.01} and not uses_critic(grpo)
    assert advantage_params(load_config(cfg, ["algo.advantage=rloo"]).algo) == {}
    assert uses_critic(load_config(cfg, ["algo.advantage=gae"]).algo)
    with pytest.raises(ConfigError, match=r"algo.adv_eps: the rloo advantage estimator does not read it"):
        load_config(cfg, ["algo.advantage=rloo", "algo.adv_eps=0.1"])
    with pytest.raises(ConfigError, match=r"algo.advantage: .*'ppo'"):
        load_config(cfg, ["algo.advantage=ppo"])


@pytest.mark.parametrize("overrides, urls, hosts, heads", [
    (["rollout.intake=auto"], ["http://127.0.0.1:30000"], ["node0", "node0"], True),  # servers here, one host
    (["rollout.intake=auto"], ["http://127.0.0.1:30000"], ["node0", "node1"], False),  # loopback, 2 hosts
    (["rollout.intake=auto"], ["http://10.0.0.5:30000"], ["node0", "node1"], True),  # reachable servers
    (["rollout.intake=auto", "rollout.engine=inprocess"], [], ["node0"], False),  # no servers
    (["rollout.intake=auto", "rollout.colocated=true", "rollout.weight_sync=disk"], ["http://127.0.0.1:1"], ["n0"], False),
    ([], ["http://10.0.0.5:30000"], ["node0"], True),  # the default: auto
    ([], ["http://127.0.0.1:30000"], ["node0", "node1"], False),
    (["rollout.intake=rank0"], ["http://10.0.0.5:30000"], ["node0", "node1"], False),
])
def test_intake_auto_picks_heads_where_every_head_reaches_the_servers(overrides, urls, hosts, heads):
    from moe_rl.rollout.config import intake_on_heads

    assert intake_on_heads(load_config(None, overrides).rollout, urls, hosts) is heads


def test_intake_heads_where_a_head_cannot_reach_the_servers_names_the_fix():
    from moe_rl.rollout.config import intake_on_heads

    with pytest.raises(ConfigError, match="rollout.intake: 'heads' .* loopback .* spans 2 hosts: set rollout.host"):
        intake_on_heads(load_config(None, ["rollout.intake=heads"]).rollout, ["http://127.0.0.1:1"], ["a", "b"])
    for bad, needle in ((["rollout.engine=inprocess"], "an in-process engine"),
                        (["rollout.colocated=true", "rollout.weight_sync=disk"], "colocated")):
        with pytest.raises(ConfigError, match=f"rollout.intake: 'heads' needs rollout servers .*{needle}"):
            load_config(None, ["rollout.intake=heads", *bad])


@pytest.mark.parametrize("overrides,needle", [
    (["model.lora.rank=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,lm_head]"], r"\['lm_head'\] are not"),
    (["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"], "target all three or none"),
    (["model.lora.rank=8", "model.lora.target_modules=[gate_proj,down_proj]"], "gate_up_proj\\): target both"),
    (["model.lora.rank=8", "model.lora.dropout=0.1"], "model.lora.dropout: 0.1 .* set model.lora.dropout=0"),
    (["model.lora.rank=8", "parallel.etp=2"], "need parallel.etp=1 \\(got 2\\)"),
    (["model.lora.rank=-1"], "model.lora.rank"),
])
def test_lora_settings_a_model_cannot_take_name_the_field_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_lora_off_by_default_and_attention_only_takes_dropout():
    from moe_rl.policy.lora import LoraSpec

    assert LoraSpec.of(load_config(None, []).model) is None
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.dropout=0.1",
                             "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"])
    spec = LoraSpec.of(cfg.model)
    assert (spec.rank, spec.scale, spec.dropout, spec.target_modules) == (4, 4.0, 0.1, ("q_proj", "k_proj", "v_proj", "o_proj"))
