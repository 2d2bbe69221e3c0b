"""Routing replay (R2, R3) over megatron-core's `RouterReplay`.

Routes travel between stages as one tensor per data-parallel shard:
`routes[b, t, l, k]` = the k-th expert chosen for token t of sequence b in the
l-th MoE layer, for t < len_b - 1 (the last token of a sequence is never routed by
the engine, as in SGLang's `routed_experts`). Shape `[B, T - 1, L, K]`, ids global.

`RouteReplay` turns that into what each router sees: per MoE layer and per
microbatch a `[s_local * b, K]` target in the router's token order (sequence-major,
`[s, b]` flattened), sliced to this TP rank's sequence-parallel shard, for the
layers of this rank's pipeline stage and virtual stages (routers know their global
layer number). The last token of each sequence and padding get filler targets of
distinct expert ids. EP needs nothing: ids are global and routing happens before
dispatch.

Each router is fed by a forward pre-hook that takes the next target from its own
queue, so any pipeline schedule works: every layer sees microbatches in order.
With activation recompute the layer runs again inside backward; those calls take
the targets of the forwards they repeat (`REPLAY_BACKWARD` order). Every target
must be consumed exactly once, or the context fails naming the layer and
microbatch.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from moe_rl import routes as route_rules
from moe_rl.dist.devices import compute_device
from moe_rl.policy.forward import Microbatch
from moe_rl.policy.model import MoEArch
from moe_rl.routes import record_dtype, route_dtype  # one type rule for every stored route


class ReplayError(RuntimeError):
    """Routes that do not fit the model, or targets not consumed exactly once."""


def filler_row(top_k: int) -> torch.Tensor:
    """Distinct expert ids `[K]` stored for tokens that have no route (never duplicates)."""
    return torch.arange(top_k)


def filler_targets(num_tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    """Replay targets `[n, K]` for tokens without a route (last tokens, padding, ignored rows).

    Distinct ids within a token, spread round-robin over all experts: a packed row's
    padding tail or a whole ignored microbatch sent to the same K experts would pile
    its tokens onto one expert-parallel rank.
    """
    ids = torch.arange(num_tokens * top_k).view(num_tokens, top_k)
    return ids % num_experts if top_k <= num_experts else ids


def check_routes(routes: torch.Tensor, lengths: torch.Tensor, arch: MoEArch) -> None:
    """Fail with what was expected when routes do not fit `[B, >= max(len) - 1, L, K]`, or hold ids no router
    of the model has (moe_rl/routes.py `check`; rows past a sequence may hold anything in range)."""
    L, K, E = arch.num_moe_layers, arch.moe_router_topk, arch.num_moe_experts
    need_t = int(lengths.max()) - 1
    if routes.dim() != 4 or routes.shape[0] != len(lengths) or routes.shape[2] != L or routes.shape[3] != K \
            or routes.shape[1] < need_t:
        raise ReplayError(f"routes have shape {tuple(routes.shape)}; expected [B={len(lengths)}, T-1>={need_t}, "
                          f"L={L} MoE layers, K={K}]")
    try:
        route_rules.check(routes, E, batched=True, distinct=False)
    except route_rules.BadRoutes as e:
        raise ReplayError(f"replayed {e}") from None


@dataclass
class _Router:
    """One TopKRouter on this rank: its module and its MoE column in the routes tensor."""

    module: Any
    column: int


def _find_routers(chunks: list[Any], arch: MoEArch) -> list[_Router]:
    from megatron.core.transformer.moe.router import TopKRouter

    routers = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise ReplayError("the model was built without moe_enable_routing_replay")
                layer = module.layer_number - 1  # megatron numbers layers from 1
                if layer not in arch.moe_layers:
                    raise ReplayError(f"router of layer {layer} is not an MoE layer of {arch.family}")
                routers.append(_Router(module, arch.moe_layers.index(layer)))
    return routers


def _sp_slice(seq_len: int) -> slice:
    """This TP rank's positions under sequence parallelism (the whole sequence without SP)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    cfg_sp = tp > 1  # TP > 1 with MoE implies SP (ParallelLayout enforces it)
    if not cfg_sp:
        return slice(0, seq_len)
    per = seq_len // tp
    r = ps.get_tensor_model_parallel_rank()
    return slice(r * per, (r + 1) * per)


