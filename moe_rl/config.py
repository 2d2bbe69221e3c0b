"""Run configuration: one `RunConfig` tree of dataclass sections, validated once.

A run's settings are built in layers, each later layer winning:

    dataclass defaults  ->  YAML file  ->  `key.sub=value` overrides  ->  validate()

    cfg = load_config("launch/configs/tiny_cpu.yaml", ["algo.loss=sapo", "parallel.tp=2"])

Every mistake fails here, before any process group, model or server starts,
with a `ConfigError` whose message names the dotted field, the value given and
what is allowed. Unknown keys are refused (with a "did you mean"), so a typo
can never silently leave a default in place.

Each component owns its section and the rules that relate its fields to others
(`check_<section>(cfg)`), in its own `config.py`: `model`/`parallel` in
`moe_rl.policy.config`, `rollout` in `moe_rl.rollout.config`, `algo`/`critic`/`dpo` in
`moe_rl.algo.config`, `data`, `reward`, `drift`, `log` in theirs; `train` (the driver's)
is here. `moe_rl.configurable` holds the field helpers (`choice`, `ranged`) and
`ConfigError`; this module assembles `RunConfig`, loads, merges and validates it, and
re-exports every section so `from moe_rl.config import AlgoConfig` keeps working.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
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

from moe_rl.algo.config import (ADVANTAGES, AGGREGATIONS, CORRECTION_MODES, CRITIC_REPLAYS, DPO_LOSSES,
                                KL_ESTIMATORS, LOSSES, REPLAYS, TIS_LEVELS, AlgoConfig, CriticConfig, DPOConfig,
                                RolloutCorrectionConfig, check_algo, check_critic, check_dpo, replay_mode,
                                staleness_bound, tis_cap_of)
from moe_rl.configurable import ConfigError, choice, ranged
from moe_rl.data.config import DATA_SUFFIXES, DataConfig, check_data
from moe_rl.drift.config import AlarmConfig, DriftConfig, check_drift
from moe_rl.observe.config import LOG_LEVELS, LogConfig, check_log
from moe_rl.policy.config import DTYPES, ModelConfig, ParallelConfig, TinyModel, check_model, check_parallel
from moe_rl.reward.config import RewardConfig, check_reward
from moe_rl.rollout.config import (ENGINES, SGLANG_DP_FLAGS, SGLANG_PP_FLAGS, SGLANG_TP_FLAGS, WEIGHT_SYNCS,
                                   RolloutConfig, check_rollout, sglang_flag)

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "CORRECTION_MODES", "CRITIC_REPLAYS", "DATA_SUFFIXES", "DPO_LOSSES", "DTYPES",
    "ENGINES", "KL_ESTIMATORS", "LOG_LEVELS", "LOSSES", "LR_SCHEDULES", "MODES", "REPLAYS", "SGLANG_DP_FLAGS",
    "SGLANG_PP_FLAGS", "SGLANG_TP_FLAGS", "TIS_LEVELS", "WEIGHT_SYNCS",
    "AlarmConfig", "AlgoConfig", "ConfigError", "CriticConfig", "DPOConfig", "DataConfig", "DriftConfig", "LogConfig",
    "ModelConfig", "ParallelConfig", "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig", "RunConfig",
    "TinyModel", "TrainConfig", "choice", "handoff_budget_s", "handoff_timeout_s", "load_config", "ranged",
    "replay_mode", "sglang_flag",
]


LR_SCHEDULES = ("constant", "cosine", "linear")
MODES = ("rl", "dpo")


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
    async_save: bool = False
    """Write the models' checkpoint files in forked writers while the next steps train (megatron's
    asynchronous save); the checkpoint is finished (hashed, renamed to step_N/) at the first step
    boundary after every rank's writers are done. For large models; a save then holds the step
    for its collective part only."""
    export_hf: bool = False
    """At the end of an RL run also write the policy as a HF checkpoint in RUN_DIR/hf/ (a DPO run
    always does); any checkpoint exports later with `moe-rl export`."""
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
    weights into them) before failing, on a gloo group of their own (moe_rl/dist/collectives.py). None = the
    rollout budget plus 10 minutes (`handoff_budget_s`): a lost server then ends in rank 0's checkpoint
    and exit 3, never in a timeout of the waiting ranks. Set it only above that budget."""
    device_guard: bool = False
    """CPU only, for CI and debugging: fail when one of moe_rl's collectives gets a host tensor,
    which NCCL would refuse on a GPU (moe_rl.dist.device_guard). The CPU rehearsal runs with it."""
    mode: str = choice("rl", MODES)
    """rl = RL steps on rollouts (`algo`, `rollout`, `reward`); dpo = DPO steps on preference pairs
    (`dpo`; data.train / data.eval name preference data; no rollout servers)."""


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
    if cfg.algo.off_policy_overlap:
        logging.getLogger("moe_rl").warning("algo.off_policy_overlap is deprecated: it means algo.max_staleness=1 "
                                            "(at least); set that instead")
    a = cfg.algo
    if staleness_bound(a) and a.behaviour == "recompute" and tis_cap_of(a) is None and a.rollout_correction.mode is None:
        logging.getLogger("moe_rl").warning(
            "algo.max_staleness=%d trains on samples from older weights with no importance weight for them "
            "(algo.stale_tis_cap=null): set algo.tis_cap (e.g. 2; decoupled PPO) or algo.rollout_correction.mode",
            staleness_bound(a))
    return cfg.validate()


