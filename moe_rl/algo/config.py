"""The `algo`, `critic` and `dpo` sections of the run config: the objective, advantages,
rollout correction, routing replay, the critic of GAE runs and DPO, and their rules.

The `check_*(cfg)` rules take the whole `RunConfig` (`moe_rl.config`, which imports this
module: hence `Any`).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

from moe_rl.configurable import choice, ranged, registry_names

# Allowed values owned by the algo modules that implement them (read when a config is checked).
LOSSES = registry_names("moe_rl.algo.losses", "LOSSES")
AGGREGATIONS = registry_names("moe_rl.algo.aggregation", "AGG_MODES")
# gae: per-token advantages from the critic (compute_gae), not a group estimator
ADVANTAGES = registry_names("moe_rl.algo.advantages", "ESTIMATORS")
KL_ESTIMATORS = registry_names("moe_rl.algo.kl", "KL_ESTIMATORS")
TIS_LEVELS = registry_names("moe_rl.algo.tis", "TIS_LEVELS")
# route_mask: the shorthand for route masking alone (route_mask_bound), no ratio correction
CORRECTION_MODES = registry_names("moe_rl.algo.correction", "CORRECTION_MODES", extra=("route_mask",))
DPO_LOSSES = registry_names("moe_rl.algo.losses", "DPO_KINDS")
# Values of the config alone: the policy and the trainer read them.
REPLAYS = ("off", "r2", "r3", "auto")
BEHAVIOURS = ("recompute", "engine")
CRITIC_REPLAYS = ("off", "r2")


@dataclass
class RouteMaskConfig:
    """Route-mismatch masking (moe_rl/algo/route_mask.py): drop the tokens whose trainer routes differ
    from the rollout engine's in too many MoE layers; it composes with every rollout_correction.mode."""

    max_flips: int | None = ranged(None, ge=0)
    """None = off; else mask each response token whose top-k expert set differs between the trainer's
    own routing (the old pass, routes free) and the engine's in more than this many MoE layers (0: in
    any layer). Under R2 / replay off; under R3 only with native=true. Needs rollout.return_routed_experts."""
    native: bool = False
    """Under algo.replay=r3 (the engine's routes are replayed): also mask the tokens whose native
    routing, the trainer's free routes in its old pass (one more forward per step), disagrees with the
    replayed routes beyond max_flips: tokens the trainer would not have routed so."""