def microbatch_targets(routes: torch.Tensor, mb: Microbatch, column: int, top_k: int,
                       positions: slice, num_experts: int | None = None) -> torch.Tensor:
    """Router target `[s_local * b, K]` (sequence-major) for one layer and microbatch.

    routes: `[B, T - 1, L, K]` for the caller's whole batch; `mb.index` picks rows
    (-1 = a padding row added to fill the last microbatch). In a packed microbatch
    each sequence's routes go to its span of the packed row.
    """
    b, s = mb.model_tokens.shape
    target = filler_targets(s * b, top_k, num_experts or top_k).view(s, b, top_k)
    rows, starts = mb.placement()
    # Plain ints, read once (as in Recording._place): indexing a tensor per sequence costs more than the copies.
    for row, length, a, r in zip(mb.index.tolist(), mb.lengths.tolist(), starts.tolist(), rows.tolist()):
        if row < 0:
            continue
        n = min(length - 1, routes.shape[1])
        target[a: a + n, r] = routes[row, :n, column].long()
    return target[positions].reshape(-1, top_k)


class RouteReplay:
    """Record or replay expert routes on this rank's model chunks (R2 / R3)."""

    def __init__(self, chunks: list[Any], arch: MoEArch) -> None:
        if arch.num_moe_experts is None:
            raise ReplayError("routing replay needs an MoE model")
        self.arch = arch
        self.routers = _find_routers([_unwrap(c) for c in chunks], arch)

    # ------------------------------------------------------------ record

    @contextmanager
    def record(self, microbatches: list[Microbatch], confidence: bool = False) -> Iterator["Recording"]:
        """Record the routes every router chooses while the schedule runs `microbatches` (R2).

        After the block, `recording.routes` is `[B, T - 1, L, K]` on every rank of the
        model-parallel group (gathered over TP and PP); with `confidence`,
        `recording.confidence` is `[B, T - 1, L, 2]` (see `route_confidence`).
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.routers:
            r.module.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            with self._collect(microbatches, from_routing_map=False, confidence=confidence) as rec:
                yield rec
        finally:
            self._reset()

    @contextmanager
    def observe(self, microbatches: list[Microbatch]) -> Iterator["Recording"]:
        """Collect the expert ids the routers actually use, in any mode (also under replay).

        Ids come from each router's routing map, so they are sorted within a token.
        """
        with self._collect(microbatches, from_routing_map=True) as rec:
            yield rec

    @contextmanager
    def _collect(self, microbatches: list[Microbatch], from_routing_map: bool,
                 confidence: bool = False) -> Iterator["Recording"]:
        rec = Recording(self.arch, microbatches, from_routing_map, confidence)
        handles = [r.module.register_forward_hook(rec.hook(r.column)) for r in self.routers]
        try:
            yield rec
        finally:
            for h in handles:
                h.remove()
        rec.finish()

    # ------------------------------------------------------------ replay

    @contextmanager
    def replay(self, routes: torch.Tensor, microbatches: list[Microbatch]) -> Iterator[None]:
        """Make every router use `routes` (`[B, T - 1, L, K]`) while the schedule runs `microbatches`."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        lengths = torch.cat([mb.lengths[mb.index >= 0] for mb in microbatches])
        check_routes(routes, lengths, self.arch)
        feeds = []
        handles = []
        for r in self.routers:
            feed = _Feed(r.column, [microbatch_targets(routes, mb, r.column, self.arch.moe_router_topk,
                                                       _sp_slice(mb.model_tokens.shape[1]), self.arch.num_moe_experts)
                                    for mb in microbatches])
            r.module.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            handles.append(r.module.register_forward_pre_hook(feed.pre_hook))
            feeds.append(feed)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            for h in handles:
                h.remove()
            self._reset()
            if not failed:
                for f in feeds:
                    f.check_consumed()

    def _reset(self) -> None:
        for r in self.routers:
            r.module.router_replay.clear_indices()
            r.module.router_replay.clear_router_replay_action()


