"""The RL step's drift views (`drift.*`): how far expert routing moves, measured on the step's own tokens
and on a fixed probe set, and cut by what the step's data carries: across its updates
(`drift/volatility`, per update), engine against trainer (`drift/rollout_mismatch`, log-prob mismatch),
by staleness (asynchronous runs: per version a token is behind), by episode turn (multi-turn), and the
experts' load. The statistics themselves are moe_rl/drift/metrics.py's; this module picks the tokens.
"""
from __future__ import annotations

from typing import Any

import torch

from moe_rl.algo.config import staleness_bound
from moe_rl.drift.config import step_tokens_due
from moe_rl.drift.metrics import (confidence_summary, expert_load, load_change, load_violation, logprob_mismatch,
                                  route_stats)
from moe_rl.recipes.common import probe_routes, probe_volatility
from moe_rl.recipes.rl.old_pass import OldPass
from moe_rl.recipes.rl.replay_health import engine_route_cover
from moe_rl.rollout.config import pause_mode
from moe_rl.recipes.rl.run import Run
from moe_rl.samples import Samples, engine_logp_tokens, response_mask


def measure_drift(run: Run, mine: Samples, old: OldPass, step: int) -> dict[str, float]:
    """Route volatility across the step's updates, engine-vs-trainer mismatch, expert load, probe set."""
    d = run.cfg.drift
    if not d.enabled:
        return {}
    out = probe_drift(run, mine, step) if step % d.probe_every == 0 else {}
    if staleness_bound(run.cfg.algo):
        out |= volatility_by_staleness(run, mine)
    if step_tokens_due(run.cfg.drift, step):
        out |= step_drift(run, mine, old)
    return out


def probe_set(run: Run, mine: Samples) -> list[torch.Tensor]:
    """The fixed probe sequences: this rank's first samples of the first step that measured drift."""
    state = run.drift_state
    if "probe" not in state:
        state["probe"] = [s.clone() for s in mine.sequences[: run.cfg.drift.probe_size]]
    return state["probe"]


def probe_drift(run: Run, mine: Samples, step: int) -> dict[str, float]:
    """Volatility on the probe set since the last probe (`drift.probe_every` steps)."""
    probe_set(run, mine)
    return probe_volatility(run.policy, run.drift_state)


def volatility_by_staleness(run: Run, mine: Samples) -> dict[str, float]:
    """`drift/volatility_by_staleness/k`, k = 1..algo.max_staleness: the trainer's routes on the probe
    set under the weights just pushed against its routes under the weights k versions before, per
    layer; how far routing moves across the versions a trained token may be behind. One probe
    forward per step keeps the routes of the last K versions (`drift_state["probe_history"]`)."""
    history = run.drift_state.setdefault("probe_history", [])  # oldest first, one per version
    routes = probe_routes(run.policy, probe_set(run, mine))
    out: dict[str, float] = {}
    for k, past in enumerate(reversed(history), start=1):
        out |= route_stats(past, routes).all_reduce(run.policy.dp_group).summary(
            f"drift/volatility_by_staleness/{k}", list(run.policy.arch.moe_layers))
    history.append(routes)
    del history[:-staleness_bound(run.cfg.algo)]
    return out


class PerUpdateVolatility:
    """Probe-set volatility across each optimizer update of a step, averaged over the step's
    updates (`drift/volatility_per_update`); `drift/volatility` spans all of them."""

    def __init__(self, run: Run, mine: Samples) -> None:
        self.policy, self.probe = run.policy, probe_set(run, mine)
        self.routes = probe_routes(self.policy, self.probe)
        self.stats: Any = None

    def after_update(self) -> None:
        routes = probe_routes(self.policy, self.probe)
        stats = route_stats(self.routes, routes)
        self.stats, self.routes = stats if self.stats is None else self.stats + stats, routes

    def metrics(self) -> dict[str, float]:
        return self.stats.all_reduce(self.policy.dp_group).summary(
            "drift/volatility_per_update", list(self.policy.arch.moe_layers))


