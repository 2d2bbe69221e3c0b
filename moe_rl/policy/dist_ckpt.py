"""Resharding checkpoints of the policy: megatron-core's `dist_checkpointing`, torch_dist format.

`save_sharded` / `load_sharded` write and read a policy's model and optimizer. Model and optimizer are
saved as one sharded state dict in megatron's `torch_dist` format (torch.distributed.checkpoint
files + common.pt + metadata.json). Every tensor is stored under a layout-free global key (layers
by global index, experts stacked along a leading axis, TP/EP shards as regular slices), so
a checkpoint saved under one TP/PP/VPP/EP/DP layout loads under another, on another world size.

The optimizer state follows the model's sharding:
- plain optimizer (FP32Optimizer / Float16OptimizerWithFloat16Params, chained for MoE):
  megatron's own `sharded_state_dict`; exp_avg / exp_avg_sq (and fp32 main params in bf16)
  have the shape of their model parameter; the Adam step is saved once as `common_step`.
- DistributedOptimizer: megatron's `fully_reshardable` keys (model-param-shaped tensors), each
  data-parallel rank writing and reading only its own range of them (`optim_shards`): host memory
  is the rank's own optimizer state, not its model shard's gathered over DP as megatron's own
  `fully_reshardable` does (`gathered=True` keeps that path: the benchmark's baseline; both load
  each other's checkpoints). The default of megatron-core 0.16.1, `fully_sharded_model_space`,
  raises ("ShardedTensor.flattened_range is not supported"), and `dp_reshardable` /
  `dp_zero_gather_scatter` only reshard along DP.

CPU + gloo: needs `moe_rl.policy.compat` active (it is once the Policy is built): megatron's
save path calls `torch.cuda.synchronize()` / `torch.cuda.current_device()` / `Tensor.cuda()`.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
import torch.distributed as dist

from moe_rl.dist.orphans import die_with_this_process
from moe_rl.policy.optim_shards import own_ranges
from moe_rl.policy.train_step import init_empty_adam_state, sub_optimizers, sync_params, unshare_adam_steps

SHARDING_TYPE = "fully_reshardable"
# False (Megatron-LM's `get_sharded_sd_metadata` default): experts stacked on a prepended axis, GLU
# halves interleaved in one tensor (torch's legacy ShardedTensor path in megatron's torch strategy).
# True: one tensor per expert and GLU half (`...experts.experts.{e}.linear_fc1.weight_w/_v`). Both
# reshard on CPU/gloo; the keys differ, so load with the value the checkpoint was saved with
# (it is in its content metadata).
SINGLETON_LOCAL_SHARDS = False
FORMAT = "moe_rl.dist_ckpt.v1"


def _metadata() -> dict[str, Any]:
    """What megatron's sharded_state_dict methods read (Megatron-LM's `get_sharded_sd_metadata`).
    A fresh dict per call: megatron adds `dp_cp_group` (a process group) to it in place."""
    return {
        "singleton_local_shards": SINGLETON_LOCAL_SHARDS,
        "chained_optim_avoid_prefix": True,    # no `chained_{i}.` key prefix (keys are per-parameter anyway)
        "distrib_optim_sharding_type": SHARDING_TYPE,
        "distrib_optim_fully_reshardable_mem_efficient": False,  # all_gather over DP (True: gloo gather on DP 0)
    }


def ensure_optimizer_state(optimizer: Any) -> None:
    """Zero Adam moments and a step-0 tensor where torch's Adam has no state yet (before the
    first step). megatron 0.16.1 needs them: DistributedOptimizer.state_dict() asserts one step
    value without TE/apex, and the plain optimizer saves only the state that exists (a load
    would then find no exp_avg in the checkpoint)."""
    for opt in sub_optimizers(optimizer):
        init_empty_adam_state(opt)


def _fix_steps_after_load(optimizer: Any) -> None:
    """Own `step` tensor per parameter (DistributedOptimizer.load_state_dict puts one shared tensor
    into every parameter's state without TE/apex; torch's Adam increments it in place), and a
    step-0 tensor where the checkpoint had none (the plain optimizer saves no step at step 0)."""
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        unshare_adam_steps(inner)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for state in inner.state.values():
                if state and "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)


@contextmanager
def _skip_step_in_param_state_copy(optimizer: Any) -> Iterator[None]:
    """megatron 0.16.1's `load_parameter_state_from_fully_reshardable` copies into every entry of
    torch Adam's per-parameter state (`_set_main_param_and_optimizer_states`,
    distrib_optimizer.py:937-940), `step` included, but the checkpoint's tensors have no `step`
    (it travels in param_groups): KeyError 'step'. With TE/apex FusedAdam there is no per-parameter
    step. Hide `step` during that copy; `load_state_dict` itself has set it from param_groups."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for opt in sub_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer) or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue
        orig = opt._set_main_param_and_optimizer_states

        def set_without_step(model_param, tensors, _opt=opt, _orig=orig):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            state = _opt.optimizer.state[_opt.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None)
            try:
                _orig(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = set_without_step
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def _default_common_step(loaded_optimizer: Any, optimizer: Any) -> None:
    """The plain optimizer saves Adam's step as `state.common_step` only when it is non-zero
    (`if step:`, optimizer.py:1033 and :840-843); torch's Adam then refuses per-parameter state
    without `step` on load (KeyError in Adam.__setstate__). A checkpoint from before the first
    step: give it step 0."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = sub_optimizers(optimizer)
    parts = [loaded_optimizer] if len(subs) == 1 else [loaded_optimizer[i] for i in range(len(subs))]
    for opt, sd in zip(subs, parts):
        if isinstance(opt, DistributedOptimizer):
            continue  # its step travels in param_groups
        inner = sd if "state" in sd else sd.get("optimizer", {})  # FP32Optimizer | Float16Optimizer
        state = inner.get("state")
        if isinstance(state, dict) and state and "common_step" not in state:
            state["common_step"] = torch.tensor(0.0, dtype=torch.float32)


def _model_state(policy: Any) -> dict[str, Any]:
    """The model chunks' sharded state; of a LoRA policy the adapters alone (`<layer>.lora.A|B.<part>`):
    its base is frozen, the HF checkpoint it is built from, so a checkpoint holds what trains."""
    md = _metadata()
    state = {f"model{i}": chunk.sharded_state_dict(metadata=md) for i, chunk in enumerate(policy.chunks)}
    if _adapters_only(policy):
        state = {k: {n: t for n, t in chunk.items() if ".lora.A." in n or ".lora.B." in n} for k, chunk in state.items()}
    return state


def _adapters_only(policy: Any) -> bool:
    return getattr(getattr(policy, "spec", None), "lora", None) is not None


class CheckpointMismatch(ValueError):
    """A checkpoint holding another kind of model state than the policy trains (LoRA or full)."""


def _check_model_state(policy: Any, ckpt_dir: str | Path) -> None:
    """A LoRA checkpoint into a full-parameter policy, or the other way round, named before megatron
    reports the missing keys."""
    from megatron.core import dist_checkpointing

    held = (dist_checkpointing.load_content_metadata(str(ckpt_dir)) or {}).get("model_state", "full")
    want = "lora_adapters" if _adapters_only(policy) else "full"
    if held != want:
        raise CheckpointMismatch(
            f"{ckpt_dir} holds {'LoRA adapters' if held == 'lora_adapters' else 'the full model'}, and this run "
            f"trains {'LoRA adapters' if want == 'lora_adapters' else 'the full model'}: resume it with the "
            "model.lora settings it was saved with (model.lora.rank > 0 for adapters, 0 for the full model)")


def _load_model(policy: Any, loaded: dict[str, Any]) -> None:
    """Copy the loaded model state into the chunks (a LoRA policy's: its adapters, every one of them)."""
    for i, chunk in enumerate(policy.chunks):
        if not _adapters_only(policy):
            chunk.load_state_dict(loaded[f"model{i}"], strict=True)
            continue
        result = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [k for k in result.missing_keys if ".lora.A." in k or ".lora.B." in k]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"LoRA checkpoint: adapters missing {missing[:3]} / unexpected {result.unexpected_keys[:3]}")


@contextmanager
def _optimizer_ranges(policy: Any, gathered: bool) -> Iterator[None]:
    """Each DP rank's own range of the distributed optimizer's state (megatron's gather over DP when
    `gathered`), for the optimizer's sharded_state_dict and load_state_dict run inside."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = [o for o in sub_optimizers(policy.opt.optimizer) if isinstance(o, DistributedOptimizer)]
    if gathered or not subs:
        yield
        return
    with own_ranges(subs, lambda: _model_state(policy)):
        yield


def sharded_state_dict(policy: Any, is_loading: bool, gathered: bool = False) -> dict[str, Any]:
    """Model chunks (`model{i}`, bare GPTModels) + optimizer (+ scheduler, a common entry, on save)."""
    model = _model_state(policy)
    ensure_optimizer_state(policy.opt.optimizer)
    with _collect_only_without_automatic_gc(), _optimizer_ranges(policy, gathered):
        optim = policy.opt.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=_metadata())
    state = {**model, "optimizer": optim}
    if not is_loading:
        state["scheduler"] = policy.opt.scheduler.state_dict()
    return state


@contextmanager
def _collect_only_without_automatic_gc() -> Iterator[None]:
    """megatron's DistributedOptimizer.sharded_state_dict runs a full `gc.collect()` per optimizer
    ("prevent memory leaks with GC disabled": megatron's trainer turns automatic GC off). moe_rl
    leaves it on, where the collections only cost time: 0.63 of a 1.07 s save of the tiny EP2
    policy. They run still when a caller has turned GC off."""
    from megatron.core.optimizer import distrib_optimizer

    kept = distrib_optimizer.gc
    distrib_optimizer.gc = SimpleNamespace(collect=lambda *a: 0 if gc.isenabled() else gc.collect(*a))
    try:
        yield
    finally:
        distrib_optimizer.gc = kept


_async_results: Any = None  # the Manager queue asynchronous saves report through (one per rank)


def _allow_child_processes(async_save: bool) -> None:
    """megatron's writer starts processes on every save, sync or async (`thread_count` forked writers
    per rank, plus a forked process per async save). multiprocessing refuses children in a daemonic
    process, and moe_rl's `run_ranks` starts its ranks with daemon=True: clear the flag (torchrun /
    srun ranks are not daemonic).

    The writers' results reach the rank through a queue for which megatron spawns a multiprocessing
    Manager (filesystem_async._get_write_results_queue): a process of its own, which outlived a rank
    killed with SIGKILL and held the trainer's stdout open. A synchronous save puts its results in
    that queue from the rank's own process, so a plain in-process queue serves it; an asynchronous
    one (a forked writer) gets a Manager queue of the same kind, forked so that it dies with the rank."""
    import multiprocessing as mp
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    proc = mp.current_process()
    if proc._config.get("daemon"):
        proc.daemon = False
    global _async_results
    if not async_save:
        filesystem_async._results_queue = queue.Queue()
        return
    if _async_results is None:  # megatron's own spawns a Manager that outlives a killed rank; this one dies with it
        with die_with_this_process():
            _async_results = mp.get_context("fork").Manager().Queue()
    filesystem_async._results_queue = _async_results


def save_sharded(policy: Any, ckpt_dir: str | Path, *, async_save: bool = False, gathered: bool = False) -> Any:
    """Save the policy's model, optimizer and scheduler to `ckpt_dir` (collective; a directory every
    rank sees). Returns None, or with `async_save` megatron's AsyncRequest: schedule it on
    `AsyncSaves` and wait for `done` on every rank before the checkpoint is relied on. `gathered`:
    the distributed optimizer's state gathered over DP first, as megatron does (the baseline)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    sync_params(policy.opt.chunks)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    if not gathered:
        # the weights' replicas over DP are written by all DP ranks, each its part (megatron's own
        # balancing), not all by DP rank 0: the writer stages (copies) what a rank writes, so DP rank 0
        # would hold its whole model shard's weights beside its optimizer range
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    _allow_child_processes(async_save)
    if dist.get_rank() == 0:  # megatron's save lists the directory on rank 0: it must exist
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = sharded_state_dict(policy, is_loading=False, gathered=gathered)
    # megatron forks its writers here: a rank killed mid-save takes them with it (moe_rl/dist/orphans.py)
    with die_with_this_process():
        return dist_checkpointing.save(
            state, str(ckpt_dir), sharded_strategy=strategy,
            async_sharded_save=async_save,
            content_metadata={"format": FORMAT, "distrib_optim_sharding_type": SHARDING_TYPE,
                              "model_state": "lora_adapters" if _adapters_only(policy) else "full",
                              "distrib_optim_ranges": "gathered" if gathered else "own",
                              "singleton_local_shards": SINGLETON_LOCAL_SHARDS})


