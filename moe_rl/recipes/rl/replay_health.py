"""Routing replay's health: which tokens replay a route the engine returned (R3 coverage), whether
the engine's MoE layers are the trainer's (the layer-offset check), and the route-mismatch mask.

Where a token can lack an engine route: a sample whose response carried no routes (an aborted
request), rows shorter than the sample (a `routed_experts_start_len` past the prompt's start, a
multi-turn episode whose turns did not cover every position). A row no router produced never gets
here: it was refused where it arrived (`moe_rl.routes.check`), so the rows present are counted, not
checked again. The coverage counts what the replay really
uses: `engine_route_cover` builds both the replayed tensor and the mask of positions holding an
engine route, and positions without one replay the trainer's own routes, never padding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_rl.algo.config import replay_mode, route_mask_bound
from moe_rl.algo.route_mask import route_mask
from moe_rl.drift.metrics import all_reduce_counts, route_stats

# The layer-offset check. Measured on the tiny models (qwen3_moe, mixtral: 5 MoE layers; glm4_moe,
# deepseek_v3: a dense first layer; 4 experts, top-2; two seeds; 384 tokens): a layer's routes
# against its neighbour's in the same forward overlap 0.41 to 0.64 (chance is k/E = 0.5), against
# its own after perturbing the routers by 2% 0.967 to 0.997. A server shifted by one layer turns
# these around: its layer l overlaps the trainer's l +- 1 at the second rate and its own at the
# first. So a neighbour overlap of at least 0.8 (far above chance, which is lower for real
# models: k/E = 8/128) that beats the layer's own by at least 0.25 (the measured gap is 0.33 at
# least) names a shift; agreeing engines never come near it, and real models widen both margins.
NEIGHBOUR_MIN_OVERLAP = 0.8
NEIGHBOUR_MIN_GAP = 0.25
MIN_CHECKED_TOKENS = 32  # fewer compared tokens say nothing either way


class ReplayCoverageError(RuntimeError):
    """Tokens of an R3 step without an engine route to replay (algo.replay_min_coverage)."""


class LayerOffsetError(RuntimeError):
    """The engine's routes of MoE layer l are the trainer's of another layer."""


@dataclass
class EngineRoutes:
    """routes: `[B, W, L, K]` the engine's ids in their compact dtype (zeros where it has none);
    covered: `[B, W, L]` bool, positions whose layer holds a route some router could have produced;
    routed: `[B, W]` bool, the positions the model routes (t < len - 1)."""

    routes: torch.Tensor
    covered: torch.Tensor
    routed: torch.Tensor

    def gaps(self) -> torch.Tensor:
        """`[B, W, L]` bool: routed positions whose layer has no engine route."""
        return self.routed.unsqueeze(-1) & ~self.covered


def sample_cover(routes: torch.Tensor | None, routed: int, num_layers: int) -> torch.Tensor:
    """`[routed, L]` bool: which of a sample's `routed` positions hold, per layer, an engine route: the rows
    the engine returned. Every row there passed `moe_rl.routes.check` where it arrived (a result with rows a
    router cannot produce stops the run, `BadRoutes`), so none is counted again; an id past the policy's
    experts from an engine that did not know their count is refused by the replay's check."""
    out = torch.zeros((routed, num_layers), dtype=torch.bool)
    if routes is not None:
        out[:min(routes.shape[0], routed)] = True
    return out


def engine_route_cover(samples: Any, width: int) -> EngineRoutes:
    """The engine's routes of `samples` stacked to `[B, width, L, K]`, and where they exist."""
    if samples.routes is None or all(r is None for r in samples.routes):
        raise ValueError("algo.replay=r3 and the route mask need routed experts from the rollout engine; "
                         "set rollout.return_routed_experts=true (SGLang: --enable-return-routed-experts)")
    some = next(r for r in samples.routes if r is not None)
    B, (L, K) = len(samples), some.shape[1:]
    routes = torch.zeros((B, width, L, K), dtype=some.dtype)
    covered = torch.zeros((B, width, L), dtype=torch.bool)
    for i, (r, n) in enumerate(zip(samples.routes, samples.lengths())):
        routed = min(n - 1, width)
        if r is not None:
            rows = min(r.shape[0], routed)
            routes[i, :rows] = r[:rows]
        covered[i, :routed] = sample_cover(r, routed, L)
    return EngineRoutes(routes, covered, routed_positions(samples, width))