@dataclass
class RolloutCorrectionConfig:
    """What to do with tokens whose trainer and rollout probabilities disagree (moe_rl/algo/correction.py)."""

    mode: str | None = choice(None, CORRECTION_MODES)
    """None = off; tis = truncated IS (cap: algo.tis_cap, 2 if unset); token_mask = drop tokens whose
    ratio pi_old / pi_rollout is outside [low, high] (MIS); icepop = token_mask with IcePop's [0.5, 5];
    seq_mask = drop whole sequences whose geometric-mean ratio is outside [low, high]. algo.tis_cap
    set together with a mask mode applies both. route_mask: shorthand for route masking alone
    (route_mask.max_flips, 0 when unset); to mask routes beside a ratio mode, set that mode and
    route_mask.max_flips."""
    low: float | None = ranged(None, ge=0.0, lt=1.0)
    """Lower bound on the ratio for the mask modes; None = the mode's default (0.5; seq_mask 0.99)."""
    high: float | None = ranged(None, gt=1.0)
    """Upper bound on the ratio for the mask modes; None = the mode's default (2; icepop 5; seq_mask 1.01)."""
    route_mask: RouteMaskConfig = field(default_factory=RouteMaskConfig)
    """Route-mismatch masking, beside any mode (mode=route_mask: it alone)."""


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
    """Truncated importance sampling cap for the rollout/trainer mismatch; None = off on-policy, and
    algo.stale_tis_cap when algo.max_staleness >= 1 (with no algo.rollout_correction.mode)."""
    stale_tis_cap: float | None = ranged(2.0, gt=0.0)
    """The importance weight of asynchronous runs (algo.max_staleness >= 1, algo.behaviour=recompute)
    when algo.tis_cap and algo.rollout_correction.mode are unset: each token weighed by
    pi_prox / pi_behaviour (the trainer's recomputed log-prob over the engine's) capped here, decoupled
    PPO as AReaL defines it; null = none. Without it a K=2 run trains on stale samples as if the
    proximal policy drew them: on a 2-token task at lr 3e-3 it reached 0.8 on 1 seed of 8 where K=0
    did on 6, with it on 7 (tools/bench/async_rl.py --learn)."""
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
    replay_min_coverage: float = ranged(1.0, ge=0.0, le=1.0)
    """Under R3, the least share of a step's tokens (response tokens, and separately the prompt's and
    environments' context tokens; per MoE layer) that must replay a route the engine returned; below it
    the step fails naming the samples and layers (replay/coverage). 1.0: every token, as R3 promises.
    Below 1.0 the tokens without an engine route replay the trainer's own routes (one more forward per step)."""
    replay: str = choice("r2", REPLAYS)
    """Routing replay: r2 replays the old policy's routes, r3 the rollout engine's; r2 needs no engine
    support. auto: r2 while a step's updates are mildly off-policy (at most 2 optimizer updates per
    rollout batch, counting each version of algo.max_staleness as one), r3 beyond that, following the
    Qwen team's analysis of routing replay (R2 biases less when close to on-policy, R3 holds up far off it)."""
    max_staleness: int = ranged(0, ge=0)
    """Asynchronous RL: the servers keep generating the next K steps' batches while the trainer
    trains, and no token more than K weight versions old is trained on (moe_rl/recipes/rl/
    async_rollouts.py); 0 = each step generates, then trains, on-policy. Pair K >= 1 with a rollout
    correction (algo.tis_cap; algo.stale_tis_cap, 2, when unset) and, to let the servers generate through weight pushes,
    rollout.inflight_update=in_place."""
    auto_staleness: bool = False
    """Asynchronous RL (algo.max_staleness = K >= 1, the largest K allowed): the run lowers K by one
    each time the updates moved the policy too far for stale samples, loss/approx_kl (the step's
    within-update KL) above algo.auto_staleness_kl on algo.auto_staleness_steps steps in a row, down
    to 0 (on-policy); logged, and rollout/staleness_bound each step. It never raises K again."""
    auto_staleness_kl: float = ranged(0.15, gt=0.0)
    """The within-step KL (loss/approx_kl) past which algo.auto_staleness lowers K. 0.15: on the
    last-parity task the runs that collapsed at K=2 had its p90 at 0.15-0.63, those that learned at K=0
    0.02-0.10 (tools/bench/async_rl.py --learn)."""
    auto_staleness_steps: int = ranged(2, ge=1)
    """Steps in a row above algo.auto_staleness_kl before algo.auto_staleness lowers K."""
    behaviour: str = choice("recompute", BEHAVIOURS)
    """pi_old, the policy the objective's ratio is taken and clipped against. recompute: the trainer's
    log-probs of the step's samples under its weights before the step's updates, the proximal policy of
    decoupled PPO (AReaL); the engine's per-token log-probs (the behaviour policy: a mixture of versions
    once samples span weight pushes) then enter through the rollout correction only, as the importance
    weight pi_old / pi_engine capped at algo.tis_cap, and the masks of algo.rollout_correction. engine:
    the engine's log-probs are pi_old, with no correction to make and no recompute pass unless R2 or a
    drift measurement needs the trainer's routes (one forward less per step; the clip is then against
    weights up to algo.max_staleness versions old, and kernel or routing mismatch goes uncorrected)."""
    off_policy_overlap: bool = False
    """Deprecated: algo.max_staleness=1 says it (true is taken as max_staleness >= 1)."""
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
class DPOConfig:
    """Direct preference optimisation, used when train.mode=dpo (moe_rl/recipes/dpo/step.py)."""

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


def replay_mode(a: AlgoConfig) -> str:
    """The replay a step uses: `algo.replay`, with auto resolved (see AlgoConfig.replay)."""
    if a.replay != "auto":
        return a.replay
    updates_per_batch = a.num_minibatches + staleness_bound(a)
    return "r2" if updates_per_batch <= 2 else "r3"


def staleness_bound(a: Any) -> int:
    """K of `algo.max_staleness`, with the deprecated `algo.off_policy_overlap=true` as K >= 1."""
    return max(int(a.max_staleness), 1 if a.off_policy_overlap else 0)


def tis_cap_of(a: Any) -> float | None:
    """The TIS cap a run applies: algo.tis_cap, else algo.stale_tis_cap in an asynchronous run whose
    pi_old is recomputed and that asks for no other correction."""
    if a.tis_cap is not None:
        return a.tis_cap
    stale = staleness_bound(a) >= 1 and a.behaviour == "recompute" and a.rollout_correction.mode is None
    return a.stale_tis_cap if stale else None


def ratio_mode(rc: RolloutCorrectionConfig) -> str | None:
    """The ratio correction of moe_rl/algo/correction.py that `rc.mode` asks for (None for route_mask alone)."""
    return None if rc.mode == "route_mask" else rc.mode


def route_mask_bound(a: AlgoConfig) -> int | None:
    """max_flips of the route mask this run applies, None when it applies none: route_mask.max_flips
    (mode=route_mask without it: 0), under R3 only with route_mask.native."""
    rc = a.rollout_correction
    bound = rc.route_mask.max_flips if rc.route_mask.max_flips is not None else 0 if rc.mode == "route_mask" else None
    if bound is None or (replay_mode(a) == "r3" and not rc.route_mask.native):
        return None
    return bound


def check_route_mask(cfg: Any) -> Iterator[str]:
    a, rc = cfg.algo, cfg.algo.rollout_correction
    wanted = rc.mode == "route_mask" or rc.route_mask.max_flips is not None
    if wanted and not cfg.rollout.return_routed_experts:
        yield ("algo.rollout_correction.route_mask compares the trainer's routes with the engine's: set "
               "rollout.return_routed_experts=true (SGLang: --enable-return-routed-experts)")
    if wanted and replay_mode(a) == "r3" and not rc.route_mask.native:
        yield (f"algo.rollout_correction.route_mask: algo.replay={a.replay!r} replays the engine's routes (r3), so "
               "no route differs from them; set algo.rollout_correction.route_mask.native=true to mask the tokens "
               "whose free routing disagrees with the replayed one, or use algo.replay=r2/off")


