"""What every training step shares (the RL step, the critic's stage, the DPO step): phase timing, the
response mask, loss metrics combined over micro-batches and ranks, the probe set's route volatility."""
from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.drift.metrics import route_stats
from moe_rl.policy.policy import Policy


class Stopwatch:
    """Seconds spent in each phase of a step (`perf/<phase>_s`) and in total (`perf/step_s`)."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[f"perf/{name}_s"] = now - self.last
        self.last = now

    def total(self) -> float:
        return time.monotonic() - self.start

    def metrics(self) -> dict[str, float]:
        return self.laps | {"perf/step_s": self.total()}


# Loss metrics that are shares of a globally normalised total (summed over microbatches
# and ranks), extremes, and the rest: means over tokens (weighted by loss/num_tokens).
_SHARES = ("loss/pg_loss", "loss/kl_loss", "loss/num_tokens", "loss/num_seqs", "loss/ntp_loss", "critic/value_loss")
_EXTREMES = {"loss/ratio_min": -1.0, "loss/ratio_max": 1.0,  # sign: reduced with MAX of sign * value
             "correction/ratio_min": -1.0, "correction/ratio_max": 1.0}


def combine_loss_metrics(policy: Policy, microbatches: list[dict[str, float]]) -> dict[str, float]:
    """One minibatch's loss metrics over all its microbatches and data-parallel ranks.

    Collective over all ranks. Ranks whose metrics do not count (`policy.reports_loss`:
    earlier pipeline stages, TP copies) contribute nothing.
    """
    rows = microbatches if policy.reports_loss else []
    keys = all_keys({k for d in rows for k in d})
    means = [k for k in keys if k not in _SHARES and k not in _EXTREMES]
    shares = [k for k in keys if k in _SHARES]
    extremes = [k for k in keys if k in _EXTREMES]
    weight = [d.get("loss/num_tokens", 0.0) for d in rows]
    sums = [sum(d.get(k, 0.0) for d in rows) for k in shares]
    sums += [sum(d.get(k, 0.0) * w for d, w in zip(rows, weight)) for k in means] + [sum(weight)]
    top = [max((_EXTREMES[k] * d[k] for d, w in zip(rows, weight) if w > 0 and k in d), default=-math.inf)
           for k in extremes]
    sums = policy.all_reduce_sum(torch.tensor(sums, dtype=torch.float64), group="world").tolist()
    top = policy.all_reduce_max(torch.tensor(top, dtype=torch.float64), group="world").tolist()
    total = sums.pop()
    out = dict(zip(shares, sums[: len(shares)]))
    out |= {k: v / total if total > 0 else 0.0 for k, v in zip(means, sums[len(shares):])}
    out |= {k: _EXTREMES[k] * v if math.isfinite(v) else 0.0 for k, v in zip(extremes, top)}
    return out


def all_keys(mine: set[str]) -> list[str]:
    """The union of every rank's metric names, sorted (ranks without metrics have none)."""
    if not dist.is_initialized():
        return sorted(mine)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(mine))
    return sorted(set().union(*every))


def mean_metrics(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted mean of per-minibatch metrics (`loss/num_tokens` is the weight); counts
    add up, extremes stay extremes."""
    total: dict[str, float] = {}
    weight: dict[str, float] = {}
    for d in dicts:
        w = d.get("loss/num_tokens", 1.0) or 0.0
        for k, v in d.items():
            if k in _EXTREMES:
                total[k] = (max if _EXTREMES[k] > 0 else min)(total.get(k, v), v)
                weight[k] = 1.0
            elif k in ("loss/num_tokens", "loss/num_seqs"):
                total[k] = total.get(k, 0.0) + v
                weight[k] = 1.0
            else:
                total[k] = total.get(k, 0.0) + w * v
                weight[k] = weight.get(k, 0.0) + w
    return {k: total[k] / weight[k] if weight[k] else 0.0 for k in total}


def probe_routes(policy: Policy, probe: list[torch.Tensor]) -> torch.Tensor:
    """Routes `[N, L, K]` of every routed token of the `probe` sequences under the current weights."""
    routes = policy.logprobs(probe, record_routes=True).routes
    lengths = torch.tensor([s.shape[0] for s in probe])
    return routes[torch.arange(routes.shape[1]).view(1, -1) < (lengths - 1).view(-1, 1)]


def probe_volatility(policy: Policy, state: dict[str, Any]) -> dict[str, float]:
    """Routes of the probe sequences `state["probe"]` against those of the previous call
    (`state["probe_routes"]`, then replaced); {} on the first call. Collective over DP ranks."""
    routes = probe_routes(policy, state["probe"])
    out = {}
    if getattr(state.get("probe_routes"), "ndim", 0) == 3:  # [N, L, K] (older checkpoints kept [B, T - 1, L, K])
        out = route_stats(state["probe_routes"], routes).all_reduce(policy.dp_group).summary(
            "drift/probe_volatility", list(policy.arch.moe_layers))
    state["probe_routes"] = routes
    return out