def routed_positions(samples: Any, width: int) -> torch.Tensor:
    """`[B, width]` bool: the positions the model routes (t < len - 1)."""
    return torch.arange(width).view(1, -1) < (torch.tensor(samples.lengths()) - 1).view(-1, 1)


def coverage(samples: Any, response: torch.Tensor, layer_ids: list[int], min_coverage: float) -> dict[str, float]:
    """`replay/coverage` (response tokens, the least over layers), `replay/coverage_prompt` (the other
    routed tokens: prompt and environment context) and `replay/coverage/layer_XX` (response tokens)
    of an R3 step; ReplayCoverageError when either share is below `min_coverage`, naming the samples
    (their index in the step and their token counts) and the layers. `response`: `[B, W]` bool.
    Sample by sample, with `sample_cover` as the replay uses it."""
    return coverage_of([cover_counts(samples, response, layer_ids)], layer_ids, min_coverage)


def cover_counts(samples: Any, response: torch.Tensor, layer_ids: list[int],
                 index: list[int] | None = None) -> dict[str, Any]:
    """What `coverage_of` needs of these samples (`index`: their places in the step; default 0, 1, ...):
    per layer, the response and other tokens with an engine route, the tokens, and a line for each
    sample with gaps."""
    L = len(layer_ids)
    hits, totals, missing = torch.zeros(2, L, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), []
    for i, (r, n) in enumerate(zip(samples.routes or [None] * len(samples), samples.lengths())):
        cover = sample_cover(r, n - 1, L)                         # [n - 1, L]
        resp = response[i, :n - 1]
        for k, where in enumerate((resp, ~resp)):
            hits[k] += cover[where].sum(0)
            totals[k] += int(where.sum())
        if not bool(cover.all()):
            miss = ~cover.all(-1)
            layers = [layer_ids[j] for j in (~cover).any(0).nonzero().flatten().tolist()]
            where = i if index is None else index[i]
            missing.append(f"sample {where}: {int((miss & resp).sum())} of {int(resp.sum())} response and "
                           f"{int((miss & ~resp).sum())} of {int((~resp).sum())} prompt tokens, layers {layers}")
    return {"hits": hits, "totals": totals, "missing": missing, "samples": len(samples)}


def coverage_of(parts: list[dict[str, Any]], layer_ids: list[int], min_coverage: float) -> dict[str, float]:
    """`coverage`'s metrics (and its error) from the counts of the step's parts (`cover_counts`)."""
    hits, totals = sum(p["hits"] for p in parts), sum(p["totals"] for p in parts)
    missing, count = [m for p in parts for m in p["missing"]], sum(p["samples"] for p in parts)
    share = hits / totals.clamp(min=1).unsqueeze(-1)
    out = {"replay/coverage": float(share[0].min()), "replay/coverage_prompt": float(share[1].min())}
    out |= {f"replay/coverage/layer_{lid:02d}": float(v) for lid, v in zip(layer_ids, share[0].tolist())}
    if min(out["replay/coverage"], out["replay/coverage_prompt"]) < min_coverage:
        more = f" (and {len(missing) - 8} more samples)" if len(missing) > 8 else ""
        raise ReplayCoverageError(
            f"algo.replay=r3: {len(missing)} of {count} samples have tokens without an engine route to "
            f"replay (replay/coverage {out['replay/coverage']:.4f}, replay/coverage_prompt "
            f"{out['replay/coverage_prompt']:.4f} < algo.replay_min_coverage={min_coverage}): "
            + "; ".join(missing[:8]) + more + ". A server returned no routes for a sample (aborted?) or fewer "
            "rows than its tokens (routed_experts_start_len, a multi-turn episode's turns), or rows no router "
            "produced. Fix the engine, or lower algo.replay_min_coverage to replay the trainer's own routes there")
    return out


def replay_routes(engine: EngineRoutes, free: torch.Tensor | None) -> torch.Tensor:
    """What R3 replays: the engine's routes, and the trainer's own free routes where it has none
    (never the zeros it was padded with). Without gaps the engine's tensor itself (compact ids)."""
    if not bool(engine.gaps().any()):
        return engine.routes
    if free is None:
        raise ValueError("R3: tokens without an engine route and no free pass to replay the trainer's own routes "
                         "there (replay_health.free_pass_due)")
    if free.shape[:2] != engine.covered.shape[:2]:
        raise ValueError(f"free routes {tuple(free.shape)} do not match the engine's {tuple(engine.routes.shape)}")
    return torch.where(engine.covered.unsqueeze(-1), engine.routes.long(), free.long())