# the objectives' hyperparameters among the algo keys (each objective reads its own subset: loss_reads)
_OBJECTIVE_KEYS = ("eps_low", "eps_high", "tau_pos", "tau_neg", "dual_clip")


def loss_reads(loss: str) -> tuple[str, ...]:
    """The `algo` keys objective `loss` reads: its registered function's keyword hyperparameters that are
    config fields (moe_rl/algo/losses.py declares them; read late, as the registry's names are)."""
    spec = importlib.import_module("moe_rl.algo.losses").get_loss(loss)
    names = {f.name for f in fields(AlgoConfig)}
    return tuple(k for k in spec.defaults if k in names)


def uses_critic(a: Any) -> bool:
    """Whether `algo.advantage` is a critic estimator (gae: per-token, from a learned value model that
    the run then builds and trains) rather than a group one (moe_rl/algo/advantages.py says which)."""
    return a.advantage in importlib.import_module("moe_rl.algo.advantages").CRITIC_ESTIMATORS


def advantage_params(a: Any) -> dict[str, Any]:
    """`compute_advantages` keywords of a group estimator: its keyword hyperparameters that have an
    `algo.adv_<name>` field (grpo's eps: algo.adv_eps); an estimator without them gets its defaults."""
    if uses_critic(a):
        return {}
    fn = importlib.import_module("moe_rl.algo.advantages").ADVANTAGE_ESTIMATORS[a.advantage]
    names = {f.name for f in fields(AlgoConfig)}
    return {p.name: getattr(a, f"adv_{p.name}") for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and f"adv_{p.name}" in names}


def check_algo(cfg: Any) -> Iterator[str]:
    a = cfg.algo
    yield from check_route_mask(cfg)
    reads = loss_reads(a.loss)
    for f in fields(AlgoConfig):  # a hyperparameter set for an objective that ignores it is a mistake
        if f.name in _OBJECTIVE_KEYS and f.name not in reads and getattr(a, f.name) != f.default:
            yield (f"algo.{f.name}: the {a.loss} objective does not read it (it reads "
                   f"{', '.join(reads) or 'none of them'}); unset it, or choose an objective that reads it")
    if a.advantage in ADVANTAGES:  # else the field check names the unknown estimator
        adv_reads = [f"adv_{k}" for k in advantage_params(a)]
        for f in fields(AlgoConfig):  # the same for the advantage estimator's keys
            if f.name.startswith("adv_") and f.name not in adv_reads and getattr(a, f.name) != f.default:
                yield (f"algo.{f.name}: the {a.advantage} advantage estimator does not read it (it reads "
                       f"{', '.join(adv_reads) or 'none of them'}); unset it, or choose an estimator that reads it")
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
    if a.behaviour == "engine" and (a.tis_cap is not None or ratio_mode(rc) is not None):
        yield ("algo.behaviour: 'engine' takes pi_old from the engine's log-probs, so there is no engine/trainer "
               "ratio to correct; unset algo.tis_cap and algo.rollout_correction.mode, or use "
               "algo.behaviour=recompute (decoupled PPO: clip against the trainer, weigh the engine's samples)")
    if a.auto_staleness and staleness_bound(a) == 0:
        yield ("algo.auto_staleness: lowers K from algo.max_staleness, which is 0 (on-policy); set "
               "algo.max_staleness to the largest K to allow (e.g. 2)")
    samples = cfg.data.prompts_per_step * cfg.rollout.n_samples
    if samples % a.num_minibatches:
        yield (f"algo.num_minibatches: {a.num_minibatches} must divide the step's samples, "
               f"data.prompts_per_step*rollout.n_samples={samples}")


def check_critic(cfg: Any) -> Iterator[str]:
    a, c = cfg.algo, cfg.critic
    if isinstance(a.lam, str) and a.lam != "adaptive":
        yield f"algo.lam: {a.lam!r} must be a number in [0, 1] or 'adaptive'"
    elif not isinstance(a.lam, str) and not 0.0 <= a.lam <= 1.0:
        yield f"algo.lam: {a.lam} must be in [0, 1] (or 'adaptive')"
    if not uses_critic(a):
        return
    if c.warmup_steps >= cfg.train.steps:
        yield (f"critic.warmup_steps: {c.warmup_steps} must be < train.steps={cfg.train.steps}, "
               "or the policy never trains")
    if c.hf_path is not None and not c.hf_path.strip():
        yield "critic.hf_path: '' must be a checkpoint directory or null (the policy's)"
    if a.kl_coef > 0:
        yield "algo.kl_coef: the GAE path takes no reference policy yet; set algo.kl_coef=0"


def check_dpo(cfg: Any) -> Iterator[str]:
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
