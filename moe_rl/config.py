"""Run configuration: one `RunConfig` tree of dataclass sections, validated once.

A run's settings are built in layers, each later layer winning:

    dataclass defaults  ->  YAML file  ->  `key.sub=value` overrides  ->  validate()

    cfg = load_config("launch/configs/tiny_cpu.yaml", ["algo.loss=sapo", "parallel.tp=2"])

Every mistake fails here, before any process group, model or server starts,
with a `ConfigError` whose message names the dotted field, the value given and
what is allowed. Unknown keys are refused (with a "did you mean"), so a typo
can never silently leave a default in place.

Conventions for the sections below:
- Each field is followed by a docstring: what it means, and why the default.
- Fields with a fixed set of values are `str` fields declared with `choice(...)`;
  the allowed values live in that one call and appear in error messages.
  (omegaconf cannot type a field as `Literal`, and a plain string reads better
  in YAML and in errors than an Enum.)
- Numeric ranges are declared with `ranged(...)` next to the field; rules that
  relate several fields live in the small `_check_<section>` functions.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

__all__ = [
    "AlgoConfig", "ConfigError", "CriticConfig", "DPOConfig", "DataConfig", "DriftConfig", "LogConfig",
    "ModelConfig",
    "ParallelConfig", "RewardConfig", "RolloutConfig", "RunConfig", "TinyModel", "TrainConfig",
    "load_config",
]


class ConfigError(ValueError):
    """An invalid config file, key or value. `problems` holds one line per mistake."""

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:  # report every mistake at once, so one run fixes them all
            message = f"{len(self.problems)} config errors:\n" + "\n".join(
                f"  - {p}" for p in self.problems)
        super().__init__(message)


# --------------------------------------------------------------------------
# Field declarations: allowed values and ranges live next to each field.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Range:
    """Closed (ge/le) or open (gt/lt) bounds on a number; None means unbounded."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, x: float) -> bool:
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def __str__(self) -> str:
        lo = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        hi = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f">= {self.ge}" if self.ge is not None else f"> {self.gt}"
        return f"<= {self.le}" if self.le is not None else f"< {self.lt}"


def choice(default: str | None, options: tuple[str, ...]) -> Any:
    """A string field that must be one of `options` (None allowed only if it is the default)."""
    return field(default=default, metadata={"choices": options})


def ranged(default: float | None, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None) -> Any:
    """A numeric field that must lie in the given bounds (None passes when the type allows it)."""
    return field(default=default, metadata={"range": _Range(ge, gt, le, lt)})


