"""One optimizer step of the policy: megatron DDP + optimizer + LR schedule.

`PolicyOptimizer` wraps the model chunks in megatron's `DistributedDataParallel`,
builds megatron's optimizer (plain or distributed) and its LR scheduler, and runs
`step(microbatches, loss_fn)`: zero the grad buffers, run the pipeline schedule
forward and backward, reduce gradients over DP / TP / PP (`finalize_model_grads`),
clip, and step.

Losses are summed over microbatches and data-parallel ranks (DDP sums, it does not
average: `calculate_per_token_loss=True` in the model config), so `loss_fn` must
divide by global token or sequence counts (see `moe_rl/algo/losses.py`).

The MoE router's auxiliary (load-balancing) loss needs one more step. Under
`calculate_per_token_loss` megatron multiplies each micro-batch's aux loss by the
number of tokens that rank's router saw (`routing_map.shape[0]`, megatron-core 0.16's
`TopKRouter.attach_and_log_load_balancing_loss`) and expects
`finalize_model_grads(model, num_tokens)` to divide every gradient by the same count
summed over micro-batches and DP ranks; the aux gradient is then the token-weighted
mean of the micro-batches' aux gradients, whatever the micro-batch split, DP size or
batch size. Without the count it was that mean times the global token count. So
`backward` passes this rank's router token count (`router_token_count`) to
`finalize_model_grads`, and multiplies the policy loss by the global count first,
which leaves the already globally normalised policy gradient as it was (megatron's
own per-token losses are token sums of that size, so the range is the usual one).
Counts are of router positions, as megatron counts them: padding and ignored filler
micro-batches run through the routers (no padding mask is passed) and count, and
under sequence parallelism each TP rank's router sees its 1/tp of the sequence.

Checkpoints (`PolicyOptimizer.optimizer_state_dict`). megatron's distributed optimizer
keeps the parameter-dependent state (fp32 main-parameter shards, Adam's exp_avg and
exp_avg_sq) out of its `state_dict()`; its checkpoints add it through the parameter
state methods. A same-layout resume needs this rank's shard only, which megatron
exposes without communication as its "dp_reshardable" format; `load_state_dict`
restores it when the state carries `param_state`. The plain optimizer's own state dict
already holds everything and is used as is.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.dist.devices import compute_device
from moe_rl.policy import compat
from moe_rl.policy.forward import LossFn, Microbatch, Routing, run_schedule


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings the policy needs (mirrors the `train` config section)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    total_steps: int = 1
    lr_schedule: str = "constant"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm was NaN/inf; the optimizer step was skipped."""


def router_token_count(microbatches: list[Microbatch], sequence_parallel: bool) -> int:
    """Token positions this rank's MoE routers see over `microbatches`, as megatron's aux loss counts them.

    Each micro-batch's model input is `[b_m, s_m]` (`Microbatch.model_tokens`); all of
    it goes through the routers, padding included. Sequence parallelism gives each TP
    rank `s_m / tp` positions (rows are padded to a multiple of tp).
    """
    from megatron.core import parallel_state as ps

    split = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    return sum(mb.model_tokens.numel() for mb in microbatches) // split


