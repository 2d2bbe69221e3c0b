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


def varied_reward(completion_text: str, answer: str | None, *, completion_ids: list[int]) -> float:
    """A reward that differs between almost any two samples (so every group has advantages)."""
    return float(sum(completion_ids) % 5) / 4


def objective_matrix_worker(cfg_dict: dict[str, Any], run_dir: str, combos: list[tuple],
                            then_overlap_and_packed: bool = True) -> list[dict[str, Any]]:
    """For each (loss, replay) pair: one RL step; returns metrics, whether weights moved, and
    what the updates replayed (`replay_check`: "ok" or what differed). A combo's optional third
    item, {field: value} of `algo.rollout_correction.route_mask`, turns the route mask on beside the
    run's rollout correction for that step. Then (unless told not to) overlapped steps, in-place
    pushes and packed micro-batches under R2 and R3."""
    from moe_rl.algo.config import RouteMaskConfig
    from moe_rl.config import RunConfig
    from moe_rl.recipes.build import build_run, inflight_client_args
    from moe_rl.recipes.rl.async_rollouts import AsyncRollouts
    from moe_rl.recipes.rl.rollouts import SyncRollouts
    from moe_rl.recipes.rl.step import rl_step

    cfg = RunConfig.from_dict(cfg_dict)
    rank = int(os.environ["RANK"])
    built = build_run(cfg, Path(run_dir), rank)
    run, servers = built["run"], built["servers"]
    spy = _ReplaySpy(run)
    out = []
    try:
        for step, (loss, replay, *route_mask) in enumerate(combos, start=1):
            algo = dataclasses.replace(cfg.algo, loss=loss, replay=replay)
            if route_mask:
                algo = dataclasses.replace(algo, rollout_correction=dataclasses.replace(
                    algo.rollout_correction, route_mask=RouteMaskConfig(**route_mask[0])))
            run.cfg = dataclasses.replace(cfg, algo=algo)
            before = _weights_fingerprint(run.policy)
            spy.reset()
            metrics = rl_step(run, step)
            moved = _weights_fingerprint(run.policy) - before
            out.append({"loss": loss, "replay": replay, "metrics": metrics, "weight_change": float(moved.abs().sum()),
                        "replay_check": spy.check(replay), "route_mask": bool(route_mask)})
        if not then_overlap_and_packed:
            return out
        # One-step off-policy overlap: the next rollout runs while this step trains.
        run.cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, max_staleness=1, tis_cap=2.0))
        if run.engine is not None:  # every rank that receives samples: rank 0, or each head (rollout.intake)
            run.rollouts = AsyncRollouts(1)
        for step in range(len(combos) + 1, len(combos) + 4):
            out.append({"loss": cfg.algo.loss, "replay": cfg.algo.replay, "overlap": True,
                        "metrics": rl_step(run, step), "weight_change": float("nan")})
        # ... with in-place pushes: the prefetched requests are paused, not waited for
        run.cfg = dataclasses.replace(run.cfg, rollout=dataclasses.replace(cfg.rollout, inflight_update="in_place"))
        if run.engine is not None:
            for key, value in inflight_client_args(run.cfg).items():
                setattr(run.engine, key, value)
        for step in range(len(combos) + 4, len(combos) + 6):
            out.append({"loss": cfg.algo.loss, "replay": cfg.algo.replay, "overlap": True, "in_place": True,
                        "metrics": rl_step(run, step), "weight_change": float("nan")})
        run.cfg = dataclasses.replace(run.cfg, rollout=cfg.rollout)
        if isinstance(run.rollouts, AsyncRollouts):  # synchronous again: the batch asked for ahead is not used
            run.rollouts.reset(run.sampler)
            run.rollouts.close()
            run.rollouts = SyncRollouts()
        if run.engine is not None:  # pushes flush again; the in-place ones left prefixes of older weights cached
            for key, value in inflight_client_args(run.cfg).items():
                setattr(run.engine, key, value)
            run.engine.flush_cache()
        # Packed micro-batches with token-balanced DP shares, under both replay modes.
        packed = dataclasses.replace(cfg.parallel, max_tokens_per_microbatch=PACK_TOKENS)
        run.policy.spec = dataclasses.replace(run.policy.spec, max_tokens_per_microbatch=PACK_TOKENS)
        for step, replay in enumerate(["r2", "r3"], start=len(combos) + 6):
            run.cfg = dataclasses.replace(cfg, parallel=packed, algo=dataclasses.replace(cfg.algo, replay=replay))
            before = _weights_fingerprint(run.policy)
            spy.reset()
            metrics = rl_step(run, step)
            out.append({"loss": cfg.algo.loss, "replay": replay, "packed": True, "metrics": metrics,
                        "weight_change": float((_weights_fingerprint(run.policy) - before).abs().sum()),
                        "replay_check": spy.check(replay)})
    finally:
        if servers is not None:
            servers.stop()
    return out


