"""The stages of the prepared GPU check (tools/gpu_check.sh): what each one runs, the question it
answers, and its time budget.

The check must fit a 9-minute lease of one GPU, the machine's start included. The script as a whole
never runs longer than `BUDGET_S` (the driver trims each stage's timeout to what is left of it, the
wheel install before it included); each stage has its own timeout, sized at about 1.5x what it is
expected to take on an H200, so that a hung stage costs its own budget and the next stages still run.
The expected times below are estimates from the work each stage does (Python + megatron-core import
~5-8 s per process, CUDA init ~2 s, a tiny model's steps well under a second), not measurements.

Commands are templates: "{py}" is the interpreter, "{work}" the scratch directory (not returned
from the machine), "{out}" the directory whose top-level files come back. Every `moe-rl train`
stage runs one trainer rank (`train.world_size=1`, `parallel.ep=1`) with its rollout server on the
same GPU (the placement puts `moe-rl serve` there when the machine has one GPU), padded micro-batches
(`parallel.max_tokens_per_microbatch=null`: transformer-engine has no fp32 packed attention).

This module is stdlib only: the driver and the CPU tests import it without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BUDGET_S = 420  # 7 minutes for everything after the machine started: wheels, stages, summary

TINY = "launch/configs/tiny_cpu.yaml"
TOOL = "launch/configs/tiny_cpu_tool.yaml"
COLOCATED = "launch/configs/rehearsal_cpu_colocated.yaml"

# One trainer rank and its server on the one GPU, padded micro-batches, no progress bar.
ONE_GPU = ("train.world_size=1", "parallel.ep=1", "parallel.max_tokens_per_microbatch=null", "log.progress=false")
# Short runs: no evaluation, checkpoint or TensorBoard (what the stage reads is metrics.jsonl).
SHORT = ("train.eval_every=0", "train.save_every=0", "log.tensorboard=false")


@dataclass(frozen=True)
class Command:
    """One process of a stage. `run_dir`: the `moe-rl train` run directory it writes (under {work})."""

    name: str
    argv: tuple[str, ...]
    run_dir: str | None = None

    def render(self, py: str, work: str, out: str) -> list[str]:
        return [a.format(py=py, work=work, out=out) for a in self.argv]

    @property
    def is_train(self) -> bool:
        return self.argv[1:5] == ("-m", "moe_rl.cli", "train", "--config")


@dataclass(frozen=True)
class Stage:
    """A question the GPU check answers, with its own timeout and result record.

    figures: "file" = its last command writes the record's figures (JSON, with status and reason)
    to {work}/<name>/figures.json; else `check` names the `checks` function that judges its runs.
    sglang: needs an importable sglang (skipped with the import error otherwise).
    headline: the figures the summary table shows.
    """

    name: str
    question: str
    timeout_s: int
    expected_s: int
    commands: tuple[Command, ...]
    check: str | None = None
    check_args: dict[str, Any] = field(default_factory=dict)
    sglang: bool = False
    headline: tuple[str, ...] = ()

    @property
    def figures_file(self) -> str:
        return "{work}/" + self.name + "/figures.json"


def train(stage: str, name: str, config: str, *overrides: str) -> Command:
    """`moe-rl train` of `config` with `overrides`, its run directory {work}/<stage>/<name>."""
    run_dir = f"{{work}}/{stage}/{name}"
    argv = ("{py}", "-m", "moe_rl.cli", "train", "--config", config, *overrides, f"log.run_dir={run_dir}")
    return Command(name, argv, run_dir)


def python_stage(stage: str, subcommand: str, *args: str) -> Command:
    """`tools/gpu/stages.py SUBCOMMAND` writing the stage's figures file."""
    argv = ("{py}", "tools/gpu/stages.py", subcommand, "--work", f"{{work}}/{stage}",
            "--figures", f"{{work}}/{stage}/figures.json", *args)
    return Command(subcommand, argv)