def load_sharded(policy: Any, ckpt_dir: str | Path, *, gathered: bool = False) -> None:
    """Load `save_sharded`'s directory into the policy, whatever layout and world size saved it
    (with the same optimizer kind: train.distributed_optimizer as when it was saved), each DP rank
    reading its own range of the optimizer state (`gathered`: megatron's zero-filled model-shard
    buffers on every rank first, the baseline)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    _check_model_state(policy, ckpt_dir)
    state = sharded_state_dict(policy, is_loading=True, gathered=gathered)
    loaded = dist_checkpointing.load(state, str(ckpt_dir), sharded_strategy=TorchDistLoadShardedStrategy(),
                                     strict="raise_all")
    with torch.no_grad():  # fp32 DistributedOptimizer main params are views of the model's parameters
        _load_model(policy, loaded)
        _default_common_step(loaded["optimizer"], policy.opt.optimizer)
        with _skip_step_in_param_state_copy(policy.opt.optimizer), _optimizer_ranges(policy, gathered):
            policy.opt.optimizer.load_state_dict(loaded["optimizer"])
    _fix_steps_after_load(policy.opt.optimizer)
    policy.opt.scheduler.load_state_dict(loaded["scheduler"])


def load_sharded_weights(policy: Any, ckpt_dir: str | Path) -> None:
    """Only the model of `save_sharded`'s directory (export, evaluation): the optimizer state in it is
    left unread (megatron's "missing" keys), whatever optimizer this policy has."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    _check_model_state(policy, ckpt_dir)
    state = _model_state(policy)
    loaded = dist_checkpointing.load(state, str(ckpt_dir), sharded_strategy=TorchDistLoadShardedStrategy(),
                                     strict="raise_unexpected")
    with torch.no_grad():
        _load_model(policy, loaded)
    policy.opt.optimizer.reload_model_params()  # the optimizer's main copies follow the loaded weights


class AsyncSaves:
    """Asynchronous saves in flight: megatron's `AsyncCallsQueue` (non-persistent: a forked writer
    per save, which takes a copy-on-write snapshot of the tensors at fork time, so the step can
    change the parameters at once; the persistent worker sets a CUDA device). `done(blocking)` is
    collective: every rank calls it at the same points, and it is True once every rank's writers
    have finished and megatron's finalization (the checkpoint's metadata) ran."""

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)

    def schedule(self, request: Any) -> None:
        with die_with_this_process():  # the writer is forked here
            self.queue.schedule_async_request(request)

    def done(self, blocking: bool) -> bool:
        self.queue.maybe_finalize_async_calls(blocking=blocking)
        return self.queue.get_num_unfinalized_calls() == 0

    def close(self) -> None:
        """Stop a writer still running (the run ends abnormally: its checkpoint stays unfinished)."""
        self.queue.close(abort=True)