def step_drift(run: Run, mine: Samples, old: OldPass) -> dict[str, float]:
    """Drift on the step's own tokens: before the first vs after the last optimizer step."""
    arch = run.policy.arch
    width = old.logp.shape[1]
    lengths = torch.tensor(mine.lengths())
    tokens = torch.arange(width).view(1, -1) < (lengths - 1).view(-1, 1)  # every routed token
    passed = run.policy.logprobs(mine.sequences, record_routes=True, route_confidence=True)
    after = passed.routes
    flat = lambda r: r[:, :width][tokens]  # noqa: E731  [N, L, K]
    layer_ids = list(arch.moe_layers)
    trainer, after = flat(old.free_routes), flat(after)  # the routed tokens' routes before / after the updates
    out = route_stats(trainer, after).all_reduce(run.policy.dp_group).summary("drift/volatility", layer_ids)
    conf = flat(passed.route_confidence).double()  # [N, L, 2]
    sums = run.policy.all_reduce_sum(torch.cat([conf.sum(0).flatten(), torch.tensor([float(conf.shape[0])])]))
    out |= confidence_summary(sums[:-1].view(-1, 2), float(sums[-1]), layer_ids)
    resp, engine_logp = response_mask(mine, width).bool(), engine_logp_tokens(mine, width)
    engine, have = None, None
    if mine.routes is not None and any(r is not None for r in mine.routes):
        cover = engine_route_cover(mine, width)
        engine, have = flat(cover.routes), flat(cover.covered).all(-1)  # tokens the engine has routes for
        out |= route_stats(engine, trainer, mask=have).all_reduce(run.policy.dp_group).summary(
            "drift/rollout_mismatch", layer_ids)
        if mine.versions is not None and staleness_bound(run.cfg.algo):
            out |= drift_by_staleness(run, mine, old, engine, trainer, tokens, resp, engine_logp, have)
    if mine.action_masks is not None:  # multi-turn episodes: late turns are where off-policy routing compounds
        out |= drift_by_turn(run, mine, old, trainer, after, engine, tokens, resp, engine_logp, have)
    out |= logprob_mismatch(old.trainer_logp[resp], engine_logp[resp]).all_reduce(run.policy.dp_group).summary()
    load = run.policy.all_reduce_sum(expert_load(after, arch.num_moe_experts).to(torch.float64))
    out |= load_violation(load, layer_ids)
    if "load" in run.drift_state:
        out |= load_change(run.drift_state["load"], load, layer_ids)
    run.drift_state["load"] = load
    return out


def position_lags(mine: Samples, width: int, version: int, *, retracted: bool = False) -> torch.Tensor:
    """`[B, width]`: how many versions behind `version` the weights were that computed each position.
    Position t >= P - 1 is the forward that produced completion token t - P + 1 (its route and the
    log-prob of that token); the prompt's positions, the prefill, go with the first; -1 past the sample.
    `retracted`: the routes of samples whose every push retracted them (rollout.inflight_update=retract):
    each push prefilled all earlier positions again, so every route is the last version's."""
    out = torch.full((len(mine), width), -1, dtype=torch.long)
    for i, (p, v) in enumerate(zip(mine.prompt_lens.tolist(), mine.versions)):
        if v.numel():
            lag = version - v.long()
            lag = lag[-1:].expand_as(lag) if retracted else lag
            end = min(p - 1 + lag.numel(), width)
            out[i, :max(p - 1, 0)] = lag[0]
            out[i, p - 1:end] = lag[: end - (p - 1)]
    return out


def drift_by_staleness(run: Run, mine: Samples, old: OldPass, engine: torch.Tensor, trainer: torch.Tensor,
                       tokens: torch.Tensor, resp: torch.Tensor, engine_logp: torch.Tensor,
                       have: torch.Tensor) -> dict[str, float]:
    """Engine-vs-trainer routes (`engine`, `trainer`: [N, L, K] of the routed `tokens`) and log-probs
    (`old.trainer_logp`, `engine_logp`: [B, width]) of the step's tokens by k = 0..algo.max_staleness, how many
    versions older than the old pass's (this step's weights before its updates) the weights that
    generated them were: how far an MoE's routing moves per version of staleness. `have` [N]: the
    routed tokens with an engine route."""
    version, width, k_max = run.weight_version - 1, resp.shape[1], staleness_bound(run.cfg.algo)
    lags, out = position_lags(mine, width, version), {}
    route_lags = position_lags(mine, width, version, retracted=pause_mode(run.cfg.rollout, k_max) == "retract")
    for k in range(k_max + 1):
        at_lag = (route_lags[tokens] == k) & have
        out |= route_stats(engine, trainer, mask=at_lag).all_reduce(run.policy.dp_group).summary(
            f"drift/rollout_mismatch_by_staleness/{k}", list(run.policy.arch.moe_layers))
        at = resp & (lags == k)
        logp = logprob_mismatch(old.trainer_logp[at], engine_logp[at]).all_reduce(run.policy.dp_group).summary("x")
        out |= {f"drift/logp_by_staleness/{k}/{name[2:]}": v for name, v in logp.items()}
    return out