class _Feed:
    """Targets for one router: forward queue in microbatch order, then the recompute queue."""

    def __init__(self, column: int, targets: list[torch.Tensor]) -> None:
        self.column = column
        self.forward: deque[tuple[int, torch.Tensor]] = deque(enumerate(targets))
        self.recompute: deque[tuple[int, torch.Tensor]] = deque()
        self.total = len(targets)

    def pre_hook(self, module: Any, args: tuple) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        queue = self.recompute if in_backward else self.forward
        if not queue:
            kind = "recompute" if in_backward else "forward"
            raise ReplayError(f"MoE layer {self.column}: no route target left for a {kind} pass "
                              f"({self.total} microbatches were given)")
        mb, target = queue.popleft()
        tokens = args[0].shape[0] * args[0].shape[1] if args[0].dim() == 3 else args[0].shape[0]
        if target.shape[0] != tokens:
            raise ReplayError(f"MoE layer {self.column}, microbatch {mb}: route target has {target.shape[0]} "
                              f"tokens, the router sees {tokens}")
        # A training forward of a recomputed layer runs under no_grad inside megatron's
        # checkpoint function, so "training" (set by the train step) is the signal that
        # this forward will be repeated during backward.
        if not in_backward and module.training and module.config.recompute_granularity == "full":
            self.recompute.append((mb, target))
        module.router_replay.target_topk_idx = target.to(args[0].device)

    def check_consumed(self) -> None:
        left = [mb for mb, _ in self.forward] + [mb for mb, _ in self.recompute]
        if left:
            raise ReplayError(f"MoE layer {self.column}: route targets of microbatches {left} were never "
                              f"consumed (each target must be used exactly once)")


