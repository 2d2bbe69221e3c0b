"""The distributed optimizer's state in a checkpoint, each data-parallel rank writing and reading its own range.

megatron-core 0.16.1 offers two ways to checkpoint a DistributedOptimizer, and neither fits a large
MoE run:
- `dp_reshardable` writes each rank's flat buffer as it is: no gather, but the keys follow the
  buffer's internal layout (a TP x PP domain index, bucket numbers), so it reshards along DP only;
- `fully_reshardable` writes model-space tensors (each parameter's fp32 copy and Adam moments in its
  own shape, under layout-free keys, as a plain optimizer's), so any layout loads it, but it gets
  there by gathering every DP rank's shard of the *whole model shard* into host memory on every rank
  (`get_parameter_state_dp_zero`, fp32 x 3), at every save and, as zero-filled buffers, at every
  load (tools/bench/ckpt_memory.py measures it and estimates it at the flagship layouts).

This module keeps `fully_reshardable`'s keys and global shapes and drops the gather. A DP rank owns
one contiguous range of each parameter's flattened (TP/EP-local) tensor; such a range is a union of
at most 2 * ndim - 1 regular boxes of the tensor (`flat_range_boxes`), and each box is a regular
slice of the parameter's global model-space tensor. Each rank saves its boxes as uneven
`ShardedTensor`s (megatron hands uneven sharding to torch DCP), whose data are views of the
optimizer's own flat state: nothing is copied or gathered. At load each rank asks for the boxes of
its own ranges, under whatever layout it runs, and DCP reads them into the same views, from a
checkpoint written this way or by megatron's gathered `fully_reshardable` (same keys, same global
tensors). Host memory beyond the rank's own optimizer state: none held by this code.

Written by hand because megatron-core 0.16.1 has no such path: its per-parameter model-space format
(`fully_sharded_model_space`) needs `ShardedTensor.flattened_range`, which 0.16.1 refuses.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # megatron's fully_reshardable tensors per parameter
PREFIX = "optimizer.state"                      # and their key prefix (`optimizer.state.<state>.<param key>`)

Box = tuple[tuple[int, ...], tuple[int, ...]]   # (offset, shape) in a tensor


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The regular boxes, in row-major order, whose elements are exactly the flat range [start, stop)
    of a row-major tensor of `shape` (a partial first row, whole rows, a partial last row, recursively)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    if first == last:  # inside one row
        return [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], head, tail)]
    boxes: list[Box] = []
    if head:
        boxes += [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], head, inner)]
        first += 1
    if last > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:])))
    if tail:
        boxes += [((last, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, tail)]
    return boxes


def _leaves(sharded: Any) -> list[tuple[Any, int]]:
    """The model's regular ShardedTensors of one parameter with where each starts in its flat local
    tensor: the ShardedTensor itself, or what its factory builds (the GLU halves under TP: chunks
    along dim 0, so each a contiguous piece of the parameter)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if not isinstance(sharded, ShardedTensorFactory):
        return [(sharded, 0)]
    base = sharded.data
    out = []
    for leaf in nested_values(sharded.build()):
        if not leaf.data.is_contiguous() or leaf.data.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            raise NotImplementedError(f"{sharded.key}: its checkpoint factory builds a non-contiguous piece; "
                                      "save with the gathered optimizer format")
        out.append((leaf, leaf.data.storage_offset() - base.storage_offset()))
    return out


