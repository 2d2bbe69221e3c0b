"""Routing-drift metrics on plain tensors: route volatility, log-prob mismatch, expert load.

Routes are integer expert ids shaped `[N, L, K]`: N tokens, L MoE layers, K the
router's top-k. Any integer dtype works (uint8 / int16 as stored by replay).
Within one token and layer the K ids form a set: their order does not matter.

Every statistic is kept as SUMS and COUNTS, never as means, so that results
of several microbatches add up with `+`, and data-parallel ranks combine with
`.all_reduce()` into exactly the numbers one process would get from all
tokens. Means are taken only in `.summary()`, which returns the dict of floats
that goes to the metrics sinks. Counts are int64 so that sums stay exact.

Metric keys (prefixes are arguments where the same statistic serves twice):

  drift/volatility, drift/volatility/layer_{i:02d}    routes before vs after an update
  drift/volatility/exact_match, .../tokens_changed_any_layer, .../num_tokens
  drift/rollout_mismatch[...]                          rollout-engine vs trainer routes
  drift/logp_k3, drift/logp_abs_diff, drift/logp_ratio_outside
  drift/load_change, drift/load_change/layer_{i:02d}, drift/load_max_share
  drift/load_max_vio, drift/load_max_vio/layer_{i:02d}  max expert load / mean load - 1
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from moe_rl import routes as route_rules
from moe_rl.dist.devices import to_compute

VOLATILITY = "drift/volatility"
ROLLOUT_MISMATCH = "drift/rollout_mismatch"
LOGPROB_PREFIX = "drift/logp"
LOAD_PREFIX = "drift/load"

# Tokens compared per chunk: bounds the [chunk, L, K, K] comparison tensor
# (65536 x 48 x 8 x 8 booleans is 200 MB) whatever the batch size.
_CHUNK_TOKENS = 1 << 16

# |log p_train - log p_rollout| beyond log 2 means the ratio is outside [1/2, 2].
_LOG2 = math.log(2.0)


class DriftShapeError(ValueError):
    """Inputs to a drift metric do not fit together (shapes, dtypes, id ranges)."""


# --------------------------------------------------------------------- checks
def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_routes(name: str, routes: Tensor, *, ids: bool = False, num_experts: int | None = None,
                  distinct: bool = False) -> None:
    """`routes` is `[N, L, K]` integer ids (moe_rl/routes.py `check`); with `ids` (on the counted tokens:
    padding may hold anything) ids >= 0, below `num_experts` when given, a distinct top-k with `distinct`."""
    if not torch.is_tensor(routes):
        raise DriftShapeError(f"{name} must be a torch.Tensor, got {type(routes).__name__}")
    try:
        route_rules.check(routes, num_experts, ids=ids, distinct=distinct)
    except route_rules.BadRoutes as e:
        raise DriftShapeError(f"{name}: {e}") from None


def _check_pair(before: Tensor, after: Tensor) -> None:
    """Same N, L and K, with a message that names both shapes and the axis that differs."""
    _check_routes("before", before)
    _check_routes("after", after)
    if before.shape == after.shape:
        return
    b, a = _shape(before), _shape(after)
    if b[2] != a[2]:
        raise DriftShapeError(f"top-k differs: before has K={b[2]}, after has K={a[2]} "
                              f"(shapes {b} and {a})")
    if b[1] != a[1]:
        raise DriftShapeError(f"number of MoE layers differs: before has L={b[1]}, after has L={a[1]} "
                              f"(shapes {b} and {a})")
    raise DriftShapeError(f"token count differs: before has N={b[0]}, after has N={a[0]} "
                          f"(shapes {b} and {a})")


def _token_mask(mask: Tensor | None, n: int, device: torch.device, what: str = "routes") -> Tensor:
    """A bool `[n]` mask (all True when None); nonzero entries count as kept."""
    if mask is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    if not torch.is_tensor(mask):
        raise DriftShapeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 1 or mask.shape[0] != n:
        raise DriftShapeError(f"mask must be [N] = [{n}] to match {what}, got shape {_shape(mask)}")
    return mask.to(device=device, dtype=torch.bool)


# ---------------------------------------------------------------- reductions
def _all_reduce_sum(t: Tensor, group: Any = None) -> Tensor:
    """Sum `t` in place over `group` when torch.distributed is initialised; else leave it.

    The sum runs on the compute device (NCCL groups take no host tensors); a host `t`
    gets the result copied back.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        buf = to_compute(t)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        if buf is not t:
            t.copy_(buf)
    return t