def wrap_ddp(chunks: list[Any], distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
             overlap_param_gather: bool = False) -> list[Any]:
    """Wrap bare GPTModel chunks in megatron DDP (fp32 gradient buffers).

    With `overlap_grad_reduce` each bucket's reduction starts in the backward pass once its
    gradients are complete, which needs the schedule to hold it back in all but the last
    micro-batch (`config.no_sync_func`) and to start it for the earlier virtual stages
    (`config.grad_sync_func`), as megatron's own training loop sets them. With
    `overlap_param_gather` (distributed optimizer) the gather of updated parameters moves into the
    next forward's pre-hooks: anything that reads the parameters outside a forward must
    `sync_params` first.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=distributed_optimizer,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        # Bucketing pays off with overlap only; without it one bucket per chunk keeps CPU runs simple.
        ddp = DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0 and not overlap_grad_reduce)
        wrapped.append(ddp)
    config = chunks[0].config  # shared by every chunk; set as megatron's training loop sets it
    if overlap_grad_reduce:
        one = len(wrapped) == 1
        config.no_sync_func = wrapped[0].no_sync if one else [c.no_sync for c in wrapped]
        config.grad_sync_func = wrapped[0].start_grad_sync if one else [c.start_grad_sync for c in wrapped]
    # overlap_param_gather: the forward pre-hooks dispatch each bucket's gather (align_param_gather off)
    return wrapped


def sync_params(chunks: list[Any]) -> None:
    """Finish the parameter gather the last optimizer step left to the next forward (overlap_param_gather):
    weight export, drift and checkpoints read the parameters outside a forward."""
    for c in chunks:
        if getattr(c, "ddp_config", None) is not None and c.ddp_config.overlap_param_gather:
            c.start_param_sync(force_sync=True)


class PolicyOptimizer:
    """DDP-wrapped chunks + megatron optimizer + LR schedule.

    `frozen_embedding_rows`: vocabulary rows of the input embedding whose gradient is zeroed
    before every step (`frozen_rows(arch)`: the HF padding row, which HF never trains).
    """

    def __init__(self, chunks: list[Any], cfg: OptimConfig, frozen_embedding_rows: tuple[int, ...] = ()) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.cfg = cfg
        self.frozen_embedding_rows = tuple(frozen_embedding_rows)
        self.chunks = wrap_ddp(chunks, cfg.distributed_optimizer, cfg.overlap_grad_reduce, cfg.overlap_param_gather)
        model_cfg = chunks[0].config
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.grad_clip, bf16=model_cfg.bf16, fp16=model_cfg.fp16,
            params_dtype=model_cfg.params_dtype, use_distributed_optimizer=cfg.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, self.chunks)
        _fast_adam_on_cpu(self.optimizer)
        decay = max(cfg.total_steps - cfg.warmup_steps, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if cfg.warmup_steps else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
            lr_warmup_steps=cfg.warmup_steps, lr_decay_steps=cfg.warmup_steps + decay,
            lr_decay_style=cfg.lr_schedule, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant")

    def train(self) -> None:
        for c in self.chunks:
            c.train()

    def backward(self, microbatches: list[Microbatch], loss_fn: LossFn,
                 routing: Routing | None = None) -> list[dict[str, Any]]:
        """Zero grads, forward + backward over the microbatches, reduce grads. No optimizer step.

        `routing` wraps the schedule run (route replay for R2/R3).
        """
        from megatron.core.distributed import finalize_model_grads

        self.train()
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        num_tokens, total = self._router_tokens(microbatches)

        def scaled_loss(logits: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, dict[str, Any]]:
            # finalize_model_grads divides every gradient by `total`; the policy loss is
            # already normalised by global counts, so it is multiplied back here.
            loss, out = loss_fn(logits, mb)
            return loss * total, out

        with routing(microbatches) if routing else nullcontext():
            outputs = run_schedule(self.chunks, microbatches, scaled_loss, forward_only=False)
        finalize_model_grads(self.chunks, num_tokens=num_tokens)
        zero_embedding_rows(self.chunks, self.frozen_embedding_rows)
        return outputs

    def _router_tokens(self, microbatches: list[Microbatch]) -> tuple[torch.Tensor, float]:
        """This rank's router token count (0-d long tensor) and its sum over DP ranks.

        The tensor is what `finalize_model_grads` reduces in place; it lives on the
        compute device because megatron's groups are NCCL-only on GPU.
        """
        from megatron.core import parallel_state as ps

        local = router_token_count(microbatches, self.chunks[0].config.sequence_parallel)
        num_tokens = torch.tensor(local, dtype=torch.long, device=compute_device())
        total = num_tokens.clone()
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        return num_tokens, float(total)

    def step(self, microbatches: list[Microbatch], loss_fn: LossFn,
             routing: Routing | None = None) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """One optimizer update on `microbatches`; returns the loss outputs and step metrics.

        A non-finite gradient norm skips the update and raises NonFiniteLoss, leaving
        the weights as they were.
        """
        outputs = self.backward(microbatches, loss_fn, routing)
        ok, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        if not ok or not math.isfinite(grad_norm):
            raise NonFiniteLoss(f"gradient norm is {grad_norm}: the update was skipped and weights are unchanged")
        self.scheduler.step(increment=1)
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

        lr = get_canonical_lr_for_logging(self.optimizer.param_groups)
        return outputs, {"perf/grad_norm": grad_norm, "perf/lr": float(lr if lr is not None else "nan")}

    def optimizer_state_dict(self) -> Any:
        """This rank's full optimizer state, for a same-layout resume (works before the first step).

        Plain optimizer: megatron's `state_dict()`. Distributed optimizer: per sub-optimizer
        (dense, experts) megatron's `state_dict()` plus this rank's parameter state shard;
        one dict, or a list when megatron chains several optimizers (its own layout).
        Tensors are the live ones (like `Module.state_dict`): save them before the next step.
        """
        if not self.cfg.distributed_optimizer:
            return self.optimizer.state_dict()
        states = [_distributed_state_dict(o) for o in sub_optimizers(self.optimizer)]
        return states[0] if len(states) == 1 else states

    def load_optimizer_state_dict(self, state: Any) -> None:
        """Restore what `optimizer_state_dict` returned (same layout and optimizer kind)."""
        if not self.cfg.distributed_optimizer:
            self.optimizer.load_state_dict(state)
            return
        _check_distributed_state(state, len(sub_optimizers(self.optimizer)))
        # megatron's; the chained one dispatches per sub-optimizer. No grad: megatron copies the
        # main parameters in place, and in fp32 those are views of the model's parameters.
        with torch.no_grad():
            self.optimizer.load_state_dict(state)
        for opt in sub_optimizers(self.optimizer):
            unshare_adam_steps(opt.optimizer)

    @property
    def bare_chunks(self) -> list[Any]:
        """The GPTModel chunks inside DDP (for log-prob passes and export)."""
        return [c.module for c in self.chunks]


def frozen_rows(arch: Any) -> tuple[int, ...]:
    """Embedding rows to keep as loaded: HF's padding row (`MoEArch.padding_idx`).

    HF decoders embed with `nn.Embedding(..., padding_idx=pad_token_id)`: that row gets no
    gradient, and `_init_weights` makes it zero. megatron's embedding trains every row. A
    policy samples the pad token like any other, and once it is an input (a completion
    `<pad> x`) megatron sends the row a gradient through the first RMSNorm at a zero input,
    scaled by 1/sqrt(eps) (~1000x): it dominated the gradient norm, and clipping then shrank
    the whole step. Untied embeddings only: the row's whole gradient is then the lookup's;
    with tied weights it also carries the output layer's, so it is trained as megatron does.
    """
    pad = getattr(arch, "padding_idx", None)
    return () if pad is None or arch.tie_word_embeddings else (int(pad),)


def zero_embedding_rows(chunks: list[Any], rows: tuple[int, ...]) -> None:
    """Zero the reduced gradient (`main_grad`) of these vocabulary rows of the input embedding,
    on the ranks whose vocab-parallel shard holds them (first pipeline stage)."""
    if not rows:
        return
    for c in chunks:
        model = getattr(c, "module", c)
        if not getattr(model, "pre_process", False):
            continue
        emb = model.embedding.word_embeddings
        grad = getattr(emb.weight, "main_grad", None)
        grad = emb.weight.grad if grad is None else grad
        if grad is None:
            continue
        for row in rows:
            if emb.vocab_start_index <= row < emb.vocab_end_index:
                grad[row - emb.vocab_start_index].zero_()


def grads_as_params(chunks: list[Any]) -> None:
    """Copy each parameter's reduced gradient (DDP `main_grad`) into `.data` (tests, debugging).

    Lets the HF exporter gather gradients exactly as it gathers weights.
    """
    for c in chunks:
        for p in c.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            p.data.copy_(g if g is not None else torch.zeros_like(p))


def _fast_adam_on_cpu(optimizer: Any) -> None:
    """On CPU, torch's Adam updates all parameters per op (`foreach`, torch's default on CUDA
    only: a few calls per step instead of ~10 per parameter) and outside the CPU redirect
    (`compat.native`: it names no device). The same results bit for bit."""
    if torch.cuda.is_available():
        return
    for opt in sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                group["foreach"] = True
            inner.step = compat.native()(inner.step)  # a contextmanager decorates, fresh per call


def sub_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers behind `optimizer`: a ChainedOptimizer's parts, or itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed_state_dict(opt: Any) -> dict[str, Any]:
    """One DistributedOptimizer's state: megatron's `state_dict()` plus this rank's parameter state.

    `param_state` is megatron's `get_parameter_state_dp_reshardable()` (per bucket, per
    parameter: main-parameter shard, exp_avg, exp_avg_sq, step; no communication),
    with the `padding` flag megatron's loader filters on set as its sharded-checkpoint
    path sets it for real parameters. megatron's `load_state_dict` loads it back with
    `load_parameter_state_from_dp_reshardable`, which also checks the bucket sizes.
    """
    init_empty_adam_state(opt)
    state = opt.state_dict()
    param_state = opt.get_parameter_state_dp_reshardable()
    for key, per_dtype in param_state.items():
        if isinstance(key, int):  # buffer index -> dtype -> buckets -> parameters
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for tensors in bucket:
                        tensors["padding"] = False
    state["param_state"] = param_state
    state["param_state_sharding_type"] = "dp_reshardable"
    return state


def init_empty_adam_state(opt: Any) -> None:
    """Give a DistributedOptimizer that has not stepped yet the Adam state it would start from.

    torch's Adam creates its state (zero moments, step 0) lazily at the first step, and
    megatron 0.16's `DistributedOptimizer.state_dict` asserts that a step exists without
    TE / apex, and its parameter state methods need the moments. megatron's own
    `init_state_fn` (the one its Float16Optimizer uses when loading) fills zero moments;
    torch's Adam also needs its per-parameter `step` tensor, added here as torch would
    create it. Zero moments at step 0 are exactly the state the first step starts from.
    """
    inner = opt.optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    if opt.init_state_fn is None or all(len(inner.state.get(p, {})) > 0 for p in params):
        return
    opt.init_state_fn(inner, opt.config)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        for p in params:
            inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def unshare_adam_steps(inner: Any) -> None:
    """Give each parameter its own `step` tensor after megatron's `load_state_dict`.

    megatron 0.16 (without TE / apex) loads one step tensor into every parameter's state,
    and torch's Adam increments each parameter's step in place: shared, the count would
    grow by the number of parameters per step and the bias correction would be wrong.
    """
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        for state in inner.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def _check_distributed_state(state: Any, num_optimizers: int) -> None:
    """Refuse optimizer state that the distributed optimizer cannot restore in full."""
    states = state if isinstance(state, list) else [state]
    if len(states) != num_optimizers or not all(isinstance(s, dict) and "param_state" in s for s in states):
        raise ValueError(
            "checkpoint optimizer state does not hold the distributed optimizer's parameter state "
            f"(expected {num_optimizers} sub-optimizer state(s) with 'param_state'): it was saved with "
            "train.distributed_optimizer=false or by an older moe_rl; resume with the same "
            "train.distributed_optimizer setting and parallel layout it was saved with")
