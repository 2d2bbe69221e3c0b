"""The old pass of an RL step: pi_old (the trainer's log-probs of the samples before the step's updates,
or the engine's), and the route decisions made with it: which routes the updates replay (R2: the
trainer's own, recorded here; R3: the engine's, with the trainer's where the engine has none), the
trainer's free routes that drift, the route mask and R3's layer check compare with the engine's
(moe_rl/recipes/rl/replay_health.py), and whether the pass runs at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_rl.algo.config import route_mask_bound
from moe_rl.config import replay_mode
from moe_rl.drift.config import step_tokens_due
from moe_rl.recipes.rl.replay_health import engine_route_cover, free_pass_due, replay_routes, route_health
from moe_rl.recipes.rl.run import Run
from moe_rl.samples import Samples, engine_logp_tokens, response_mask


@dataclass
class OldPass:
    """pi_old of the objective, the trainer's pre-update pass, its own routes, the routes to replay."""

    logp: torch.Tensor                 # [B, T - 1] pi_old, the objective's (algo.behaviour)
    trainer_logp: torch.Tensor | None  # [B, T - 1] the trainer's pass (None: not run)
    free_routes: torch.Tensor | None   # [B, T - 1, L, K] chosen by the trainer's routers
    replay: torch.Tensor | None        # routes replayed in the updates (None = replay off)
    route_keep: torch.Tensor | None = None  # [B, T - 1] bool: the route mask's kept tokens (None: no mask)
    metrics: dict[str, float] = field(default_factory=dict)  # correction/route_* of the route mask
    current: torch.Tensor | None = None  # [B] bool: rows whose pi_old is the first update's own pass


def old_logprobs(run: Run, mine: Samples, step: int, first: list[int] | None = None) -> OldPass:
    """pi_old: the trainer's log-probs of the samples before the step's updates (algo.behaviour=
    recompute), or the engine's (engine); the trainer's own free routes where R2 replays them, this
    step measures drift on its tokens, the route mask compares them with the engine's, or R3 checks
    the engine's layers (moe_rl/recipes/rl/replay_health.py). With behaviour=engine the pass runs
    only for those routes.

    `first`: the rows of the step's first update. When pi_old is all the trainer's pass is for, it
    skips them: the first update's forward runs the same weights on them before its optimizer step,
    so its own log-probs, detached, are pi_old there (`OldPass.current`; TRL does the same)."""
    mode, drift, masking = replay_mode(run.cfg.algo), step_tokens_due(run.cfg.drift, step), route_mask_bound(run.cfg.algo)
    engine_pi = run.cfg.algo.behaviour == "engine"
    width = max(mine.lengths()) - 1
    engine = engine_route_cover(mine, width) if mode == "r3" or masking is not None else None
    free_due = drift or masking is not None or (mode == "r3" and free_pass_due(run))
    if engine_pi and mode != "r2" and not free_due:      # nothing needs the trainer: no pass
        return OldPass(engine_logp_tokens(mine, width), None, None, engine.routes if mode == "r3" else None)
    if first is not None and mode == "off" and not free_due and not engine_pi:  # pi_old alone
        return old_pass_after_first(run, mine, first, width)
    if mode == "r3":
        free = run.policy.logprobs(mine.sequences, record_routes=True).routes if free_due else None
        replay = replay_routes(engine, free)          # the engine's; the trainer's own where it has none
        old = run.policy.logprobs(mine.sequences, replay_routes=replay)
    else:
        old = run.policy.logprobs(mine.sequences, record_routes=free_due or mode == "r2")
        free, replay = old.routes, old.routes if mode == "r2" else None
    health = route_health(run, mine, engine, free, response_mask(mine, width).bool())
    pi_old = engine_logp_tokens(mine, old.logp.shape[1]) if engine_pi else old.logp
    return OldPass(pi_old, old.logp, free, replay, health.keep, health.metrics)


def old_pass_after_first(run: Run, mine: Samples, first: list[int], width: int) -> OldPass:
    """pi_old of the rows after the first update's (a pass only with algo.num_minibatches > 1, the
    same on every rank); the first update's rows are `current`, their `logp` a placeholder."""
    current = torch.zeros(len(mine), dtype=torch.bool)
    current[first] = True
    logp = torch.zeros(len(mine), width)
    rest = (~current).nonzero().flatten().tolist()
    if rest:
        got = run.policy.logprobs([mine.sequences[i] for i in rest]).logp
        logp[rest, : got.shape[1]] = got
    return OldPass(logp, None, None, None, current=current)