class _ReplaySpy:
    """Records the old pass and the routes each policy update replays, to check the replay mode."""

    def __init__(self, run: Any) -> None:
        import moe_rl.recipes.rl.step as loop

        self.loop, self.old_pass, self.mine, self.updates = loop, None, None, []
        real_old, real_update = loop.old_logprobs, run.policy.update

        def old_logprobs(run: Any, mine: Any, step: int, first: Any = None) -> Any:
            self.old_pass, self.mine = real_old(run, mine, step, first), mine
            return self.old_pass

        def update(sequences: Any, extras: Any, loss: Any, replay_routes: Any = None) -> Any:
            self.updates.append(replay_routes)
            return real_update(sequences, extras, loss, replay_routes=replay_routes)

        loop.old_logprobs, run.policy.update = old_logprobs, update

    def reset(self) -> None:
        self.old_pass, self.updates = None, []

    def check(self, mode: str) -> str:
        """"ok" when the updates replayed what `mode` promises: nothing (off), the old pass's own
        routes (r2), or the engine's routes in their compact dtype (r3)."""
        old, got = self.old_pass, self.updates
        if mode == "off":
            return "ok" if got and all(r is None for r in got) else "off: an update replayed routes"
        if not got or any(r is None for r in got) or sum(r.shape[0] for r in got) != old.logp.shape[0]:
            return f"{mode}: the updates did not replay one route row per sample"
        if mode == "r2":
            return "ok" if torch.equal(old.replay, old.free_routes) else "r2: replayed routes are not the recorded ones"
        from moe_rl.recipes.rl.replay_health import engine_route_cover

        # the engine's routes stacked [B, T - 1, L, K], in the engine's compact id dtype
        engine = engine_route_cover(self.mine, max(self.mine.lengths()) - 1).routes
        if engine.dtype != torch.uint8:
            return f"r3: engine routes widened to {engine.dtype}"
        return "ok" if torch.equal(old.replay, engine) else "r3: replayed routes are not the engine's"


def _weights_fingerprint(policy: Any) -> torch.Tensor:
    return torch.stack([p.detach().float().sum() for c in policy.chunks for p in c.parameters()])


def sigterm_after_first_step(args: list[str], run_dir: Path, timeout: float = 600.0,
                             signals: tuple[int, ...] | None = None, gap_s: float = 0.2) -> tuple[int, str]:
    """Start `moe-rl train` (`args`: its command line) in a new session, wait until it logged a step
    to `run_dir/metrics.jsonl`, send `signals` (default SIGTERM, `gap_s` apart) to the whole
    process group (as SLURM signals a job step, or a terminal a Ctrl-C), and return its exit code
    and output."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.5)
    for sig in signals or (signal.SIGTERM,):
        os.killpg(proc.pid, sig)
        time.sleep(gap_s)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out
def digit_first_reward(completion_text: str, answer: str | None, **_: Any) -> float:
    """A dense toy reward for critic tests: 1.0 when the completion starts with a digit (10 of 16 tokens)."""
    return 1.0 if completion_text[:1].isdigit() else 0.0


def critic_steps_worker(cfg_dict: dict[str, Any], run_dir: str, critic_replays: list[str]) -> list[dict[str, Any]]:
    """`algo.advantage=gae` steps: step 1 is value pretraining (critic.warmup_steps=1), then one
    step per critic replay mode. Returns per step the metrics and how much policy and critic moved,
    and whether the policy's weights stayed bit for bit."""
    from moe_rl.config import RunConfig
    from moe_rl.recipes.build import build_run
    from moe_rl.recipes.rl.step import rl_step

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