def all_reduce_counts(load: Tensor, group: Any = None) -> Tensor:
    """Sum an `expert_load` result `[L, E]` (or any count tensor) over data-parallel ranks.

    In place; returns `load`. A no-op when torch.distributed is not initialised.
    """
    return _all_reduce_sum(load, group)


def _layer_name(prefix: str, i: int, layer_ids: Sequence[int] | None) -> str:
    return f"{prefix}/layer_{(layer_ids[i] if layer_ids is not None else i):02d}"


def _check_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> None:
    if layer_ids is not None and len(layer_ids) != num_layers:
        raise DriftShapeError(f"layer_ids has {len(layer_ids)} entries for {num_layers} MoE layers")


def _ratio(num: float, den: float) -> float:
    """num / den, NaN for an empty denominator (no tokens: no rate, rather than a fake 0)."""
    return num / den if den else float("nan")


# --------------------------------------------------------------- route stats
@dataclass(eq=False)  # tensor fields: == would be ambiguous
class RouteStats:
    """Sums and counts of route changes; add with `+`, combine ranks with `all_reduce()`.

    changed_slots   [L] int64  per layer, sum over tokens of K - |S_before ∩ S_after|
    exact_match     [L] int64  per layer, tokens whose top-k set is unchanged
    changed_any     []  int64  tokens whose set changed in at least one layer
    num_tokens      []  int64  tokens counted (mask applied)
    topk            int        K, so volatility = changed_slots / (K * num_tokens)

    Volatility is kept as integer slot counts: `changed_slots[l] / K` equals
    the sum over tokens of 1 - |S_before ∩ S_after| / K exactly.
    """

    changed_slots: Tensor
    exact_match: Tensor
    changed_any: Tensor
    num_tokens: Tensor
    topk: int

    @classmethod
    def zeros(cls, num_layers: int, topk: int, device: torch.device | str = "cpu") -> "RouteStats":
        """The empty statistic: a start value for accumulating microbatches."""
        z = lambda *s: torch.zeros(s, dtype=torch.int64, device=device)  # noqa: E731
        return cls(z(num_layers), z(num_layers), z(), z(), int(topk))

    @property
    def num_layers(self) -> int:
        return int(self.changed_slots.shape[0])

    @property
    def layer_volatility_sum(self) -> Tensor:
        """[L] float64: per layer, sum over tokens of 1 - |S_before ∩ S_after| / K."""
        return self.changed_slots.double() / self.topk

    def __add__(self, other: "RouteStats") -> "RouteStats":
        if not isinstance(other, RouteStats):
            return NotImplemented
        if other.topk != self.topk or other.num_layers != self.num_layers:
            raise DriftShapeError(f"cannot add RouteStats of L={self.num_layers}, K={self.topk} "
                                  f"and L={other.num_layers}, K={other.topk}")
        return RouteStats(self.changed_slots + other.changed_slots, self.exact_match + other.exact_match,
                          self.changed_any + other.changed_any, self.num_tokens + other.num_tokens,
                          self.topk)

    def __radd__(self, other: Any) -> "RouteStats":
        # lets sum([...]) start from its default 0
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented

    def all_reduce(self, group: Any = None) -> "RouteStats":
        """Sum over the ranks of `group` (default: world), in place; returns self.

        One collective for all fields. A no-op when torch.distributed is not
        initialised, so single-process code calls it unconditionally.
        """
        L = self.num_layers
        flat = torch.cat([self.changed_slots, self.exact_match,
                          self.changed_any.view(1), self.num_tokens.view(1)])
        _all_reduce_sum(flat, group)
        self.changed_slots, self.exact_match = flat[:L].clone(), flat[L:2 * L].clone()
        self.changed_any, self.num_tokens = flat[2 * L].clone(), flat[2 * L + 1].clone()
        return self

    def per_layer(self) -> list[dict[str, float]]:
        """One dict per MoE layer: `volatility` and `exact_match` (means over tokens)."""
        n = int(self.num_tokens)
        vol = self.layer_volatility_sum.tolist()
        exact = self.exact_match.tolist()
        return [{"volatility": _ratio(v, n), "exact_match": _ratio(e, n)} for v, e in zip(vol, exact)]

    def summary(self, prefix: str = VOLATILITY, layer_ids: Sequence[int] | None = None) -> dict[str, float]:
        """Means as floats, keyed under `prefix`.

        `{prefix}`                            volatility: mean over layers and tokens
        `{prefix}/exact_match`                share of (token, layer) pairs with an unchanged set
        `{prefix}/tokens_changed_any_layer`   share of tokens with a changed set in some layer
        `{prefix}/layer_{i:02d}`              volatility of MoE layer i (i from `layer_ids`
                                              when given, e.g. HF layer indices; else 0..L-1)
        `{prefix}/num_tokens`                 tokens counted
        Rates are NaN when no token was counted.
        """
        _check_layer_ids(layer_ids, self.num_layers)
        n = int(self.num_tokens)
        pairs = n * self.num_layers
        out = {
            prefix: _ratio(float(self.layer_volatility_sum.sum()), pairs),
            f"{prefix}/exact_match": _ratio(float(self.exact_match.sum()), pairs),
            f"{prefix}/tokens_changed_any_layer": _ratio(float(self.changed_any), n),
        }
        for i, row in enumerate(self.per_layer()):
            out[_layer_name(prefix, i, layer_ids)] = row["volatility"]
        out[f"{prefix}/num_tokens"] = float(n)
        return out