DTYPES = ("fp32", "bf16", "fp16")
ENGINES = ("local", "sglang", "inprocess")
WEIGHT_SYNCS = ("disk", "tensor", "nccl")
LOSSES = ("grpo", "dapo", "gspo", "gspo_token", "sapo", "cispo", "gmpo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ADVANTAGES = ("grpo", "drgrpo", "rloo", "gae")
KL_ESTIMATORS = ("k1", "k2", "k3")
TIS_LEVELS = ("token", "sequence")
CORRECTION_MODES = ("tis", "token_mask", "icepop", "seq_mask")
REPLAYS = ("off", "r2", "r3", "auto")
CRITIC_REPLAYS = ("off", "r2")
LR_SCHEDULES = ("constant", "cosine", "linear")
LOG_LEVELS = ("debug", "info", "warning")
MODES = ("rl", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")
DATA_SUFFIXES = (".jsonl", ".parquet")
# SGLang 0.5.23's names of its parallel sizes (sglang/srt/arg_groups/fields/parallel.py; argparse
# also takes an unambiguous prefix such as --tp).
SGLANG_TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
SGLANG_DP_FLAGS = ("--dp-size", "--data-parallel-size", "--dp")
SGLANG_PP_FLAGS = ("--pp-size", "--pipeline-parallel-size", "--pp")


def sglang_flag(args: Sequence[Any], flags: Sequence[str]) -> str | None:
    """The value the last of `flags` gets in `args` (`--flag N` or `--flag=N`), as SGLang's parser
    reads it; None when none of them is there."""
    args = [str(a) for a in args]
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in flags:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return found


# --------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------

@dataclass
class TinyModel:
    """Shape of the fresh random Qwen3-MoE built when `model.hf_path` is None.

    Names match `moe_rl.policy.tiny.TinyMoEConfig` (init_std aside: an argument of
    `make_tiny_qwen3_moe`). The defaults divide every layout the tests use: TP2 (4 heads,
    2 KV heads), PP2 x VPP2 (4 layers), EP2 (4 experts).
    """

    vocab_size: int = ranged(128, ge=1)
    """Token vocabulary; the toy tasks need 16 (see moe_rl/data/toy.py)."""
    hidden_size: int = ranged(64, ge=1)
    """Residual width; small so a CPU step takes well under a second."""
    moe_intermediate_size: int = ranged(32, ge=1)
    """Hidden width of each expert's MLP."""
    intermediate_size: int = ranged(128, ge=1)
    """Hidden width of a dense MLP (only used by dense layers, if any)."""
    num_hidden_layers: int = ranged(4, ge=1)
    """Transformer layers; 4 allows PP2 with VPP2."""
    num_attention_heads: int = ranged(4, ge=1)
    """Query heads; 4 allows TP2."""
    num_key_value_heads: int = ranged(2, ge=1)
    """KV heads (GQA groups); 2 allows TP2 and keeps GQA in the tested path."""
    head_dim: int = ranged(16, ge=1)
    """Per-head width (Qwen3 sets it explicitly rather than hidden/heads)."""
    num_experts: int = ranged(4, ge=1)
    """Routed experts per MoE layer; 4 allows EP2 and EP4."""
    num_experts_per_tok: int = ranged(2, ge=1)
    """Top-k experts per token; 2 so routes can partly change between updates."""
    init_std: float = ranged(0.02, gt=0.0)
    """Std of the random initial weights (HF's default): a near-uniform first policy that explores."""


@dataclass
class ModelConfig:
    """Which policy to train and how its weights are held."""

    hf_path: str | None = None
    """HF checkpoint directory. None builds a fresh tiny model from `tiny` (CPU demo and tests)."""
    tiny: TinyModel = field(default_factory=TinyModel)
    """Shape of the fresh model when `hf_path` is None; ignored otherwise."""
    dtype: str = choice("fp32", DTYPES)
    """Parameter/compute dtype. fp32 because the CPU path is the default; GPU configs set bf16."""
    recompute: bool = False
    """Activation recomputation: trades ~30% more compute for memory; needed for long sequences."""
    moe_router_fusion: bool = False
    """Fused router kernel (transformer-engine >= 2.7). Off because megatron silently skips routing
    replay when it is on: allowed only with algo.replay=off."""
    moe_permute_fusion: bool | None = None
    """Fused MoE token permutation (transformer-engine >= 2.1). None = on with a GPU and TE, off on CPU
    (moe_rl/policy/perf.py says what each fusion needs)."""
    apply_rope_fusion: bool | None = None
    """Fused rotary embedding (transformer-engine >= 1.4). None = on with a GPU and TE, off on CPU."""
    bias_activation_fusion: bool | None = None
    """megatron's fused SwiGLU. None = on with a GPU, off on CPU."""
    bias_dropout_fusion: bool | None = None
    """megatron's fused bias-dropout-add. None = on with a GPU, off on CPU."""
    gradient_accumulation_fusion: bool | None = None
    """Weight-gradient GEMMs accumulate straight into the fp32 gradient buffers (NVIDIA apex's
    fused_weight_gradient_mlp_cuda, which the docker image builds). None = on with a GPU and apex."""
    moe_aux_loss_coef: float | None = ranged(None, ge=0.0)
    """Weight of the routers' load-balancing loss; null = the checkpoint's `router_aux_loss_coef`
    (0 when it has none), 0 = off. HF trainers (TRL's GRPOTrainer) take the same default."""
    seed: int = 1234
    """Seed for model init and megatron's RNG tracker (data order has its own seed)."""


@dataclass
class ParallelConfig:
    """Trainer parallel layout. Checks against the world size live in `policy/parallel.py`."""

    tp: int = ranged(1, ge=1)
    """Tensor parallel size; must divide attention heads and KV heads."""
    pp: int = ranged(1, ge=1)
    """Pipeline parallel stages; pp * vpp must divide the layer count."""
    vpp: int | None = ranged(None, ge=1)
    """Virtual pipeline chunks per stage (interleaved 1F1B); None = not interleaved. Needs pp > 1."""
    ep: int = ranged(1, ge=1)
    """Expert parallel size; must divide the number of experts."""
    etp: int = ranged(1, ge=1)
    """Tensor parallel size inside experts; 1 because EP scales MoE better than splitting experts."""
    sp: bool | None = None
    """Sequence parallel; None = auto (on when tp > 1, which megatron MoE requires)."""
    micro_batch_size: int = ranged(4, ge=1)
    """Sequences per forward/backward micro-batch; tiny models fit 4, long-context runs use 1."""
    overlap_grad_reduce: bool | None = None
    """Reduce gradients bucket by bucket during the backward pass (megatron DDP). None = on with a
    GPU, off on CPU."""
    overlap_param_gather: bool | None = None
    """With train.distributed_optimizer: gather the updated parameters during the next forward instead
    of at the end of the optimizer step. None = on with a GPU and the distributed optimizer."""
    max_tokens_per_microbatch: int | None = ranged(None, ge=2)
    """Token budget per micro-batch. Set: sequences are packed several to a row (no padding
    compute) and spread over data-parallel ranks by tokens rather than by count; null = padded
    micro-batches of micro_batch_size sequences. Must hold the longest sequence
    (data.max_prompt_len + rollout.max_new_tokens)."""

    @property
    def sequence_parallel(self) -> bool:
        """`sp` with the auto rule applied."""
        return self.tp > 1 if self.sp is None else self.sp


@dataclass
class RolloutConfig:
    """How responses are generated: engine, servers and sampling."""

    engine: str = choice("local", ENGINES)
    """local = HF-transformers engine (CPU, speaks SGLang's HTTP API); sglang = real SGLang servers;
    inprocess = the HF-transformers engine inside trainer rank 0 (no server, no HTTP; small CPU runs)."""
    urls: list[str] = field(default_factory=list)
    """Base URLs of servers that are already running; empty means launch `num_servers` ourselves."""
    colocated: bool = False
    """SGLang shares the trainer's GPUs: it releases its memory after each rollout and takes
    it back before the next rollout or weight update (servers need --enable-memory-saver).
    With engine=local the `moe-rl serve` processes track the same released/resumed state
    (the CPU rehearsal of the protocol)."""
    admin_urls: list[str] = field(default_factory=list)
    """With `urls` pointing at an sglang-router: the workers behind it. They get the weight
    updates, and the generate requests that ask for routed experts (the router drops them)."""
    num_servers: int = ranged(1, ge=1)
    """Servers to launch when `urls` is empty."""
    router: bool | None = None
    """sglang-router in front of the launched servers. None = auto (sglang engine with more
    than one server); true also puts it in front of `moe-rl serve` workers (the CPU rehearsal)."""
    n_samples: int = ranged(8, ge=2)
    """Responses per prompt (G); group advantages need at least 2. 8 as in the GSPO/DAPO setups."""
    temperature: float = ranged(1.0, gt=0.0)
    """Sampling temperature T. The trainer trains the distribution sampled from: every
    log-prob (engine, old pass, updates, drift) is log_softmax(logits / T). 1.0 = the model's own."""
    top_p: float = ranged(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; 1.0 (off). < 1 needs `allow_truncated_sampling` (see there)."""
    top_k: int = -1
    """Top-k sampling; -1 (off). >= 1 needs `allow_truncated_sampling` (see there)."""
    allow_truncated_sampling: bool = False
    """Accept top_p < 1 or top_k >= 1. The engine then samples from a truncated distribution
    whose log-probs neither it (SGLang returns them before truncation) nor the trainer
    reproduce, so the update is silently off-policy; true says you accept that."""
    max_new_tokens: int = ranged(64, ge=1)
    """Response length cap; 64 fits the toy tasks."""
    concurrency: int = ranged(64, ge=1)
    """Requests in flight across all servers; bounds client memory and server queueing."""
    timeout_s: float = ranged(120.0, gt=0.0)
    """Per-request HTTP timeout in seconds."""
    retries: int = ranged(3, ge=0)
    """Retries per failed request before the step fails."""
    host: str = "127.0.0.1"
    """Interface launched servers bind to; loopback unless servers run on other nodes."""
    base_port: int | None = ranged(None, ge=1, le=65535)
    """Port of the first launched server; server i uses base_port + i. None = consecutive ports
    found free at launch (two runs on one machine never collide); SLURM jobs use 30000."""
    sglang_args: list[str] = field(default_factory=list)
    """Extra command-line arguments passed to `sglang.launch_server` as given. A --tp-size here
    wins over `tp_size` (it comes last on SGLang's command line), and the weight sync and GPU
    placement follow it."""
    tp_size: int = ranged(1, ge=1)
    """--tp-size of each SGLang server (unless sglang_args gives one)."""
    ep_size: int = ranged(1, ge=1)
    """--ep-size of each SGLang server; must divide tp_size."""
    mem_fraction: float = ranged(0.8, gt=0.0, le=1.0)
    """Share of GPU memory SGLang may take for weights + KV cache (its --mem-fraction-static)."""
    weight_sync: str = choice("disk", WEIGHT_SYNCS)
    """How new weights reach the engine: disk (safetensors; works everywhere), tensor (same
    process), nccl (trainer rank 0 broadcasts to every server over a process group it forms with
    them: NCCL on GPUs, gloo to `moe-rl serve` on CPU)."""
    weight_sync_port: int | None = ranged(None, ge=1, le=65535)
    """nccl: port on trainer rank 0 (MASTER_ADDR) where the servers join the weight update group;
    None = a free port picked at start (set it when a firewall allows only fixed ports)."""
    return_routed_experts: bool = True
    """Ask the engine for its routed experts; needed for R3 and train-rollout mismatch metrics."""
    api_key_file: str | None = None
    """With `urls`: the servers' keys, a file of 'api-key: KEY' and 'admin-api-key: KEY' lines
    (mode 600; the file SGLang and `moe-rl serve` read with --config). Launched servers on a
    non-loopback `host` get fresh per-run keys instead; on loopback they stay keyless."""
    served_model_name: str | None = None
    """With `urls`: the --served-model-name the servers run under; a server reporting another
    name in /server_info is refused. None = not checked (launched servers always are)."""
    max_restarts: int = ranged(3, ge=0)
    """Launched servers: how often each one that dies is restarted (same port, same argv; not with
    weight_sync=nccl, where a new server cannot join the update group and would serve stale weights)."""

    @property
    def server_tp_size(self) -> int:
        """Each SGLang server's tensor-parallel size: the last --tp-size of `sglang_args`, else `tp_size`."""
        value = sglang_flag(self.sglang_args, SGLANG_TP_FLAGS)
        return self.tp_size if value is None else int(value)


@dataclass
class RolloutCorrectionConfig:
    """What to do with tokens whose trainer and rollout probabilities disagree (moe_rl/algo/correction.py)."""

    mode: str | None = choice(None, CORRECTION_MODES)
    """None = off; tis = truncated IS (cap: algo.tis_cap, 2 if unset); token_mask = drop tokens whose
    ratio pi_old / pi_rollout is outside [low, high] (MIS); icepop = token_mask with IcePop's [0.5, 5];
    seq_mask = drop whole sequences whose geometric-mean ratio is outside [low, high]. algo.tis_cap
    set together with a mask mode applies both."""
    low: float | None = ranged(None, ge=0.0, lt=1.0)
    """Lower bound on the ratio for the mask modes; None = the mode's default (0.5; seq_mask 0.99)."""
    high: float | None = ranged(None, gt=1.0)
    """Upper bound on the ratio for the mask modes; None = the mode's default (2; icepop 5; seq_mask 1.01)."""


@dataclass
class AlgoConfig:
    """The RL objective, advantages and rollout filters."""

    loss: str = choice("gspo", LOSSES)
    """Policy loss; GSPO because sequence-level ratios are stable on MoE models."""
    eps_low: float | None = ranged(None, ge=0.0, lt=1.0)
    """Lower clip range; None = the loss's paper default (GRPO/DAPO 0.2, GSPO 3e-4)."""
    eps_high: float | None = ranged(None, ge=0.0)
    """Upper clip range; None = the loss's paper default (GRPO 0.2, DAPO 0.28, GSPO 4e-4)."""
    tau_pos: float = ranged(1.0, gt=0.0)
    """SAPO temperature for positive advantages (paper value)."""
    tau_neg: float = ranged(1.05, gt=0.0)
    """SAPO temperature for negative advantages; slightly sharper, as in the paper."""
    dual_clip: float | None = ranged(None, gt=1.0)
    """Dual-clip constant c > 1 bounding the loss for negative advantages; None = off."""
    aggregation: str | None = choice(None, AGGREGATIONS)
    """How token losses become one number; None = the loss's default."""
    advantage: str = choice("grpo", ADVANTAGES)
    """Group advantage estimator: grpo (mean/std), drgrpo (mean only), rloo (leave-one-out); gae =
    per-token GAE from a learned critic (PPO / VC-PPO / VAPO; the `critic` section)."""
    adv_eps: float = ranged(1e-6, ge=0.0)
    """Added to the group std so equal-reward groups give 0, not NaN."""
    kl_coef: float = ranged(0.0, ge=0.0)
    """KL penalty to the reference policy; 0 (no reference model) as in DAPO and GSPO."""
    kl_estimator: str = choice("k3", KL_ESTIMATORS)
    """KL estimator when kl_coef > 0; k3 is unbiased and non-negative."""
    tis_cap: float | None = ranged(None, gt=0.0)
    """Truncated importance sampling cap for the rollout/trainer mismatch; None = off."""
    tis_level: str = choice("token", TIS_LEVELS)
    """Whether the TIS weight is per token or one per sequence."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Masks (and TIS) for the trainer/rollout mismatch, composable with every loss."""
    num_minibatches: int = ranged(4, ge=1)
    """Optimizer updates per step (the step's samples split evenly); 4 as in GSPO."""
    shuffle_minibatches: bool = True
    """Split the step's samples into minibatches in a random order (seeded by data.shuffle_seed and
    the step, the same on every rank), so each update sees samples of every prompt, as
    PPO implementations do; false keeps the prompt order (each prompt's samples together)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose task rewards (before overlong shaping) are all
    equal, and sample further prompts until the step has data.prompts_per_step informative groups
    or dynamic_sampling_max_rounds rounds were generated; off so every step has a fixed size."""
    dynamic_sampling_max_rounds: int = ranged(3, ge=1)
    """Rollout rounds (each of data.prompts_per_step prompts) a step may generate to fill its groups
    with dynamic sampling; 1 = never refill (train on the informative groups of one round)."""
    overlong_max_len: int | None = ranged(None, ge=1)
    """DAPO overlong shaping L_max in tokens; None = off."""
    overlong_cache_len: int = ranged(0, ge=0)
    """DAPO L_cache: responses within this many tokens of L_max get a linear penalty."""
    replay: str = choice("r2", REPLAYS)
    """Routing replay: r2 replays the old policy's routes, r3 the rollout engine's; r2 needs no engine
    support. auto: r2 while a step's updates are mildly off-policy (at most 2 optimizer updates per
    rollout batch, counting off_policy_overlap's stale version as one), r3 beyond that, following the
    Qwen team's analysis of routing replay (R2 biases less when close to on-policy, R3 holds up far off it)."""
    off_policy_overlap: bool = False
    """Generate step t+1 while training step t (one step stale); off so steps are on-policy."""
    gamma: float = ranged(1.0, ge=0.0, le=1.0)
    """GAE discount (advantage=gae); 1.0: the reward comes once, at the end of the response."""
    lam: float | int | str = 0.95
    """GAE λ of the policy's advantages (advantage=gae): a number in [0, 1] (VC-PPO 0.95), or
    'adaptive' for VAPO's per-sequence λ = 1 - 1/(lam_alpha * response length)."""
    lam_alpha: float = ranged(0.05, gt=0.0)
    """α of the length-adaptive λ (VAPO's 0.05)."""
    whiten_advantages: bool = False
    """Normalise the GAE advantages to mean 0, std 1 over the step's response tokens (all DP ranks)."""
    ntp_coef: float = ranged(0.0, ge=0.0)
    """μ of VAPO's positive-example LM loss: μ * (mean NLL over the response tokens of samples with
    reward >= 1) is added to the policy loss; 0 = off, VAPO uses 0.1."""


@dataclass
class CriticConfig:
    """The value model of `algo.advantage=gae`: the policy's network with a value head."""

    hf_path: str | None = None
    """HF checkpoint whose trunk starts the critic; None = the policy's (its value head starts at 0)."""
    lr: float = ranged(1e-5, gt=0.0)
    """Critic learning rate (constant; Adam betas, weight decay and clipping as in `train`)."""
    lam: float = ranged(1.0, ge=0.0, le=1.0)
    """GAE λ of the value targets; VC-PPO's 1.0 (unbiased Monte-Carlo returns), decoupled from algo.lam."""
    updates_per_step: int = ranged(1, ge=1)
    """Passes of critic updates over the step's minibatches per policy update (K >= 1)."""
    value_clip: float | None = ranged(0.2, gt=0.0)
    """ε_v of the clipped value loss (values stay within old ± ε_v); null = unclipped."""
    warmup_steps: int = ranged(0, ge=0)
    """Value pretraining (VC-PPO): the first N RL steps update only the critic, on the initial
    policy's rollouts; 0 = none."""
    replay: str = choice("r2", CRITIC_REPLAYS)
    """Routing replay of the critic's own routes in its updates: r2 (recorded in its value pass) or
    off. R3 does not apply: the engine's routes are the policy's."""


@dataclass
class DataConfig:
    """Prompt datasets."""

    train: str = "toy:add-easy"
    """Training prompts: a .jsonl or .parquet file, or `toy:<task>` (built in, no download)."""
    eval: str | None = "toy:add-easy-eval"
    """Evaluation prompts in the same forms; None = no evaluation."""
    prompts_per_step: int = ranged(8, ge=1)
    """Prompts per RL step; each yields `rollout.n_samples` responses."""
    shuffle_seed: int = 0
    """Seed of the data order, separate from the model seed so either can change alone."""
    prompt_key: str = "prompt"
    """Record field holding the prompt."""
    answer_key: str = "answer"
    """Record field holding the reference answer passed to the reward."""
    max_prompt_len: int = ranged(256, ge=1)
    """Prompts longer than this many tokens are skipped, not truncated (truncation changes the task)."""


@dataclass
class RewardConfig:
    """How responses are scored."""

    name: str = "auto"
    """Registry name, or `module:function`; auto = the reward that matches the data (toy task or math)."""
    max_failure_frac: float = ranged(0.1, ge=0.0, le=1.0)
    """Share of samples whose reward may raise (scored 0) before the step fails."""


@dataclass
class TrainConfig:
    """Optimizer, schedule, checkpoints and run length."""

    steps: int = ranged(20, ge=1)
    """RL steps to run."""
    lr: float = ranged(1e-5, gt=0.0)
    """Peak learning rate."""
    min_lr: float = ranged(0.0, ge=0.0)
    """Final learning rate for cosine/linear decay."""
    warmup_steps: int = ranged(0, ge=0)
    """Linear warmup steps (counted in RL steps)."""
    lr_schedule: str = choice("constant", LR_SCHEDULES)
    """Shape after warmup; constant, as RL runs are usually stopped by eval, not by schedule."""
    weight_decay: float = ranged(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = ranged(0.9, ge=0.0, lt=1.0)
    """Adam first-moment decay."""
    adam_beta2: float = ranged(0.999, ge=0.0, lt=1.0)
    """Adam second-moment decay."""
    grad_clip: float = ranged(1.0, ge=0.0)
    """Global gradient-norm clip; 0 = off."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron ZeRO-1); needed for large models."""
    eval_every: int = ranged(0, ge=0)
    """Evaluate every N steps; 0 = never."""
    save_every: int = ranged(0, ge=0)
    """Checkpoint every N steps; 0 = only at the end."""
    keep_last: int = ranged(2, ge=1)
    """Checkpoints kept on disk; 2 so a crash during a save leaves a good one."""
    resume: str | None = None
    """None = fresh start; "auto" = latest checkpoint in the run dir if any; or a checkpoint path."""
    world_size: int = ranged(1, ge=1)
    """Trainer processes to start on this machine (single-machine runs; SLURM sets its own)."""
    collective_timeout_s: float = ranged(1800.0, gt=0.0)
    """Timeout of the default and megatron's process groups: a collective that waits longer fails (on
    GPUs NCCL's watchdog aborts the job). 1800 s as megatron's default; the waits for rank 0's rollouts
    have a timeout of their own (handoff_timeout_s)."""
    handoff_timeout_s: float | None = ranged(None, gt=0.0)
    """How long the other ranks wait for rank 0 in a hand-off (its rollout, starting servers, loading
    weights into them) before failing, on a gloo group of their own (moe_rl/collectives.py). None = the
    rollout budget plus 10 minutes (`handoff_budget_s`): a lost server then ends in rank 0's checkpoint
    and exit 3, never in a timeout of the waiting ranks. Set it only above that budget."""
    device_guard: bool = False
    """CPU only, for CI and debugging: fail when one of moe_rl's collectives gets a host tensor,
    which NCCL would refuse on a GPU (moe_rl.device_guard). The CPU rehearsal runs with it."""
    mode: str = choice("rl", MODES)
    """rl = RL steps on rollouts (`algo`, `rollout`, `reward`); dpo = DPO steps on preference pairs
    (`dpo`; data.train / data.eval name preference data; no rollout servers)."""


@dataclass
class DriftConfig:
    """Routing drift measurement (expert volatility, train-rollout mismatch)."""

    enabled: bool = True
    """Measure drift; on, since it is a cheap extra forward on a small probe set."""
    probe_size: int = ranged(16, ge=1)
    """Fixed probe sequences whose routes are compared before and after each update."""
    probe_every: int = ranged(1, ge=1)
    """Measure on the probe set every N steps."""
    step_tokens: bool = True
    """Also measure on the step's own training tokens (the volatility that replay removes)."""
    every: int = ranged(1, ge=1)
    """Measure step-token drift every N steps: each measurement costs one extra forward pass."""
    per_update: bool = False
    """Also measure probe-set volatility across each optimizer update (`drift/volatility_per_update`,
    the per-gradient-update figure of the GSPO paper); costs one probe forward per update."""


@dataclass
class DPOConfig:
    """Direct preference optimisation, used when train.mode=dpo (moe_rl/dpo.py)."""

    loss: str = choice("sigmoid", DPO_LOSSES)
    """sigmoid = DPO, −log σ(β·h) (conservative DPO with label_smoothing > 0); ipo = IPO's (h − 1/(2β))²."""
    beta: float = ranged(0.1, gt=0.0)
    """β: how far the policy may move from the reference (the implicit KL weight); 0.1 as in the DPO paper."""
    label_smoothing: float = ranged(0.0, ge=0.0, lt=0.5)
    """Conservative DPO's ε, the share of preference labels assumed flipped; 0 = plain DPO (sigmoid only)."""
    sft_coef: float = ranged(0.0, ge=0.0)
    """Weight of the chosen response's per-token NLL added to the loss; 0 = off."""
    ref_path: str | None = None
    """Reference model (a HF checkpoint of the policy's architecture); None = the initial policy.
    Its log-probs are computed once before training and cached in the run directory."""
    pairs_per_step: int = ranged(32, ge=1)
    """Preference pairs per optimizer step, over all data-parallel ranks (a multiple of their number)."""
    max_len: int = ranged(1024, ge=2)
    """Pairs whose prompt + longer response has more tokens are skipped, not truncated."""


@dataclass
class LogConfig:
    """Run directory, metric sinks and console output."""

    name: str = "run"
    """Run name; used in the run directory and W&B."""
    run_dir: str | None = None
    """Where metrics, config and checkpoints go; None = runs/<name>-<timestamp>."""
    tensorboard: bool = True
    """Write TensorBoard event files (local, no account needed)."""
    wandb: bool = False
    """Log to Weights & Biases; off because it needs network access and an account."""
    wandb_project: str = "moe_rl"
    """W&B project when `wandb` is on."""
    progress: bool = True
    """Live progress display on rank 0; turn off for batch logs without a terminal."""
    all_ranks: bool = False
    """Log from every rank instead of rank 0 only (debugging hangs)."""
    level: str = choice("info", LOG_LEVELS)
    """Console log level."""


@dataclass
class RunConfig:
    """The whole run: one section per concern. Build with `load_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)

    def validate(self) -> RunConfig:
        """Check every field and cross-field rule; raise one ConfigError listing all problems."""
        problems = _field_problems(self, "")
        if not problems:  # cross-field rules assume each field has the right type
            problems = [p for check in _CROSS_CHECKS for p in check(self)]
        if problems:
            raise ConfigError(problems)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of the config."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The full config as YAML (every field, defaults included), for the run directory."""
        return OmegaConf.to_yaml(OmegaConf.structured(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Build from a nested dict (e.g. `to_dict()` output) with the same checks as load_config."""
        return _build([(data, "in the given dict")])


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults, then the YAML file at `path` (if any), then `key.sub=value` overrides; validated."""
    layers: list[tuple[dict[str, Any], str]] = []
    if path is not None:
        layers.append((_read_yaml(Path(path)), f"in {path}"))
    for item in overrides:
        layers.append((_parse_override(item), f"in override {item!r}"))
    return _build(layers)


def _build(layers: list[tuple[dict[str, Any], str]]) -> RunConfig:
    """Merge layers onto the defaults, each checked for unknown keys first, and validate."""
    problems = [p for data, source in layers for p in _unknown_keys(data, RunConfig, "", source)]
    if problems:
        raise ConfigError(problems)
    merged = OmegaConf.structured(RunConfig)
    for data, source in layers:  # one merge per layer so a type error names its source
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(_normalize(data, RunConfig)))
        except OmegaConfBaseException as e:
            raise ConfigError(_from_omegaconf(e, source)) from None
    try:
        cfg = OmegaConf.to_object(merged)  # resolves ${...} interpolations
    except OmegaConfBaseException as e:
        raise ConfigError(_from_omegaconf(e, "while resolving interpolations")) from None
    return cfg.validate()


def _read_yaml(path: Path) -> dict[str, Any]:
    """Parse a YAML config file; errors name the file (and line for syntax errors)."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"config path is not a file: {path}")
    try:
        node = OmegaConf.load(path)  # its YAML loader reads 1e-6 as a float, unlike PyYAML's
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {e}") from None
    data = OmegaConf.to_container(node, resolve=False)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections "
                          f"({', '.join(_field_names(RunConfig))}), got {type(data).__name__}")
    return data


def _parse_override(item: str) -> dict[str, Any]:
    """Turn `key.sub=value` into a nested dict; the value is parsed as YAML (lists, null, numbers)."""
    key, sep, _ = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected key.sub=value, e.g. algo.loss=sapo")
    try:
        node = OmegaConf.from_dotlist([item])
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"override {item!r}: cannot parse the value: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_container(node, resolve=False)


def _unknown_keys(data: Any, cls: type, prefix: str, source: str) -> list[str]:
    """Problems for keys in `data` that `cls` lacks, and for sections that are not mappings."""
    section = prefix.rstrip(".") or "the config"
    if not isinstance(data, dict):
        return [f"{section}: {_show(data)} must be a mapping of {section} keys ({source})"]
    names = _field_names(cls)
    problems = []
    for key, value in data.items():
        if key not in names:
            problems.append(_unknown_key_message(str(key), prefix, names, source))
            continue
        sub = _hints(cls)[key]
        if dataclasses.is_dataclass(sub) and value is not None:
            problems += _unknown_keys(value, sub, f"{prefix}{key}.", source)
    return problems


def _unknown_key_message(key: str, prefix: str, names: list[str], source: str) -> str:
    section = prefix.rstrip(".") or "the top level"
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return f"{prefix}{key}: unknown key ({source}){hint}; valid keys of {section}: {', '.join(names)}"


# YAML 1.1 reads bare off/on/no/yes as booleans; a choice field gets the word back.
_BOOL_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def _normalize(data: dict[str, Any], cls: type) -> dict[str, Any]:
    """Undo YAML surprises before merging: `section:` left empty (null) means an empty
    section, and `replay: off` (parsed as false) means the string 'off'."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, sub = data[f.name], _hints(cls)[f.name]
        if dataclasses.is_dataclass(sub):
            if value is None:
                continue
            value = _normalize(value, sub)
        elif isinstance(value, bool) and "choices" in f.metadata:
            value = next((w for w in _BOOL_WORDS[value] if w in f.metadata["choices"]), value)
        out[f.name] = value
    return out


def _from_omegaconf(e: OmegaConfBaseException, source: str) -> str:
    """Reword an omegaconf type error as `field: value is not <type> (source)`."""
    key, first_line = getattr(e, "full_key", None), str(e).splitlines()[0]
    if not key:
        return f"{source}: {first_line}"
    if isinstance(e, InterpolationResolutionError):  # the value is a ${...} that does not resolve
        return f"{key}: {first_line} ({source})"
    tp = _field_type(key)
    expected = f"is not {_describe_type(tp)}" if tp is not None else f"is invalid: {first_line}"
    return f"{key}: {_show(getattr(e, 'value', None))} {expected} ({source})"


# --------------------------------------------------------------------------
# Per-field checks (types, choices, ranges), driven by the declarations above
# --------------------------------------------------------------------------

def _field_problems(obj: Any, prefix: str) -> list[str]:
    """Type, choice and range problems of every field of a section, recursing into subsections."""
    problems = []
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value, tp = f"{prefix}{f.name}", getattr(obj, f.name), hints[f.name]
        if not _type_ok(value, tp):
            problems.append(f"{key}: {_show(value)} is not {_describe_type(tp)}")
        elif dataclasses.is_dataclass(value):
            problems += _field_problems(value, key + ".")
        elif value is not None:
            problems += _value_problems(key, value, f.metadata)
    return problems


def _value_problems(key: str, value: Any, meta: typing.Mapping[str, Any]) -> list[str]:
    choices, bounds = meta.get("choices"), meta.get("range")
    if choices and value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return [f"{key}: {_show(value)} is not one of {', '.join(choices)}{hint}"]
    if bounds and isinstance(value, float) and not math.isfinite(value):
        return [f"{key}: {_show(value)} must be a finite number {bounds}"]
    if bounds and not bounds.contains(value):
        return [f"{key}: {_show(value)} must be {bounds}"]
    return []


def _type_ok(value: Any, tp: Any) -> bool:
    """isinstance for the annotations used here (unions, list[...], int vs bool vs float)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value)
    if tp is type(None):
        return value is None
    if tp in (int, float):  # bool is an int subclass but never a valid number here
        allowed = (int, float) if tp is float else int
        return isinstance(value, allowed) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe_type(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in args)
    if origin is list:
        return f"a list of {_describe_type(args[0]).split(' ', 1)[1]}s"
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    names = {int: "an integer", float: "a number", bool: "a boolean (true/false)",
             str: "a string", type(None): "null"}
    return names.get(tp, f"a {getattr(tp, '__name__', tp)}")


def _show(value: Any) -> str:
    """A value as the user wrote it: strings quoted, None as null."""
    return "null" if value is None else repr(value)


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _field_type(dotted: str) -> Any:
    """Annotation of a dotted field of RunConfig, or None if the path does not exist."""
    tp: Any = RunConfig
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp) or part not in _hints(tp):
            return None
        tp = _hints(tp)[part]
    return tp


# --------------------------------------------------------------------------
# Cross-field rules, one small function per section
# --------------------------------------------------------------------------

# Keys of a HF config.json that give the shapes the parallel layout must divide.
_HF_SHAPE_KEYS = {
    "num_attention_heads": ("num_attention_heads",),
    "num_key_value_heads": ("num_key_value_heads",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_hidden_layers": ("num_hidden_layers",),
    "moe_intermediate_size": ("moe_intermediate_size",),
}


def _model_shape(model: ModelConfig) -> dict[str, tuple[int, str]]:
    """Known model sizes as name -> (value, label for messages).

    The tiny model's sizes are always known; for `hf_path` they are read from its
    config.json when that file is on this machine, and skipped otherwise.
    """
    if model.hf_path is None:
        return {k: (v, f"model.tiny.{k}={v}") for k, v in dataclasses.asdict(model.tiny).items()}
    cfg_file = Path(model.hf_path) / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return {}
    raw = raw.get("text_config", raw)  # multimodal checkpoints nest the LM's config
    shape = {}
    for name, keys in _HF_SHAPE_KEYS.items():
        value = next((raw[k] for k in keys if isinstance(raw.get(k), int)), None)
        if value is not None:
            shape[name] = (value, f"{name}={value} (from {cfg_file})")
    return shape


def _divides(key: str, size: int, shape: dict[str, tuple[int, str]], dim: str,
             what: str = "") -> Iterator[str]:
    """`key: <what><size> must divide <dim>=N` when the model's `dim` is known and not divisible."""
    if dim in shape and shape[dim][0] % size:
        yield f"{key}: {what}{size} must divide {shape[dim][1]}"


def _check_model(cfg: RunConfig) -> Iterator[str]:
    tiny = cfg.model.tiny
    if cfg.model.hf_path is None:
        if tiny.num_experts_per_tok > tiny.num_experts:
            yield (f"model.tiny.num_experts_per_tok: {tiny.num_experts_per_tok} must be <= "
                   f"model.tiny.num_experts={tiny.num_experts}")
        if tiny.num_attention_heads % tiny.num_key_value_heads:
            yield (f"model.tiny.num_key_value_heads: {tiny.num_key_value_heads} must divide "
                   f"model.tiny.num_attention_heads={tiny.num_attention_heads}")
    elif not cfg.model.hf_path.strip():
        yield "model.hf_path: '' must be a checkpoint directory or null (fresh tiny model)"
    if cfg.model.moe_router_fusion and cfg.algo.replay != "off":
        yield (f"model.moe_router_fusion: true is not allowed with algo.replay={cfg.algo.replay}: "
               "the fused router skips routing replay (set algo.replay=off or fusion false)")
    elif cfg.model.moe_router_fusion and cfg.drift.enabled:
        yield ("model.moe_router_fusion: true is not allowed with drift.enabled=true: the fused router skips "
               "RouterReplay, which records the routes drift compares (set drift.enabled=false or fusion false)")


def _check_parallel(cfg: RunConfig) -> Iterator[str]:
    p = cfg.parallel
    if p.overlap_param_gather and not cfg.train.distributed_optimizer:
        yield ("parallel.overlap_param_gather: true needs train.distributed_optimizer=true (the distributed "
               "optimizer gathers the parameters it updates)")
    if p.overlap_param_gather and p.overlap_grad_reduce is False:
        yield "parallel.overlap_param_gather: true needs parallel.overlap_grad_reduce (true or null)"
    if p.vpp is not None and p.pp < 2:
        yield f"parallel.vpp: {p.vpp} needs parallel.pp > 1 (pp={p.pp}); use null without pipelining"
    if p.tp > 1 and p.sp is False:
        yield (f"parallel.sp: false is not allowed with parallel.tp={p.tp}: megatron MoE layers "
               "need sequence parallel when tp > 1 (use true or null for auto)")
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    what = "the longest sequence, data.max_prompt_len + rollout.max_new_tokens"
    if cfg.train.mode == "dpo":  # chosen and rejected of a pair share a packed row
        longest, what = 2 * cfg.dpo.max_len, "the longest pair, 2 * dpo.max_len"
    if p.max_tokens_per_microbatch is not None and p.max_tokens_per_microbatch < longest:
        yield (f"parallel.max_tokens_per_microbatch: {p.max_tokens_per_microbatch} cannot hold {what} = "
               f"{longest}; use at least {longest}")
    shape = _model_shape(cfg.model)
    yield from _divides("parallel.tp", p.tp, shape, "num_attention_heads")
    yield from _divides("parallel.tp", p.tp, shape, "num_key_value_heads")
    yield from _divides("parallel.ep", p.ep, shape, "num_experts")
    yield from _divides("parallel.etp", p.etp, shape, "moe_intermediate_size")
    if p.vpp is None:
        yield from _divides("parallel.pp", p.pp, shape, "num_hidden_layers")
    else:
        yield from _divides("parallel.vpp", p.pp * p.vpp, shape, "num_hidden_layers",
                            f"pp*vpp={p.pp}*{p.vpp}=")


def _check_rollout(cfg: RunConfig) -> Iterator[str]:
    r = cfg.rollout
    if r.top_k == 0 or r.top_k < -1:
        yield f"rollout.top_k: {r.top_k} must be -1 (off) or >= 1"
    elif (r.top_p < 1.0 or r.top_k >= 1) and not r.allow_truncated_sampling:
        yield (f"rollout.top_p={r.top_p} / rollout.top_k={r.top_k}: truncated sampling draws tokens from a "
               "distribution whose log-probs neither the engine nor the trainer compute, so every update would be "
               "off-policy without correction; use top_p=1.0 and top_k=-1, or set "
               "rollout.allow_truncated_sampling=true to accept the bias")
    for i, url in enumerate(r.urls):
        if not url.startswith(("http://", "https://")):
            yield f"rollout.urls[{i}]: {url!r} must start with http:// or https://"
    if r.colocated and r.weight_sync == "nccl":
        yield ("rollout.weight_sync: 'nccl' is not allowed with rollout.colocated=true: trainer rank 0 and "
               "server 0 share GPU 0, and NCCL refuses two ranks on one GPU in a communicator; use "
               "rollout.weight_sync=disk (colocated runs elsewhere send tensors by CUDA IPC, "
               "update_weights_from_tensor, which moe_rl does not do yet)")
    if r.colocated and cfg.algo.off_policy_overlap:
        yield ("rollout.colocated: true is not allowed with algo.off_policy_overlap=true: colocated servers "
               "release their GPU memory while the trainer trains, so they cannot generate meanwhile")
    if r.router and r.urls:
        yield ("rollout.router: true starts a router in front of launched servers; rollout.urls is set (servers "
               "already run): put the router's URL in rollout.urls and its workers in rollout.admin_urls")
    sizes = {}
    for what, flags in (("tp", SGLANG_TP_FLAGS), ("dp", SGLANG_DP_FLAGS), ("pp", SGLANG_PP_FLAGS)):
        value = sglang_flag(r.sglang_args, flags)
        if value is not None and not (value.isdigit() and int(value) >= 1):
            yield f"rollout.sglang_args: {flags[0]} needs an integer >= 1, got {value!r}"
            return
        sizes[what] = 1 if value is None else int(value)
    tp = r.server_tp_size
    if tp % r.ep_size:
        yield f"rollout.ep_size: {r.ep_size} must divide the servers' tensor-parallel size {tp} (rollout.tp_size " \
              "or a --tp-size in rollout.sglang_args)"
    if r.weight_sync == "nccl" and sizes["dp"] > 1:
        yield (f"rollout.sglang_args: --dp-size {sizes['dp']} is not allowed with rollout.weight_sync=nccl: SGLang "
               "refuses distributed weight updates to data-parallel replicas (it asserts dp_size == 1); run "
               "that many servers instead (rollout.num_servers), or use rollout.weight_sync=disk")
    if r.weight_sync == "nccl" and sizes["pp"] > 1:
        yield (f"rollout.sglang_args: --pp-size {sizes['pp']} is not allowed with rollout.weight_sync=nccl: each "
               "server rank joins the update group as rank_offset + tp_rank, so pipeline stages would take the "
               "same ranks; use tensor parallelism (rollout.tp_size), or rollout.weight_sync=disk")
    if r.weight_sync == "tensor" and r.engine != "inprocess":
        yield ("rollout.weight_sync: 'tensor' copies into an engine in the trainer's own process, but a run's "
               "rollout servers (SGLang or `moe-rl serve`) are other processes: use disk or nccl, or "
               "rollout.engine=inprocess")
    yield from _check_inprocess(r)


def replay_mode(a: AlgoConfig) -> str:
    """The replay a step uses: `algo.replay`, with auto resolved (see AlgoConfig.replay)."""
    if a.replay != "auto":
        return a.replay
    updates_per_batch = a.num_minibatches + (1 if a.off_policy_overlap else 0)
    return "r2" if updates_per_batch <= 2 else "r3"


def _check_algo(cfg: RunConfig) -> Iterator[str]:
    a = cfg.algo
    if replay_mode(a) == "r3" and not cfg.rollout.return_routed_experts:
        yield (f"algo.replay: {a.replay!r} chooses 'r3' here, which replays the rollout engine's routes and requires "
               "rollout.return_routed_experts=true")
    if a.overlong_cache_len > 0 and a.overlong_max_len is None:
        yield f"algo.overlong_cache_len: {a.overlong_cache_len} needs algo.overlong_max_len to be set"
    if a.overlong_max_len is not None and a.overlong_cache_len >= a.overlong_max_len:
        yield (f"algo.overlong_cache_len: {a.overlong_cache_len} must be < "
               f"algo.overlong_max_len={a.overlong_max_len}")
    rc = a.rollout_correction
    if (rc.low is not None or rc.high is not None) and rc.mode not in ("token_mask", "icepop", "seq_mask"):
        yield (f"algo.rollout_correction.low/high bound the ratio of a mask mode; mode is {rc.mode!r}: set "
               "algo.rollout_correction.mode to token_mask, icepop or seq_mask, or leave the bounds unset")
    samples = cfg.data.prompts_per_step * cfg.rollout.n_samples
    if samples % a.num_minibatches:
        yield (f"algo.num_minibatches: {a.num_minibatches} must divide the step's samples, "
               f"data.prompts_per_step*rollout.n_samples={samples}")


def _check_critic(cfg: RunConfig) -> Iterator[str]:
    a, c = cfg.algo, cfg.critic
    if isinstance(a.lam, str) and a.lam != "adaptive":
        yield f"algo.lam: {a.lam!r} must be a number in [0, 1] or 'adaptive'"
    elif not isinstance(a.lam, str) and not 0.0 <= a.lam <= 1.0:
        yield f"algo.lam: {a.lam} must be in [0, 1] (or 'adaptive')"
    if a.advantage != "gae":
        return
    if c.warmup_steps >= cfg.train.steps:
        yield (f"critic.warmup_steps: {c.warmup_steps} must be < train.steps={cfg.train.steps}, "
               "or the policy never trains")
    if c.hf_path is not None and not c.hf_path.strip():
        yield "critic.hf_path: '' must be a checkpoint directory or null (the policy's)"
    if a.kl_coef > 0:
        yield "algo.kl_coef: the GAE path takes no reference policy yet; set algo.kl_coef=0"


def _data_source_problem(key: str, spec: str) -> str | None:
    if spec.startswith("toy:"):
        return None if spec[4:].strip() else f"{key}: {spec!r} must name a task, e.g. toy:add-easy"
    if spec.endswith(DATA_SUFFIXES):
        return None
    return f"{key}: {spec!r} must be a {' or '.join(DATA_SUFFIXES)} file or toy:<task>"


def _check_data(cfg: RunConfig) -> Iterator[str]:
    for key, spec in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        problem = spec is not None and _data_source_problem(key, spec)
        if problem:
            yield problem


def _check_reward(cfg: RunConfig) -> Iterator[str]:
    name = cfg.reward.name
    module, sep, function = name.partition(":")
    if not name.strip() or (sep and not (module.strip() and function.strip())):
        yield f"reward.name: {name!r} must be a registry name or module:function"


HANDOFF_MARGIN_S = 600.0  # HTTP backoffs, identity probes, a weight load's own overhead


def handoff_budget_s(cfg: RunConfig) -> float:
    """The longest rank 0 may spend before a hand-off the other ranks wait in (their wait's floor).

    One rollout call gives each of its `rollout.retries + 1` attempts up to `rollout.timeout_s` to
    find a healthy server and as much for the answer, and may first load weights into the
    servers (a colocated resume: up to `rollout.timeout_s`). With `algo.off_policy_overlap` a
    hand-off can wait for the prefetched rollout first and then for a refill round: twice that.
    """
    r = cfg.rollout
    one = (r.retries + 1) * 2 * r.timeout_s + r.timeout_s
    return one * (2 if cfg.algo.off_policy_overlap else 1)


def handoff_timeout_s(cfg: RunConfig) -> float:
    """The control group's timeout: `train.handoff_timeout_s`, or the budget plus a margin."""
    t = cfg.train.handoff_timeout_s
    return t if t is not None else handoff_budget_s(cfg) + HANDOFF_MARGIN_S


def _check_train(cfg: RunConfig) -> Iterator[str]:
    t = cfg.train
    budget = handoff_budget_s(cfg)
    if t.handoff_timeout_s is not None and t.handoff_timeout_s < budget and t.mode == "rl":
        r = cfg.rollout
        yield (f"train.handoff_timeout_s: {t.handoff_timeout_s:g} s is shorter than rank 0's rollout budget of "
               f"{budget:g} s ((rollout.retries={r.retries} + 1) x 2 x rollout.timeout_s={r.timeout_s:g} + "
               f"rollout.timeout_s{', x 2 with algo.off_policy_overlap' if cfg.algo.off_policy_overlap else ''}): "
               "the other ranks would time out before rank 0 gives up on its servers; raise it, leave it "
               "null (derived), or lower rollout.timeout_s / rollout.retries")
    if t.min_lr > t.lr:
        yield f"train.min_lr: {t.min_lr} must be <= train.lr={t.lr}"
    if t.warmup_steps > t.steps:
        yield f"train.warmup_steps: {t.warmup_steps} must be <= train.steps={t.steps}"
    if t.eval_every > 0 and cfg.data.eval is None:
        yield f"train.eval_every: {t.eval_every} needs data.eval (it is null); use 0 to skip evaluation"


def _check_log(cfg: RunConfig) -> Iterator[str]:
    name = cfg.log.name
    if not name.strip() or "/" in name:
        yield f"log.name: {name!r} must be non-empty and without '/' (it names a directory)"
    if cfg.log.wandb and not cfg.log.wandb_project.strip():
        yield "log.wandb_project: '' must be set when log.wandb=true"


def _check_dpo(cfg: RunConfig) -> Iterator[str]:
    d, p = cfg.dpo, cfg.parallel
    if cfg.train.mode != "dpo":
        return
    for key, spec in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        if spec is not None and spec.startswith("toy:") and not spec.startswith("toy:pref-"):
            yield (f"{key}: {spec!r} is a prompt task; train.mode=dpo needs preference pairs: "
                   f"toy:pref-{spec[4:]} or a file of prompt/chosen/rejected rows")
    if d.loss == "ipo" and d.label_smoothing > 0:
        yield f"dpo.label_smoothing: {d.label_smoothing} applies to dpo.loss=sigmoid only (it is ipo); use 0"
    if p.max_tokens_per_microbatch is None and p.micro_batch_size % 2:
        yield (f"parallel.micro_batch_size: {p.micro_batch_size} must be even with train.mode=dpo "
               "(chosen and rejected of a pair share a micro-batch)")
    dp = cfg.train.world_size // (p.tp * p.pp)
    if cfg.train.world_size > 1 and dp > 1 and d.pairs_per_step % dp:
        yield (f"dpo.pairs_per_step: {d.pairs_per_step} must be a multiple of the data-parallel size "
               f"{dp} (train.world_size / (tp * pp))")


_CROSS_CHECKS = (_check_model, _check_parallel, _check_rollout, _check_algo, _check_critic, _check_data,
                 _check_reward, _check_train, _check_log, _check_dpo)


def _check_inprocess(r: RolloutConfig) -> Iterator[str]:
    """rollout.engine=inprocess: the engine lives in trainer rank 0, so there are no servers to reach."""
    if r.engine != "inprocess":
        return
    if r.urls:
        yield ("rollout.urls: set, but rollout.engine=inprocess generates inside the trainer; "
               "empty rollout.urls, or use rollout.engine=local/sglang to reach running servers")
    if r.weight_sync == "nccl":
        yield ("rollout.weight_sync: 'nccl' broadcasts to server processes; rollout.engine=inprocess has none: "
               "use rollout.weight_sync=tensor (or disk)")
