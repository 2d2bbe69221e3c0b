"""What every weight sync shares: its error, the weights it sends, the rank-symmetric hand-offs.

Every `sync` is collective: all trainer ranks call it, in the same order, and all of them raise the
same `WeightSyncError` when any part failed, so no rank is left waiting in a collective the others
skipped. The policy side supplies the weights; this package never imports megatron (only
`moe_rl/policy/` does). A weights source is either
- an `export_fn(out_dir)` (collective) that writes a HF checkpoint, for DiskSync;
- an iterable of `(hf_name, tensor)` pairs, each tensor yielded by exactly one rank
  (as `moe_rl.policy.convert.iter_hf_tensors` does), for TensorSync / NcclSync;
- or an object with `export(out_dir)` and `named_tensors()` methods (see
  `MegatronWeights`), usable with all three.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Union, runtime_checkable

import torch
import torch.distributed as dist

from moe_rl.dist.collectives import all_errors, broadcast_object, rank

log = logging.getLogger(__name__)

ExportFn = Callable[[Path], Any]
NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the version, the directory or bucket, and the engine."""


@runtime_checkable
class PolicyWeights(Protocol):
    """The trainer's weights, in both forms a sync may need (both collective)."""

    def export(self, out_dir: Path) -> Any:
        """Write a HF checkpoint (config.json + safetensors) into `out_dir`."""
        ...

    def named_tensors(self, dtype: torch.dtype | None = None) -> NamedTensors:
        """(HF name, full tensor) pairs, in `dtype` if given; each tensor is yielded by exactly one rank."""
        ...


WeightsArg = Union[ExportFn, NamedTensors, PolicyWeights]


def _global_rank(group: Any, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _all_errors(error: str | None, group: Any = None) -> list[str]:
    """Every rank's error (None = fine), in rank order; doubles as a barrier (on the control group
    unless `group` is given: rank 0 may arrive from a long HTTP call)."""
    return all_errors(error, group)


def _from_rank0(obj: Any, group: Any = None) -> Any:
    """`obj` as rank 0 of `group` (default: the control group) has it, on every rank."""
    return broadcast_object(obj, group)


def _engine_name(engine: Any) -> str:
    urls = getattr(engine, "urls", None)
    if urls:
        return f"{type(engine).__name__}({', '.join(map(str, urls))})"
    path = getattr(engine, "model_path", None)
    return f"{type(engine).__name__}({path})" if path else type(engine).__name__


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _export_fn(weights: WeightsArg) -> ExportFn:
    if isinstance(weights, PolicyWeights):
        return weights.export
    if callable(weights):
        return weights
    raise TypeError("DiskSync needs an export_fn(out_dir) or an object with export(out_dir)")


def is_source(weights: WeightsArg) -> bool | None:
    """Whether this rank owns tensors of `weights` (None: the weights do not say; a plain list does by
    being non-empty). Known before iterating, since iterating runs the policy's gathers."""
    said = getattr(weights, "is_source", None)
    return bool(said()) if callable(said) else None


def _named_tensors(weights: WeightsArg, dtype: torch.dtype | None = None) -> NamedTensors:
    """The (name, tensor) pairs of `weights`; a policy given `dtype` casts before its gathers."""
    if isinstance(weights, PolicyWeights):
        return weights.named_tensors(dtype=dtype) if dtype is not None else weights.named_tensors()
    if isinstance(weights, Mapping):
        return weights.items()
    if callable(weights):
        raise TypeError("this sync sends tensors: pass (name, tensor) pairs or an object with named_tensors()")
    return weights


@dataclass
class MegatronWeights:
    """`PolicyWeights` of megatron model chunks (imports `moe_rl.policy.convert` only when used).

    hf_config: the HF config.json dict written with each export; aux_dir: a HF dir
    whose tokenizer / generation files are copied next to the weights; dtype: cast on export.
    """

    chunks: list[Any]
    arch: Any
    hf_config: dict[str, Any]
    dtype: torch.dtype | None = None
    aux_dir: str | Path | None = None

    def export(self, out_dir: Path) -> Any:
        from moe_rl.policy.convert import copy_aux_files, export_hf

        result = export_hf(self.chunks, out_dir, self.arch, self.hf_config, dtype=self.dtype)
        if self.aux_dir is not None and rank() == 0:
            copy_aux_files(self.aux_dir, out_dir)
        return result

    def is_source(self) -> bool:
        from moe_rl.policy.convert import is_hf_writer

        return is_hf_writer(spread=True)

    def named_tensors(self, dtype: torch.dtype | None = None) -> NamedTensors:
        from moe_rl.policy.convert import iter_hf_tensors

        # Unsharded tensors may share storage with the parameters: receivers copy, never keep them.
        yield from iter_hf_tensors(self.chunks, self.arch, spread=True, dtype=dtype or self.dtype)