def _overlap(before: Tensor, after: Tensor) -> Tensor:
    """|S_before ∩ S_after| per token and layer, `[n, L]` int64, for distinct ids.

    A K x K equality table: each id of `before` is found in `after` or not,
    so the order inside a top-k never matters.
    """
    dt = torch.promote_types(before.dtype, after.dtype)  # uint8 vs int16 compares as int16
    hit = before.to(dt).unsqueeze(-1) == after.to(dt).unsqueeze(-2)  # [n, L, K, K]
    return hit.any(dim=-1).sum(dim=-1)


def route_stats(before: Tensor, after: Tensor, mask: Tensor | None = None,
                num_experts: int | None = None) -> RouteStats:
    """Compare two routings of the same tokens.

    before, after  [N, L, K] integer expert ids (any int dtype), distinct within a top-k
    mask           [N] bool (or 0/1), tokens to count; None counts all
    num_experts    when given, ids must lie in [0, num_experts)

    Use `before`/`after` for routes around an optimizer step (`summary(VOLATILITY)`)
    and rollout/trainer routes for the engine mismatch (`summary(ROLLOUT_MISMATCH)`).
    Validation looks only at counted tokens, so padding may hold anything.
    """
    _check_pair(before, after)
    N, L, K = before.shape
    keep = _token_mask(mask, N, before.device)
    stats = RouteStats.zeros(L, K, before.device)
    for start in range(0, N, _CHUNK_TOKENS):
        sl = slice(start, start + _CHUNK_TOKENS)
        k = keep[sl]
        b, a = before[sl][k], after[sl][k.to(after.device)].to(before.device)
        stats = stats + _chunk_stats(b, a, num_experts)
    return stats


def _chunk_stats(before: Tensor, after: Tensor, num_experts: int | None) -> RouteStats:
    """RouteStats of counted tokens `[n, L, K]` (already masked)."""
    for name, r in (("before", before), ("after", after)):
        _check_routes(name, r, ids=True, num_experts=num_experts, distinct=True)
    n, L, K = before.shape
    same = _overlap(before, after)               # [n, L]
    exact = same == K                             # [n, L]
    return RouteStats(
        changed_slots=(K - same).sum(dim=0),
        exact_match=exact.sum(dim=0),
        changed_any=(~exact).any(dim=1).sum(),
        num_tokens=torch.tensor(n, dtype=torch.int64, device=before.device),
        topk=K,
    )


# ---------------------------------------------------------- log-prob mismatch
@dataclass(eq=False)
class LogprobStats:
    """Sums and counts of the trainer-vs-rollout log-prob gap; add with `+`, reduce with `all_reduce()`.

    k3_sum        [] float64  sum of exp(d) - 1 - d, d = log p_train - log p_rollout
    abs_diff_sum  [] float64  sum of |d|
    outside       [] int64    tokens with p_train / p_rollout outside [1/2, 2]
    num_tokens    [] int64    tokens counted
    """

    k3_sum: Tensor
    abs_diff_sum: Tensor
    outside: Tensor
    num_tokens: Tensor

    @classmethod
    def zeros(cls, device: torch.device | str = "cpu") -> "LogprobStats":
        f = torch.zeros((), dtype=torch.float64, device=device)
        i = torch.zeros((), dtype=torch.int64, device=device)
        return cls(f, f.clone(), i, i.clone())

    def __add__(self, other: "LogprobStats") -> "LogprobStats":
        if not isinstance(other, LogprobStats):
            return NotImplemented
        return LogprobStats(self.k3_sum + other.k3_sum, self.abs_diff_sum + other.abs_diff_sum,
                            self.outside + other.outside, self.num_tokens + other.num_tokens)

    def __radd__(self, other: Any) -> "LogprobStats":
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented

    def all_reduce(self, group: Any = None) -> "LogprobStats":
        """Sum over the ranks of `group`, in place; returns self. No-op without torch.distributed."""
        # float64 carries the int64 counts exactly up to 2**53 tokens: one collective suffices.
        flat = torch.stack([self.k3_sum, self.abs_diff_sum, self.outside.double(), self.num_tokens.double()])
        _all_reduce_sum(flat, group)
        self.k3_sum, self.abs_diff_sum = flat[0].clone(), flat[1].clone()
        self.outside, self.num_tokens = flat[2].round().long(), flat[3].round().long()
        return self

    def summary(self, prefix: str = LOGPROB_PREFIX) -> dict[str, float]:
        """`{prefix}_k3`, `{prefix}_abs_diff`, `{prefix}_ratio_outside` (means; NaN without tokens)."""
        n = int(self.num_tokens)
        return {
            f"{prefix}_k3": _ratio(float(self.k3_sum), n),
            f"{prefix}_abs_diff": _ratio(float(self.abs_diff_sum), n),
            f"{prefix}_ratio_outside": _ratio(float(self.outside), n),
        }