def _stages() -> tuple[Stage, ...]:
    two_turn = ("algo.replay=r3", "rollout.max_new_tokens=8", "rollout.max_episode_tokens=20", "train.steps=3",
                "drift.every=1", "drift.probe_every=1")
    # tiny_cpu.yaml replays R2: the async runs also train with R2 on the GPU
    # tis_cap: importance weights for K=1's one-version-old samples (the run warns without them); the same
    # in both runs, where it changes nothing at K=0
    steady = ("train.steps=5", "rollout.max_new_tokens=16", "data.prompts_per_step=8", "rollout.n_samples=16",
              "drift.enabled=false", "algo.tis_cap=2")
    # The colocated rehearsal on one GPU with 8 decoded tokens per sample instead of one (real decode
    # steps). The toy task's exact-match reward would then be 0 for almost every sample and every step
    # skipped by dynamic sampling, so nothing trains and a resumed server with stale weights would go
    # unseen: the reward is "the completion starts with a digit" (10 of the 16 tokens), which varies
    # within nearly every group, so every step trains and moves the weights the server must then hold.
    colo = ("train.world_size=1", "parallel.ep=1", "parallel.max_tokens_per_microbatch=null",
            "train.device_guard=false", "train.steps=4", "log.progress=false", "rollout.max_new_tokens=8",
            "reward.name=moe_rl.testing.e2e:digit_first_reward")
    return (
        Stage("environment", "versions of torch / CUDA / GPU / megatron-core / TE / transformers / sglang",
              timeout_s=30, expected_s=10, commands=(python_stage("environment", "environment"),),
              headline=("device", "torch", "megatron_core", "transformer_engine")),
        Stage("gpu_tests", "tests/gpu: the CUDA path of the policy (TE spec, alltoall, NCCL) vs HF",
              timeout_s=50, expected_s=30,
              commands=(Command("pytest", ("{py}", "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                           "tests/gpu")),),
              check="pytest_summary", headline=("passed", "failed")),
        Stage("update_mfu", "update-step MFU of moe_rl and of bare megatron-core (tools/bench/gpu_update.py)",
              timeout_s=80, expected_s=50,
              commands=(python_stage("update_mfu", "update-mfu", "--report", "{out}/gpu_update.md",
                                     "--layers", "8", "--batch", "8", "--seq", "2048", "--micro", "2",
                                     "--warmup", "1", "--iters", "3"),),
              headline=("update_mfu", "bare_mfu", "moe_rl_over_bare")),
        Stage("r3_decode", "moe-rl serve on CUDA, 48 decoded tokens: engine vs trainer routes and log-probs (R3)",
              timeout_s=35, expected_s=20,
              commands=(python_stage("r3_decode", "r3-decode", "--engine", "local", "--new-tokens", "48"),),
              headline=("route_mismatch_decode", "logp_abs_diff_r3")),
        Stage("r3_two_turn", "moe-rl train, R3, two-turn calculator episodes: mismatch per turn",
              timeout_s=40, expected_s=25,
              commands=(train("r3_two_turn", "tool_r3", TOOL, *ONE_GPU, *SHORT, *two_turn),),
              check="two_turn", check_args={"steps": 3},
              headline=("logp_abs_diff_max", "rollout_mismatch_max", "turn1_tokens")),
        Stage("weight_sync", "disk / tensor seconds, and the nccl protocol over gloo to a server on this GPU",
              timeout_s=45, expected_s=25,
              commands=(python_stage("weight_sync", "weight-sync", "--engine", "local"),),
              headline=("disk_s", "tensor_s", "nccl_gloo_s")),
        Stage("async", "samples/s of algo.max_staleness=0 vs 1 (same config, 5 steps each)",
              timeout_s=70, expected_s=45,
              commands=(train("async", "k0", TINY, *ONE_GPU, *SHORT, *steady, "algo.max_staleness=0"),
                        train("async", "k1", TINY, *ONE_GPU, *SHORT, *steady, "algo.max_staleness=1")),
              check="async_compare", check_args={"steps": 5},
              headline=("samples_per_s_k0", "samples_per_s_k1", "k1_over_k0")),
        Stage("colocated", "colocated release / resume with decoding: rewards = non-colocated, engine = trainer",
              timeout_s=60, expected_s=40,
              commands=(train("colocated", "colocated_true", COLOCATED, *colo, "rollout.colocated=true"),
                        train("colocated", "colocated_false", COLOCATED, *colo, "rollout.colocated=false")),
              check="colocated", check_args={"steps": 4},
              headline=("rewards_equal", "logp_abs_diff_max")),
        Stage("r3_decode_sglang", "SGLang on CUDA, 48 decoded tokens: engine vs trainer routes and log-probs (R3)",
              timeout_s=90, expected_s=60, sglang=True,
              commands=(python_stage("r3_decode_sglang", "r3-decode", "--engine", "sglang", "--new-tokens", "48"),),
              headline=("route_mismatch_decode", "logp_abs_diff_r3")),
        Stage("weight_sync_sglang", "disk seconds and the nccl protocol over gloo into SGLang on this GPU",
              timeout_s=90, expected_s=60, sglang=True,
              commands=(python_stage("weight_sync_sglang", "weight-sync", "--engine", "sglang"),),
              headline=("disk_s", "nccl_gloo_s")),
        Stage("colocated_sglang", "a colocated SGLang server released / resumed across evals: engine = trainer",
              timeout_s=90, expected_s=60, sglang=True,
              commands=(train("colocated_sglang", "colocated_sglang", COLOCATED, *colo, "rollout.engine=sglang",
                              "rollout.mem_fraction=0.3"),),
              check="colocated_sglang", check_args={"steps": 4},
              headline=("logp_abs_diff_max",)),
    )


STAGES: tuple[Stage, ...] = _stages()


def stage_names() -> list[str]:
    return [s.name for s in STAGES]


def select(only: list[str] | None = None, skip: list[str] | None = None) -> list[Stage]:
    """The stages to run, in order; ValueError naming an unknown stage."""
    names = stage_names()
    for n in (only or []) + (skip or []):
        if n not in names:
            raise ValueError(f"--only / --skip: unknown stage {n!r}; the stages are {', '.join(names)}")
    return [s for s in STAGES if (not only or s.name in only) and s.name not in (skip or [])]