def named_run_dir(path: str | Path | None, overrides: Sequence[str] = ()) -> str | None:
    """The `log.run_dir` a config that failed to load names (the last layer that names it wins),
    so the refusal can go to that run's `train.log` too; None when no readable layer names one."""
    named = None
    layers = [lambda: _read_yaml(Path(path))] if path is not None else []
    layers += [lambda item=item: _parse_override(item) for item in overrides]
    for read in layers:
        try:
            log = read().get("log")
        except (ConfigError, AttributeError):
            continue  # this layer is what failed, or is not a mapping: it names nothing
        if isinstance(log, dict) and isinstance(log.get("run_dir"), str) and log["run_dir"].strip():
            named = log["run_dir"]
    return named


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

HANDOFF_MARGIN_S = 600.0  # HTTP backoffs, identity probes, a weight load's own overhead


def handoff_budget_s(cfg: RunConfig) -> float:
    """The longest rank 0 may spend before a hand-off the other ranks wait in (their wait's floor).

    One rollout call gives each of its `rollout.retries + 1` attempts up to `rollout.timeout_s` to
    find a healthy server and as much for the answer, and may first load weights into the
    servers (a colocated resume: up to `rollout.timeout_s`). With `algo.max_staleness` = K a
    hand-off can wait for a batch asked for K steps before, behind the K - 1 after it, and
    then for a refill round: 1 + K times that.
    """
    r = cfg.rollout
    one = (r.retries + 1) * 2 * r.timeout_s + r.timeout_s
    return one * (1 + staleness_bound(cfg.algo))


def handoff_timeout_s(cfg: RunConfig) -> float:
    """The control group's timeout: `train.handoff_timeout_s`, or the budget plus a margin."""
    t = cfg.train.handoff_timeout_s
    return t if t is not None else handoff_budget_s(cfg) + HANDOFF_MARGIN_S


def check_train(cfg: RunConfig) -> Iterator[str]:
    t = cfg.train
    budget = handoff_budget_s(cfg)
    if t.handoff_timeout_s is not None and t.handoff_timeout_s < budget and t.mode == "rl":
        r = cfg.rollout
        yield (f"train.handoff_timeout_s: {t.handoff_timeout_s:g} s is shorter than rank 0's rollout budget of "
               f"{budget:g} s ((rollout.retries={r.retries} + 1) x 2 x rollout.timeout_s={r.timeout_s:g} + "
               f"rollout.timeout_s{', x (1 + algo.max_staleness)' if staleness_bound(cfg.algo) else ''}): "
               "the other ranks would time out before rank 0 gives up on its servers; raise it, leave it "
               "null (derived), or lower rollout.timeout_s / rollout.retries")
    if t.min_lr > t.lr:
        yield f"train.min_lr: {t.min_lr} must be <= train.lr={t.lr}"
    if t.warmup_steps > t.steps:
        yield f"train.warmup_steps: {t.warmup_steps} must be <= train.steps={t.steps}"
    if t.eval_every > 0 and cfg.data.eval is None:
        yield f"train.eval_every: {t.eval_every} needs data.eval (it is null); use 0 to skip evaluation"


_CROSS_CHECKS = (check_model, check_parallel, check_rollout, check_algo, check_critic, check_data,
                 check_reward, check_train, check_log, check_dpo, check_drift)