def logprob_mismatch(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None) -> LogprobStats:
    """Log-prob gap between the trainer and the rollout engine on the rollout's tokens.

    train_logp, rollout_logp  [...] (e.g. [B, T]) log-probs of the same sampled tokens
    mask                      same shape, bool or 0/1; None counts every position

    With d = log p_train - log p_rollout (= log r, r = p_train / p_rollout):
      k3 = r - 1 - log r = exp(d) - 1 - d  estimates KL(π_rollout || π_train) without bias,
           because the tokens were sampled by the rollout engine; it is >= 0 per token
           (the same convention as `moe_rl.algo.kl.kl_estimate` with log_ratio = -d).
      abs_diff = |d|;  ratio_outside: r < 1/2 or r > 2, i.e. |d| > log 2.
    Computed in float64 and not clamped: a metric should show an extreme token, not hide it.
    Masked positions may hold anything (padding's -inf or NaN is ignored).
    """
    for name, t in (("train_logp", train_logp), ("rollout_logp", rollout_logp)):
        if not torch.is_tensor(t) or not t.is_floating_point():
            raise DriftShapeError(f"{name} must be a floating-point tensor")
    if train_logp.shape != rollout_logp.shape:
        raise DriftShapeError(f"train_logp has shape {_shape(train_logp)}, rollout_logp has shape "
                              f"{_shape(rollout_logp)}: they must match")
    if mask is not None and (not torch.is_tensor(mask) or mask.shape != train_logp.shape):
        got = _shape(mask) if torch.is_tensor(mask) else type(mask).__name__
        raise DriftShapeError(f"mask has shape {got}, log-probs have shape {_shape(train_logp)}: they must match")
    keep = torch.ones_like(train_logp, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    d = (train_logp.double() - rollout_logp.to(train_logp.device).double())[keep.to(train_logp.device)]
    return LogprobStats(
        k3_sum=(torch.expm1(d) - d).sum(),  # expm1: exact for the tiny d of a well-matched engine
        abs_diff_sum=d.abs().sum(),
        outside=(d.abs() > _LOG2).sum(),
        num_tokens=torch.tensor(d.numel(), dtype=torch.int64, device=d.device),
    )


# ---------------------------------------------------------------- expert load
def expert_load(routes: Tensor, num_experts: int, mask: Tensor | None = None) -> Tensor:
    """Tokens routed to each expert, per layer: `[L, E]` int64.

    routes  [N, L, K] integer expert ids in [0, num_experts)
    mask    [N] tokens to count; None counts all
    A token adds 1 to each of its K experts, so each row sums to K * tokens.
    Add results of microbatches with `+`; combine ranks with `all_reduce_counts`.
    """
    _check_routes("routes", routes)
    if num_experts < 1:
        raise DriftShapeError(f"num_experts must be >= 1, got {num_experts}")
    N, L, K = routes.shape
    keep = _token_mask(mask, N, routes.device)
    ids = routes[keep].long()                      # [n, L, K]
    _check_routes("routes", ids, ids=True, num_experts=num_experts)
    # one bincount over (layer, expert) pairs flattened to layer * E + expert
    layer = torch.arange(L, device=ids.device).view(1, L, 1)
    flat = (layer * num_experts + ids).reshape(-1)
    return torch.bincount(flat, minlength=L * num_experts).view(L, num_experts)


def _shares(load: Tensor) -> Tensor:
    """Per-layer distribution `[L, E]` float64; rows without tokens become NaN."""
    load = load.double()
    return load / load.sum(dim=-1, keepdim=True)


def load_change(prev: Tensor, cur: Tensor, layer_ids: Sequence[int] | None = None,
                prefix: str = LOAD_PREFIX) -> dict[str, float]:
    """How the expert load moved between two steps, from `expert_load` counts.

    prev, cur  [L, E] token counts (the same tokens or not: only shares are compared)

    `{prefix}_change/layer_{i:02d}`  total-variation distance 1/2 * sum_e |p_e - q_e| between
                                     the layer's normalised loads, in [0, 1]
    `{prefix}_change`                mean of those over layers
    `{prefix}_max_share`             the largest share any expert takes in `cur`, over all
                                     layers (1/E is perfect balance; 1 is one expert for all)
    A layer that saw no tokens in either tensor gives NaN.
    """
    for name, t in (("prev", prev), ("cur", cur)):
        if not torch.is_tensor(t) or t.dim() != 2:
            got = _shape(t) if torch.is_tensor(t) else type(t).__name__
            raise DriftShapeError(f"{name} must be an [L, E] load tensor, got {got}")
    if prev.shape != cur.shape:
        raise DriftShapeError(f"prev has shape {_shape(prev)}, cur has shape {_shape(cur)}: "
                              f"loads must cover the same layers and experts")
    L = int(cur.shape[0])
    _check_layer_ids(layer_ids, L)
    p, q = _shares(prev), _shares(cur.to(prev.device))
    tv = 0.5 * (p - q).abs().sum(dim=-1)          # [L]
    out = {f"{prefix}_change": float(tv.mean()) if L else float("nan")}
    for i, v in enumerate(tv.tolist()):
        out[_layer_name(f"{prefix}_change", i, layer_ids)] = v
    seen = q[~q.isnan()]  # layers without tokens have no shares
    out[f"{prefix}_max_share"] = float(seen.max()) if seen.numel() else float("nan")
    return out


def load_violation(load: Tensor, layer_ids: Sequence[int] | None = None,
                   prefix: str = LOAD_PREFIX) -> dict[str, float]:
    """How far the busiest expert is above an even share, per layer, from `expert_load` counts.

    load  [L, E] token counts of one step (summed over ranks)

    `{prefix}_max_vio/layer_{i:02d}`  max_e load_e / mean_e load_e - 1: 0 is perfect balance,
                                      E - 1 is every token on one expert (the load-balance
                                      `max_vio` verl logs, so runs compare across frameworks)
    `{prefix}_max_vio`                the largest of those over layers
    A layer that saw no tokens gives NaN (no load, no imbalance).
    """
    if not torch.is_tensor(load) or load.dim() != 2 or load.shape[1] < 1:
        got = _shape(load) if torch.is_tensor(load) else type(load).__name__
        raise DriftShapeError(f"load must be an [L, E] load tensor with E >= 1, got {got}")
    L = int(load.shape[0])
    _check_layer_ids(layer_ids, L)
    load = load.double()
    mean = load.mean(dim=-1)
    vio = torch.where(mean > 0, load.max(dim=-1).values / mean - 1.0, torch.full_like(mean, float("nan")))
    seen = vio[~vio.isnan()]
    out = {f"{prefix}_max_vio": float(seen.max()) if seen.numel() else float("nan")}
    for i, v in enumerate(vio.tolist()):
        out[_layer_name(f"{prefix}_max_vio", i, layer_ids)] = v
    return out


def confidence_summary(sums: Tensor, num_tokens: float, layer_ids: Sequence[int] | None = None,
                       prefix: str = "drift/route") -> dict[str, float]:
    """Routers' confidence on a step's tokens, from per-layer sums.

    sums  [L, 2]: per MoE layer, the sum over tokens of the top-k gate mass and of the margin
          between the k-th and (k+1)-th router logit (see `moe_rl.policy.replay.route_confidence`)
    `{prefix}_margin`, `{prefix}_gate_mass`: means over layers and tokens;
    `{prefix}_margin/layer_{i:02d}`, `{prefix}_gate_mass/layer_{i:02d}`: per layer. NaN without tokens.
    """
    _check_layer_ids(layer_ids, int(sums.shape[0]))
    out: dict[str, float] = {}
    for column, name in ((1, f"{prefix}_margin"), (0, f"{prefix}_gate_mass")):
        per_layer = [_ratio(float(v), num_tokens) for v in sums[:, column]]
        out[name] = _ratio(float(sums[:, column].sum()), num_tokens * len(per_layer))
        out |= {_layer_name(name, i, layer_ids): v for i, v in enumerate(per_layer)}
    return out