def position_turns(mine: Samples, width: int) -> torch.Tensor:
    """`[B, width]`: the episode turn of the token at each position: the prompt's and an environment's
    opening ids turn 0, model turn t's tokens and the environment's answer to them turn t; -1 past it."""
    out = torch.full((len(mine), width), -1, dtype=torch.long)
    for i, (p, action, n) in enumerate(zip(mine.prompt_lens.tolist(), mine.action_masks, mine.lengths())):
        starts = action & ~torch.cat([torch.zeros(1, dtype=torch.bool), action[:-1]])  # a model turn begins
        turn = (starts.long().cumsum(0) - 1).clamp(min=0)
        out[i, :min(p, width)] = 0
        out[i, p:min(n, width)] = turn[: max(min(n, width) - p, 0)]
    return out


CONTEXT, NO_ROW = -1, -2  # route_turns' values for rows of no model turn, and for positions past a sample


def route_turns(mine: Samples, width: int) -> torch.Tensor:
    """`[B, width]`: the model turn each route row counts for in `drift_by_turn`.

    Row t is the forward of token t and computes the distribution of token t + 1, which is where
    routing acts on the model's actions: a row counts as model turn k when token t + 1 is one of
    turn k's tokens (the forwards turn k's tokens were sampled from, from the last token before the
    turn to its last but one; the rows of the response mask, as `drift/logp_by_turn`). A row whose
    next token is the prompt's or an environment's reads context forward and samples nothing (the
    prompt's positions but its last, each turn's last token, an answer's tokens but its last): it
    counts as CONTEXT, in no turn, so that a turn's figures are its own tokens' and not the prompt's
    or the tool output's. NO_ROW past each sample's routed positions (its last token has no row).
    (Counting a row as the turn of its own token instead would leave a turn that ends the episode
    with one token, its last, without a row, and put the prompt's rows into turn 0.)
    """
    routed = torch.arange(width).view(1, -1) < (torch.tensor(mine.lengths()) - 1).view(-1, 1)
    own = position_turns(mine, width + 1)[:, 1:]  # the turn of token t + 1 (model tokens'; context's aside)
    return torch.where(response_mask(mine, width).bool(), own, torch.where(routed, CONTEXT, NO_ROW))


def drift_by_turn(run: Run, mine: Samples, old: OldPass, before: torch.Tensor, after: torch.Tensor,
                  engine: torch.Tensor | None, tokens: torch.Tensor, resp: torch.Tensor,
                  engine_logp: torch.Tensor, have: torch.Tensor | None = None) -> dict[str, float]:
    """By episode turn t = 0..rollout.max_turns - 1: the step's volatility (`before` / `after` the
    updates: [N, L, K] of the routed `tokens`), the engine-vs-trainer route mismatch (`engine` vs
    `before`, None without engine routes; `have` [N]: the tokens it has routes for) and log-prob mismatch
    of the model's tokens of turn t; the rows of the prompt and the environment's answers apart, as
    `drift/*_by_turn/context` (which rows count where: `route_turns`)."""
    width, layers, group = resp.shape[1], list(run.policy.arch.moe_layers), run.policy.dp_group
    rows = route_turns(mine, width)
    routed = rows[tokens]  # the turn of each routed token's row, as `before` / `after` / `engine` are ordered
    out = {}
    for t, name in [(t, str(t)) for t in range(run.cfg.rollout.max_turns)] + [(CONTEXT, "context")]:
        out |= route_stats(before, after, mask=routed == t).all_reduce(group).summary(
            f"drift/volatility_by_turn/{name}", layers)
        if engine is not None:
            out |= route_stats(engine, before, mask=(routed == t) & have).all_reduce(group).summary(
                f"drift/rollout_mismatch_by_turn/{name}", layers)
        if t != CONTEXT:  # the context's tokens were not sampled: no log-probs to compare
            at = rows == t
            logp = logprob_mismatch(old.trainer_logp[at], engine_logp[at]).all_reduce(group).summary("x")
            out |= {f"drift/logp_by_turn/{t}/{key[2:]}": v for key, v in logp.items()}
    return out