def route_confidence(router: Any, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """How sure a router is, per token: `[tokens, 2]` on the host.

    Column 0: the top-k gate mass, the share of the router's scores (softmax probabilities, or
    sigmoid scores for a sigmoid router) on the k chosen experts; column 1: the margin between the
    k-th and (k+1)-th selection score (small margins are where a route flips): the router logit
    for softmax routers, sigmoid(logit) + the selection bias for sigmoid ones (GLM-4.5,
    DeepSeek-V3), which is what they rank. From the router's own gating on its input.
    """
    with torch.no_grad():
        logits = router.gating(hidden).float()
        logits = logits.reshape(-1, logits.shape[-1])
        if getattr(router, "score_function", "softmax") == "sigmoid":
            scores = torch.sigmoid(logits)
            bias = getattr(router, "expert_bias", None)
            select = scores if bias is None else scores + bias.float()
        else:
            scores, select = torch.softmax(logits, dim=-1), logits
        top = select.topk(min(k + 1, select.shape[-1]), dim=-1)
        margin = top.values[:, k - 1] - top.values[:, k] if top.values.shape[-1] > k \
            else torch.zeros_like(top.values[:, 0])
        mass = scores.gather(1, top.indices[:, :k]).sum(-1) / scores.sum(-1)
    return torch.stack([mass, margin], dim=-1).cpu()


class Recording:
    """Collects recorded top-k ids per router call and assembles `[B, T - 1, L, K]` (and, when
    asked, the routers' confidence `[B, T - 1, L, 2]`)."""

    def __init__(self, arch: MoEArch, microbatches: list[Microbatch], from_routing_map: bool,
                 confidence: bool = False) -> None:
        self.arch = arch
        self.microbatches = microbatches
        self.from_routing_map = from_routing_map
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.conf_calls: dict[int, list[torch.Tensor]] = {}
        num_sequences = max(int(mb.index.max()) for mb in microbatches) + 1
        s = max(mb.tokens.shape[1] for mb in microbatches)
        # id + 1, 0 where this rank saw no route (the MAX over model-parallel ranks fills it in), in the
        # smallest type that holds the expert count: the buffer is all-reduced over TP x PP every pass
        # (as bytes: `_merge_ids_over_model_parallel`).
        self.buf = torch.zeros((num_sequences, s, arch.num_moe_layers, arch.moe_router_topk),
                               dtype=record_dtype(arch.num_moe_experts))
        # both columns are >= 0, so -1 marks what this rank did not see (MAX-reduced like the ids)
        self.conf_buf = torch.full((num_sequences, s, arch.num_moe_layers, 2), -1.0) if confidence else None
        self.routes: torch.Tensor | None = None
        self.confidence: torch.Tensor | None = None

    def hook(self, column: int):
        def fn(module: Any, args: tuple, output: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # a recompute repeats a recorded forward
            if self.from_routing_map:
                routing_map = output[1]  # [tokens, E] bool
                ids = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
            else:
                ids = module.router_replay.recorded_topk_idx
            self.calls.setdefault(column, []).append(ids.detach().to("cpu", torch.int32))
            if self.conf_buf is not None:
                self.conf_calls.setdefault(column, []).append(
                    route_confidence(module, args[0], self.arch.moe_router_topk))
        return fn

    def finish(self) -> None:
        """Place each call's ids by microbatch and SP shard, then gather over TP and PP."""
        K = self.arch.moe_router_topk
        for column, calls in self.calls.items():
            if len(calls) != len(self.microbatches):
                raise ReplayError(f"MoE layer {column}: recorded {len(calls)} router calls for "
                                  f"{len(self.microbatches)} microbatches")
            for mb, ids in zip(self.microbatches, calls):
                self._place(mb, (ids + 1).to(self.buf.dtype), column, self.buf)
        for column, calls in self.conf_calls.items():
            for mb, conf in zip(self.microbatches, calls):
                self._place(mb, conf, column, self.conf_buf)
        self.buf = _merge_ids_over_model_parallel(self.buf)
        if self.conf_buf is not None:
            self.confidence = _max_over_model_parallel(self.conf_buf)[:, :-1].clone()
        lengths = torch.full((self.buf.shape[0],), -1, dtype=torch.long)
        for mb in self.microbatches:
            for seq, length in zip(mb.index.tolist(), mb.lengths.tolist()):
                if seq >= 0:
                    lengths[seq] = length
        routes = self.buf[:, :-1].to(torch.int32) - 1
        # Positions past each sequence's routed tokens (its last token, padding) hold filler ids.
        t = torch.arange(routes.shape[1]).view(1, -1)
        pad = t >= (lengths.view(-1, 1) - 1)
        routes[pad] = filler_row(K).to(torch.int32)
        if int(routes.min()) < 0:
            raise ReplayError("some routes were not recorded (a layer did not run on every token)")
        self.routes = routes.to(route_dtype(self.arch.num_moe_experts))

    def _place(self, mb: Microbatch, ids: torch.Tensor, column: int, buf: torch.Tensor) -> None:
        """Copy one router call's values `[s_local * b_m, C]` to each sequence's rows of `buf`.

        Sequence j occupies positions start_j .. start_j + len_j - 1 of its model row;
        this TP rank saw only its sequence-parallel slice of them.
        """
        b_m, s_m = mb.model_tokens.shape
        pos = _sp_slice(s_m)
        local = ids.view(pos.stop - pos.start, b_m, -1)
        rows, starts = mb.placement()
        # Plain ints, read once: indexing a tensor per sequence costs more than the copies.
        for seq, a, n, row in zip(mb.index.tolist(), starts.tolist(), mb.lengths.tolist(), rows.tolist()):
            if seq < 0:
                continue
            lo, hi = max(pos.start, a), min(pos.stop, a + n)
            if lo < hi:
                buf[seq, lo - a: hi - a, column] = local[lo - pos.start: hi - pos.start, row]


def _merge_ids_over_model_parallel(buf: torch.Tensor) -> torch.Tensor:
    """The recording buffer (id + 1, 0 where this rank saw no route) merged over the model-parallel group.

    Reduced as its bytes, `buf.view(uint8)`: neither backend reduces a 16-bit integer (gloo's typed
    dispatch, GENERATE_ALL_TYPES in ProcessGroupGlooDetail.hpp, has float, double, half, bfloat16, int8,
    uint8/bool, int32, int64, and refuses int16 with "Invalid scalar type"; torch's NCCL type map,
    `ncclDataType` in NCCLUtils.hpp, has int8, uint8, int32, int64, half, float, double, bfloat16, fp8,
    and NCCL itself no 16-bit integer type), while uint8 MAX runs on both. Viewing the bytes keeps what
    goes over the wire as compact as what is stored (2 bytes per id for 256..32767 experts, not int32's
    4). It is exact because every element is non-zero on at most one rank of the group (the tp-pp ranks:
    TP ranks route disjoint sequence-parallel slices, pipeline stages disjoint layers) and 0 on the
    others, and the byte-wise max of {0, v} is v's bytes.
    """
    return _max_over_model_parallel(buf.contiguous().view(torch.uint8)).view(buf.dtype)


def _max_over_model_parallel(buf: torch.Tensor) -> torch.Tensor:
    """Element-wise max over the model-parallel group: each TP / PP rank filled its own part.
    Assembled on the host (per-row placement), reduced on the compute device: NCCL groups
    take no host tensors."""
    if not dist.is_initialized():
        return buf
    from megatron.core import parallel_state as ps

    out = buf.to(compute_device())
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=ps.get_model_parallel_group())
    return out.cpu()


def _unwrap(module: Any) -> Any:
    while hasattr(module, "module"):
        module = module.module
    return module