def check_layer_offset(engine: torch.Tensor, trainer: torch.Tensor, group: Any, layer_ids: list[int]) -> None:
    """LayerOffsetError when the engine's routes of an MoE layer (`[N, L, K]`, compared tokens) agree
    with the trainer's of a neighbouring layer far better than with its own (a server that reads its
    routes at the wrong layer indices, as with dense first layers). Collective over `group`."""
    L = engine.shape[1]
    if L < 2:
        return
    same = route_stats(engine, trainer).all_reduce(group)
    lower = route_stats(engine[:, 1:], trainer[:, :-1]).all_reduce(group)   # engine layer j vs trainer j - 1
    upper = route_stats(engine[:, :-1], trainer[:, 1:]).all_reduce(group)   # engine layer j vs trainer j + 1
    n = int(same.num_tokens)
    if n < MIN_CHECKED_TOKENS:
        return
    overlap = lambda s: (1 - s.layer_volatility_sum / n).tolist()  # noqa: E731
    own, low, up = overlap(same), overlap(lower), overlap(upper)
    for j in range(L):
        for shift, nb in ((-1, low[j - 1] if j >= 1 else None), (1, up[j] if j < L - 1 else None)):
            if nb is not None and nb >= NEIGHBOUR_MIN_OVERLAP and nb - own[j] >= NEIGHBOUR_MIN_GAP:
                raise LayerOffsetError(
                    f"the engine's routes of MoE layer {layer_ids[j]} equal the trainer's layer {layer_ids[j + shift]}"
                    f" (top-k overlap {nb:.3f}) far better than its own (overlap {own[j]:.3f}) over {n} tokens: the "
                    f"server reads its routes {shift:+d} layer off (dense first layers counted, or not, on one side "
                    "only). Replaying them would train every MoE layer on another layer's experts; fix the server's "
                    "layer indices (SGLang's routed_experts are [tokens, num_hidden_layers, topk], dense layers "
                    "included)")


@dataclass
class RouteHealth:
    """keep: `[B, W]` bool of the route mask (None: no mask); metrics: correction/route_*."""

    keep: torch.Tensor | None
    metrics: dict[str, float]


def route_health(run: Any, mine: Any, engine: EngineRoutes | None, free: torch.Tensor | None,
                 response: torch.Tensor) -> RouteHealth:
    """With the engine's and the trainer's free routes of the old pass: the layer-offset check (under
    R3 and with the route mask) and the route mask (algo.rollout_correction.route_mask)."""
    a, policy = run.cfg.algo, run.policy
    bound = route_mask_bound(a)
    if engine is None or free is None or (replay_mode(a) != "r3" and bound is None):
        return RouteHealth(None, {})
    width = engine.routes.shape[1]
    free = free[:, :width]
    layer_ids = list(policy.arch.moe_layers)
    tokens = engine.routed & engine.covered.all(-1)
    check_layer_offset(engine.routes[tokens], free[tokens], policy.dp_group, layer_ids)
    run.drift_state["route_layers_checked"] = True
    if bound is None:
        return RouteHealth(None, {})
    masked = route_mask(engine.routes, free, response, bound, comparable=engine.covered)
    counts = torch.cat([masked.flips.sum((0, 1)), ((~masked.keep) & response).sum().view(1),
                        response.sum().view(1)]).to(torch.int64)
    counts = all_reduce_counts(counts, policy.dp_group).double()
    total = max(float(counts[-1]), 1.0)
    metrics = {"correction/route_masked_frac": float(counts[-2]) / total}
    metrics |= {f"correction/route_flip_frac/layer_{lid:02d}": float(v) / total
                for lid, v in zip(layer_ids, counts[:-2].tolist())}
    return RouteHealth(masked.keep, metrics)


def free_pass_due(run: Any) -> bool:
    """Whether an R3 step runs the trainer's free pass for replay's sake: the first step this process
    runs (the layer-offset check) and, when algo.replay_min_coverage < 1, every step (the tokens
    without an engine route replay the trainer's own). The same on every rank."""
    return not run.drift_state.get("route_layers_checked") or run.cfg.algo.replay_min_coverage < 1.0