def _box_tensors(leaf: Any, key: str, flat: torch.Tensor, lo: int, hi: int, leaf_start: int) -> list[Any]:
    """ShardedTensors of `key` for the part [lo, hi) of a parameter's flat local tensor that falls in
    `leaf`, whose data are views of `flat` (this rank's state of the parameter, flat from `lo`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    n = math.prod(leaf.local_shape)
    a, b = max(lo, leaf_start), min(hi, leaf_start + n)
    pre = leaf.prepend_axis_num
    # one replica per box over the data-parallel ranks (each owns its own range); the model's other
    # replica axes (TP-replicated norms, a tied output layer) keep theirs: saved once
    replica = (*leaf.replica_id[:-1], 0) if isinstance(leaf.replica_id, tuple) else 0
    out, pos = [], a - lo
    for offset, shape in flat_range_boxes(tuple(leaf.local_shape), a - leaf_start, b - leaf_start):
        numel = math.prod(shape)
        data = flat[pos:pos + numel].view((1,) * pre + shape)  # the expert axes folded in: a plain box
        global_offset = (*leaf.global_offset[:pre],
                         *(g + o for g, o in zip(leaf.global_offset[pre:], offset)))
        out.append(ShardedTensor(key, data, data.dtype, data.shape, tuple(leaf.global_shape), global_offset,
                                 axis_fragmentations=None, replica_id=replica, prepend_axis_num=0))
        pos += numel
    return out


def own_range_state(opt: Any, model_sharded_state_dict: Any) -> dict[int, dict[str, list[Any]]]:
    """This DP rank's optimizer state as `fully_reshardable` keys: per parameter (numbered as megatron
    numbers them) and state, the boxes of the rank's own range, views of the optimizer's tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {sh.data: sh for sh in nested_values(model)}
    state: dict[int, dict[str, list[Any]]] = {}
    index = 0
    for gbuf_index, by_dtype in enumerate(opt.gbuf_ranges):
        for buckets in by_dtype.values():
            ranges = {p: r["param"] for bucket in buckets for p, r in bucket["param_map"].items()}
            for param in opt.buffers[gbuf_index].param_index_map:
                if param in ranges and len(ranges[param]) > 0:
                    sharded = by_param.get(param)
                    if sharded is None:
                        raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in the model's "
                                         "sharded state dict")
                    tensors = opt._get_main_param_and_optimizer_states(param)
                    lo, hi = ranges[param].start, ranges[param].end
                    state[index] = {
                        name: [box for leaf, start in _leaves(sharded)
                               for box in _box_tensors(leaf, f"{PREFIX}.{name}.{leaf.key}", tensors[name].view(-1),
                                                       lo, hi, start)]
                        for name in STATE_KEYS}
                index += 1
    return state


def load_own_range_state(opt: Any, state: dict[int, dict[str, list[torch.Tensor]]],
                         model_sharded_state_dict: Any) -> None:
    """Put what `own_range_state`'s boxes loaded into the optimizer's tensors (DCP read them into
    views of those tensors already; this copies where torch's optimizer load replaced a tensor)."""
    fresh = own_range_state(opt, model_sharded_state_dict)
    if set(fresh) != set(state):
        raise ValueError("the loaded optimizer state has other parameters than this rank owns")
    with torch.no_grad():
        for index, by_name in fresh.items():
            for name, boxes in by_name.items():
                for target, loaded in zip(boxes, state[index][name]):
                    if target.data.data_ptr() != loaded.data_ptr():
                        target.data.copy_(loaded.view(target.data.shape))


@contextmanager
def own_ranges(optimizers: list[Any], model_sharded_state_dict: Callable[[], Any]) -> Iterator[None]:
    """While it runs, megatron's `fully_reshardable` save and load of these DistributedOptimizers use
    each rank's own range (`own_range_state`) instead of gathering the model shard over DP. The rest
    of megatron's optimizer checkpoint (param groups, the step, the grad scaler, the chained layout)
    is its own. `model_sharded_state_dict` builds the model's sharded state dict afresh (a load
    applies the factories of the one it was given in place)."""
    patched = []
    for opt in optimizers:
        if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue  # its states are scaled copies, not views: megatron's gathered path

        def save(model_sd, is_loading=False, metadata=None, _opt=opt):
            return own_range_state(_opt, model_sd)

        def load(state, _opt=opt):
            load_own_range_state(_opt, state, model_sharded_state_dict())

        opt.sharded_param_state_fully_reshardable = save
        opt.load_parameter_state_from_fully_reshardable = load
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.sharded_param_state_fully_reshardable
            del opt.load_parameter_state_from_fully_reshardable
