"""Whole-loop checks run on spawned trainer ranks by the end-to-end tests.

Building the policy and the rollout server dominates a short CPU run, so one set
of ranks runs one RL step for each (objective, replay mode) pair on the same
policy and engine, switching only the `algo` section between steps.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch


PACK_TOKENS = 32  # token budget of the packed steps (toy prompts + answers are shorter)


def objective_matrix_worker(cfg_dict: dict[str, Any], run_dir: str, combos: list[tuple[str, str]]
                            ) -> list[dict[str, Any]]:
    """For each (loss, replay) pair: one RL step; returns metrics and whether weights moved."""
    from moe_rl.config import RunConfig
    from moe_rl.loop import rl_step
    from moe_rl.trainer import build_run

    cfg = RunConfig.from_dict(cfg_dict)
    rank = int(os.environ["RANK"])
    built = build_run(cfg, Path(run_dir), rank)
    run, servers = built["run"], built["servers"]
    out = []
    try:
        for step, (loss, replay) in enumerate(combos, start=1):
            run.cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, loss=loss, replay=replay))
            before = _weights_fingerprint(run.policy)
            metrics = rl_step(run, step)
            moved = _weights_fingerprint(run.policy) - before
            out.append({"loss": loss, "replay": replay, "metrics": metrics, "weight_change": float(moved.abs().sum())})
        # One-step off-policy overlap: the next rollout runs while this step trains.
        run.cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, off_policy_overlap=True, tis_cap=2.0))
        for step in range(len(combos) + 1, len(combos) + 4):
            out.append({"loss": cfg.algo.loss, "replay": cfg.algo.replay, "overlap": True,
                        "metrics": rl_step(run, step), "weight_change": float("nan")})
        # Packed micro-batches with token-balanced DP shares, under both replay modes.
        packed = dataclasses.replace(cfg.parallel, max_tokens_per_microbatch=PACK_TOKENS)
        run.policy.spec = dataclasses.replace(run.policy.spec, max_tokens_per_microbatch=PACK_TOKENS)
        for step, replay in enumerate(["r2", "r3"], start=len(combos) + 4):
            run.cfg = dataclasses.replace(cfg, parallel=packed, algo=dataclasses.replace(cfg.algo, replay=replay))
            before = _weights_fingerprint(run.policy)
            metrics = rl_step(run, step)
            out.append({"loss": cfg.algo.loss, "replay": replay, "packed": True, "metrics": metrics,
                        "weight_change": float((_weights_fingerprint(run.policy) - before).abs().sum())})
    finally:
        if servers is not None:
            servers.stop()
    return out


def _weights_fingerprint(policy: Any) -> torch.Tensor:
    return torch.stack([p.detach().float().sum() for c in policy.chunks for p in c.parameters()])


def digit_first_reward(completion_text: str, answer: str | None, **_: Any) -> float:
    """A dense toy reward for critic tests: 1.0 when the completion starts with a digit (10 of 16 tokens)."""
    return 1.0 if completion_text[:1].isdigit() else 0.0


def critic_steps_worker(cfg_dict: dict[str, Any], run_dir: str, critic_replays: list[str]) -> list[dict[str, Any]]:
    """`algo.advantage=gae` steps: step 1 is value pretraining (critic.warmup_steps=1), then one
    step per critic replay mode. Returns per step the metrics and how much policy and critic moved,
    and whether the policy's weights stayed bit for bit."""
    from moe_rl.config import RunConfig
    from moe_rl.loop import rl_step
    from moe_rl.trainer import build_run

    cfg = RunConfig.from_dict(cfg_dict)
    built = build_run(cfg, Path(run_dir), int(os.environ["RANK"]))
    run, servers = built["run"], built["servers"]
    out = []
    try:
        for step, replay in enumerate([cfg.critic.replay, *critic_replays], start=1):
            run.cfg = dataclasses.replace(cfg, critic=dataclasses.replace(cfg.critic, replay=replay))
            policy = [p.detach().clone() for c in run.policy.chunks for p in c.parameters()]
            critic = _weights_fingerprint(run.critic)
            metrics = rl_step(run, step)
            after = [p.detach() for c in run.policy.chunks for p in c.parameters()]
            out.append({"replay": replay, "metrics": metrics,
                        "policy_unchanged": all(torch.equal(a, b) for a, b in zip(policy, after)),
                        "critic_change": float((_weights_fingerprint(run.critic) - critic).abs().sum())})
    finally:
        if servers is not None:
            servers.stop()
    return out
