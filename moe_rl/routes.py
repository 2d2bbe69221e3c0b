"""A route: the expert ids a token's router chose, `[..., layers, top_k]`. Everything a route is
lives here, used by the rollout engine, `moe-rl serve`, drift and replay alike:

- its type: the smallest integer type that holds every id, so a route moves between the engine,
  the recorded ones and the drift measurement without a cast that could wrap an id
  (`route_dtype`, `route_np_dtype`, `record_dtype`);
- its rules: `check` refuses routes no router produced (shape, integer ids, ids in range, distinct
  top-k ids, one id across every layer where chance cannot explain it) with `BadRoutes` naming the
  first bad row and layer; `repeated_ids` marks the rows whose top-k repeats an id;
- its wire form: SGLang's `meta_info.routed_experts`, base64 of int32 `[rows, num_hidden_layers, K]`
  with every layer present (dense ones zero), to and from the compact `[rows, MoE layers, K]`
  (`encode_b64`, `decode_b64`);
- where it is checked: once, when an engine's result is made (`GenerateResult`, against the model's
  `Geometry`): the decode and the in-process engine check only that the ids fit the narrow type
  (`compact`), and R3's coverage counts the rows present.

The rules take numpy arrays (the engine's rows) and torch tensors (drift and replay, on the
compute device) alike: both answer the comparisons, `any`, `min`/`max` and `reshape` used here.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["BadRoutes", "Geometry", "RouteWireError", "check", "compact", "decode_b64", "encode_b64",
           "record_dtype", "repeated_ids", "route_dtype", "route_np_dtype"]


class BadRoutes(ValueError):
    """Routes no router produced (`check`). A fault of whoever wrote them, not an outage: retrying or
    waiting for another server does not help, and replaying them would train on experts nobody chose."""


class RouteWireError(ValueError):
    """`routed_experts` that is not SGLang's wire form (not base64, not whole int32, the wrong row count)."""


# ---------------------------------------------------------------- the type

@dataclass
class Geometry:
    """The model's shape as its routes need it: decoder layers, top-k, experts (None: unknown), and which
    decoder layers are MoE (the compact routes' columns, named by these ids in messages)."""

    num_layers: int
    topk: int
    num_experts: int | None
    moe_layers: list[int]


def route_dtype(num_experts: int) -> torch.dtype:
    """Smallest torch dtype holding ids 0 .. num_experts - 1: uint8 <= 256, int16 <= 32768, else int32.

    Ids are never truncated: 257 experts get int16. ValueError for fewer than 1 expert or more than int32.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    for dt in (torch.uint8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dt).max:
            return dt
    raise ValueError(f"num_experts={num_experts} does not fit in int32")


def route_np_dtype(num_experts: int) -> np.dtype:
    """`route_dtype` as numpy names it."""
    return np.dtype(str(route_dtype(num_experts)).removeprefix("torch."))


def record_dtype(num_experts: int) -> torch.dtype:
    """The recording buffer's type: expert id + 1 (0 = not seen on this rank), so `route_dtype` of one id
    more (uint8 up to 255 experts, int16 for DeepSeek-V3's 256 and Kimi-K2's 384)."""
    return route_dtype(num_experts + 1)


# ---------------------------------------------------------------- the rules

# A row whose every MoE layer chose one and the same expert id is refused only where no router
# picks it by chance: one expert per token (k >= 2 repeats are refused anyway) and ids whose
# agreement across L layers has probability at most num_experts^-(L - 1) <= 1e-9 per token.
# Expert indices of different layers are unrelated (any permutation of a layer's experts is the
# same model), so correlated hidden states do not make equal indices likelier; at 1e-9 a step
# of a million tokens refuses a true route with probability 1e-3 at most. Padding and unset
# rows (all zeros) match the rule on every such model.
ALL_ONE_ID_MIN_LAYERS = 4
ALL_ONE_ID_MAX_CHANCE = 1e-9


def repeated_ids(routes: Any) -> Any:
    """`[rows, L]` bool: the token's top-k in that layer repeats an id (a router picks K distinct)."""
    k = routes.shape[-1]
    if k > 16:  # K(K-1)/2 comparisons stop paying against one sort of each row
        ordered = routes.sort(dim=-1).values if torch.is_tensor(routes) else np.sort(routes, axis=-1)
        return (ordered[..., 1:] == ordered[..., :-1]).any(-1)
    # pairwise over the K columns: whole-array comparisons, 3x faster than sorting K <= 8 ids per row
    repeat = routes[..., 0] != routes[..., 0]  # all False, numpy or torch as the routes are
    for i in range(1, k):
        for j in range(i):
            repeat |= routes[..., i] == routes[..., j]
    return repeat


def _first(mask: Any) -> list[int]:
    """The index of the first True entry of a non-empty bool mask."""
    return (mask.nonzero()[0] if torch.is_tensor(mask) else np.argwhere(mask)[0]).tolist()


def _integer(routes: Any) -> bool:
    if torch.is_tensor(routes):
        return not (routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool)
    return np.issubdtype(routes.dtype, np.integer)


def check(routes: Any, num_experts: int | None = None, *, layers: int | None = None, topk: int | None = None,
          batched: bool = False, ids: bool = True, distinct: bool = True,
          layer_names: Sequence[Any] | None = None) -> None:
    """Refuse routes no router produced, with BadRoutes naming the first bad row and layer.

    routes       `[rows, L, K]` (`batched`: `[B, T, L, K]`, rows are B x T) integer expert ids, a numpy
                 array or a torch tensor
    num_experts  ids must lie in [0, num_experts) (when None: only negative ids are refused)
    layers, topk L and K the model has, when known
    ids          check the ids, not only the shape and type (off where only the tokens counted later need
                 valid ids: drift masks first, then checks what it counts)
    distinct     also refuse rows a router cannot produce: an id repeated within one layer's top-k
                 (zeros written as padding repeat 0 when K >= 2), and one id across every layer where
                 chance cannot explain it (ALL_ONE_ID_MAX_CHANCE); off where padding is allowed
                 (a replay batch's rows past each sequence)
    layer_names  the layers' names in messages (default: the MoE column index)
    """
    if not (torch.is_tensor(routes) or isinstance(routes, np.ndarray)):
        raise BadRoutes(f"routes must be a torch.Tensor or numpy array, got {type(routes).__name__}")
    shape = tuple(routes.shape)
    if not _integer(routes):
        raise BadRoutes(f"routes must hold integer expert ids, got dtype {routes.dtype}")
    if len(shape) != (4 if batched else 3):
        want = "[B sequences, T positions, L layers, K top-k]" if batched else "[N tokens, L layers, K top-k]"
        raise BadRoutes(f"routes must be {want}, got shape {shape}")
    if shape[-1] < 1:
        raise BadRoutes(f"routes have top-k K=0 (shape {shape})")
    if layers is not None and shape[-2] != layers:
        raise BadRoutes(f"routes have {shape[-2]} MoE layers (shape {shape}); the model has {layers}")
    if topk is not None and shape[-1] != topk:
        raise BadRoutes(f"routes have top-k K={shape[-1]} (shape {shape}); the model routes each token to {topk}")
    if not ids or (routes.numel() if torch.is_tensor(routes) else routes.size) == 0:
        return
    rows, (L, K) = routes.reshape(-1, *shape[-2:]), shape[-2:]
    name = lambda j: f"layer {layer_names[j]}" if layer_names is not None else f"MoE layer {j}"  # noqa: E731
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0 or (num_experts is not None and hi >= num_experts):
        worst = hi if num_experts is not None and hi >= num_experts else lo
        t, j, _ = _first(rows == worst)
        span = f"[0, {num_experts})" if num_experts is not None else "[0, ...)"
        raise BadRoutes(f"expert id {worst} out of range {span} (first at row {t}, {name(j)}: {rows[t, j].tolist()}; "
                        f"ids {lo}..{hi}" + (f"; the model has num_experts={num_experts})" if num_experts else ")"))
    if not distinct:
        return
    if K > 1:
        repeats = repeated_ids(rows)
        if bool(repeats.any()):
            t, j = _first(repeats)
            raise BadRoutes(f"row {t}, {name(j)} repeats an expert id within its top-{K}: {rows[t, j].tolist()} "
                            f"({int(repeats.any(-1).sum())} of {rows.shape[0]} rows; a router picks {K} distinct "
                            "experts: padding or unset rows written as routes?)")
    elif L >= ALL_ONE_ID_MIN_LAYERS and num_experts is not None \
            and float(num_experts) ** -(L - 1) <= ALL_ONE_ID_MAX_CHANCE:
        flat = rows.reshape(-1, L)
        same = (flat == flat[:, :1]).all(-1)
        if bool(same.any()):
            t = _first(same)[0]
            raise BadRoutes(f"row {t} names expert {int(flat[t, 0])} in all {L} MoE layers ({int(same.sum())} of "
                            f"{flat.shape[0]} rows), which routers of {num_experts} experts do not do by chance: "
                            "padding or unset rows written as routes?")


def compact(ids: Any, num_experts: int | None, layer_names: Sequence[Any] | None = None) -> np.ndarray:
    """Expert ids `[rows, L, K]` as `route_np_dtype(num_experts)` (int32 when the count is unknown), once
    `check` found that they fit (shape, integer ids, range: BadRoutes naming the first bad row instead of a
    narrower dtype wrapping an id around silently). The router's rules (`check`'s `distinct`) run once, on
    the narrow rows, where the engine's result is made (`GenerateResult`), not here as well."""
    arr = np.asarray(ids)
    check(arr, num_experts, layer_names=layer_names, distinct=False)
    return arr.astype(np.int32 if num_experts is None else route_np_dtype(num_experts), copy=False)


# ---------------------------------------------------------------- the wire form (SGLang's)

def encode_b64(routes: Any, moe_layers: Sequence[int], num_hidden_layers: int) -> str:
    """Compact routes `[rows, MoE layers, K]` -> SGLang's base64 of little-endian int32
    `[rows, num_hidden_layers, K]` (dense layers' columns zero)."""
    n, _, k = routes.shape
    full = np.zeros((n, num_hidden_layers, k), dtype="<i4")
    full[:, list(moe_layers), :] = np.asarray(routes)
    return base64.b64encode(full.tobytes()).decode("ascii")


def decode_b64(b64: str, rows: int, num_layers: int, topk: int, moe_layers: Sequence[int],
               num_experts: int | None) -> np.ndarray:
    """SGLang's base64 `routed_experts` of `rows` tokens -> the compact `[rows, MoE layers, K]` (`compact`).
    RouteWireError when it is not the wire form; BadRoutes when an id does not fit."""
    try:  # the str itself (ASCII or refused): no encoded copy of a payload of tens of MB
        raw = binascii.a2b_base64(b64, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise RouteWireError(f"routed_experts is not valid base64: {e}") from None
    if len(raw) % 4:
        raise RouteWireError(f"routed_experts has {len(raw)} bytes, not a whole number of int32")
    arr = np.frombuffer(raw, dtype="<i4")
    want = rows * num_layers * topk
    if arr.size != want:
        per = num_layers * topk
        got = f"{arr.size // per} rows" if arr.size % per == 0 else f"{arr.size} int32 values"
        raise RouteWireError(f"routed_experts has {got}, expected [len(prompt + output) - 1 = {rows}, "
                             f"num_layers = {num_layers}, topk = {topk}] ({want} int32 values)")
    return compact(arr.reshape(rows, num_layers, topk)[:, list(moe_layers), :], num_experts, list(moe_layers))
