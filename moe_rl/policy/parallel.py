"""Parallel layout (TP, PP, VPP, EP, ETP, SP, DP) and process-group initialisation.

`ParallelLayout` is validated once against the world size and the model, with
errors that say which dimension is wrong and what would fit. `init_distributed`
reads torchrun or SLURM variables, creates the default process group (gloo on
CPU, nccl on GPU) and megatron's model-parallel groups.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist


class LayoutError(ValueError):
    """A parallel layout that cannot work for this world size or model."""


class ModelDims(Protocol):
    """What layout validation needs to know about the model."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    num_moe_experts: int | None


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension; `dp` is derived from the world size.

    tp: tensor parallel; pp: pipeline stages; vpp: virtual stages per pipeline rank
    (interleaved schedule) or None; ep: expert parallel; etp: expert tensor parallel;
    sp: sequence parallel (None = on exactly when tp > 1, which MoE requires);
    first_stage_layers / last_stage_layers: uneven pipelines (megatron's
    `num_layers_in_first/last_pipeline_stage`), the other stages sharing the rest evenly.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int = 1
    sp: bool | None = None
    world_size: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sp is None else self.sp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def name(self) -> str:
        """Dash-joined short name, e.g. `tp2-pp2` (dimensions of size 1 left out)."""
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("vpp", self.vpp or 1),
                                         ("ep", self.ep), ("etp", self.etp), ("dp", self.dp)) if v > 1]
        parts += [f"{k}{v}" for k, v in (("first", self.first_stage_layers), ("last", self.last_stage_layers)) if v]
        return "-".join(parts) or "single"

    @classmethod
    def of(cls, parallel: Any, world_size: int) -> "ParallelLayout":
        """The layout a config's `parallel` section (`moe_rl.policy.config.ParallelConfig`) asks
        for on `world_size` ranks."""
        return cls(tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, ep=parallel.ep, etp=parallel.etp,
                   sp=parallel.sp, world_size=world_size, first_stage_layers=parallel.first_stage_layers,
                   last_stage_layers=parallel.last_stage_layers)

    @classmethod
    def parse(cls, name: str) -> "ParallelLayout":
        """Parse a layout name like `tp2-pp2-vpp2`, `tp2-ep2-dp2` or `pp2-first1` (world size = product,
        vpp and the uneven stages' `firstN` / `lastN` layer counts aside)."""
        sizes = {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "etp": 1, "dp": 1, "first": 0, "last": 0}
        seen: set[str] = set()
        if name not in ("", "single", "dp1"):
            for part in name.split("-"):
                m = re.fullmatch(r"(tp|pp|vpp|ep|etp|dp|first|last)(\d+)", part)
                if not m or int(m.group(2)) < 1:
                    raise LayoutError(f"layout {name!r}: bad part {part!r}; use dash-joined tpN, ppN, vppN, "
                                      f"epN, etpN, dpN (e.g. tp2-pp2)")
                if m.group(1) in seen:
                    raise LayoutError(f"layout {name!r}: {m.group(1)} is given twice")
                seen.add(m.group(1))
                sizes[m.group(1)] = int(m.group(2))
        # The world size is the product of the named sizes (vpp aside): EP and ETP
        # then partition the tp*dp ranks of a stage, so `ep2` alone runs on 2 ranks
        # (dp2 for the dense part) and `tp2-ep2` on 4.
        world = 1
        for key in ("tp", "pp", "ep", "etp", "dp"):
            world *= sizes[key]
        return cls(tp=sizes["tp"], pp=sizes["pp"], vpp=sizes["vpp"] if sizes["vpp"] > 1 else None,
                   ep=sizes["ep"], etp=sizes["etp"], world_size=world, first_stage_layers=sizes["first"] or None,
                   last_stage_layers=sizes["last"] or None)

    def validate_stages(self, num_layers: int) -> None:
        """Every pipeline stage (and virtual chunk) gets a whole number of layers, as megatron needs."""
        v = self.vpp or 1
        uneven = {k: n for k, n in (("first_stage_layers", self.first_stage_layers),
                                    ("last_stage_layers", self.last_stage_layers)) if n is not None}
        if not uneven:
            if num_layers % (self.pp * v):
                raise LayoutError(f"num_layers={num_layers} is not divisible by pp*vpp = {self.pp * v}; "
                                  "parallel.first_stage_layers / last_stage_layers give uneven stages")
            return
        if self.pp < 2:
            raise LayoutError(f"parallel.{' and '.join(uneven)} need parallel.pp >= 2 (got pp={self.pp})")
        for key, n in uneven.items():
            if n < 1 or n % v:
                raise LayoutError(f"parallel.{key}={n} must be >= 1 and divisible by vpp={v}")
        middle, stages = num_layers - sum(uneven.values()), self.pp - len(uneven)
        if middle < 0 or bool(middle) != bool(stages) or (stages and (middle % stages or middle // stages % v)):
            raise LayoutError(f"num_layers={num_layers} minus parallel.{' + '.join(uneven)} = {middle} layers do "
                              f"not split evenly over the other {stages} pipeline stage(s) (x vpp={v})")

    def validate(self, model: ModelDims | None = None) -> "ParallelLayout":
        """Raise LayoutError naming the first dimension that does not fit; return self."""
        for field in ("tp", "pp", "ep", "etp", "world_size"):
            if getattr(self, field) < 1:
                raise LayoutError(f"parallel.{field}={getattr(self, field)} must be >= 1")
        if self.vpp is not None and (self.vpp < 1 or self.pp < 2):
            raise LayoutError(f"parallel.vpp={self.vpp} needs parallel.pp >= 2 (got pp={self.pp})")
        if self.world_size % (self.tp * self.pp):
            raise LayoutError(f"world size {self.world_size} is not divisible by tp*pp = "
                              f"{self.tp}*{self.pp}; use a world size that is a multiple of {self.tp * self.pp}")
        per_stage = self.world_size // self.pp
        if per_stage % (self.ep * self.etp):
            raise LayoutError(f"ep*etp = {self.ep}*{self.etp} must divide world_size/pp = {per_stage}")
        if self.sp is False and self.tp > 1 and model is not None and model.num_moe_experts:
            raise LayoutError("parallel.sp=false with tp>1: megatron-core requires sequence parallel "
                              "for MoE models under tensor parallelism; set parallel.sp=true (or leave it unset)")
        if model is not None:
            self._validate_model(model)
        return self

    def _validate_model(self, m: ModelDims) -> None:
        self.validate_stages(m.num_layers)
        if m.num_attention_heads % self.tp:
            raise LayoutError(f"num_attention_heads={m.num_attention_heads} is not divisible by tp={self.tp}")
        if m.num_query_groups % self.tp:
            raise LayoutError(f"num_key_value_heads={m.num_query_groups} is not divisible by tp={self.tp}")
        if m.num_moe_experts and m.num_moe_experts % self.ep:
            raise LayoutError(f"num_experts={m.num_moe_experts} is not divisible by ep={self.ep}")
        if not m.num_moe_experts and self.ep > 1:
            raise LayoutError(f"ep={self.ep} but the model has no MoE layers")
        la = getattr(m, "linear_attention", None)  # the gated delta net splits its key and value heads over TP
        if la is not None and (la.key_heads % self.tp or la.value_heads % self.tp):
            raise LayoutError(f"linear_num_key_heads={la.key_heads} and linear_num_value_heads={la.value_heads} "
                              f"must both be divisible by tp={self.tp}")
        mla = getattr(m, "mla", None)  # multi-latent attention splits its down projections' rows over TP
        for name, rows in (("q_lora_rank", mla and mla.q_lora_rank),
                           ("kv_lora_rank + qk_rope_head_dim", mla and mla.kv_lora_rank + mla.qk_rope_head_dim)):
            if rows and rows % self.tp:
                raise LayoutError(f"{name}={rows} is not divisible by tp={self.tp} (multi-latent attention)")


# ---------------------------------------------------------------- launch environment

@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, read from torchrun or SLURM variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: `gpu[003-010,012],cpu1` -> `gpu003`.

    Written here instead of calling `scontrol show hostnames` so that it also works
    inside containers that lack the SLURM client tools.
    """
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def read_dist_env(environ: dict[str, str] | None = None, default_port: int = 29500) -> DistEnv:
    """torchrun variables win; otherwise SLURM (srun, one task per device); otherwise one process."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=int(env.get("LOCAL_RANK", "0")),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(env.get("MASTER_PORT", default_port)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        return DistEnv(rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
                       local_rank=int(env.get("SLURM_LOCALID", "0")),
                       master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
                       master_port=int(env.get("MASTER_PORT", default_port)))
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                   master_port=int(env.get("MASTER_PORT", default_port)))


def init_distributed(layout: ParallelLayout, timeout_s: float = 1800.0, seed: int = 1234) -> DistEnv:
    """Create the default group and megatron's parallel groups for `layout`.

    The layout's world size must equal the job's. gloo on CPU (with the compat layer
    activated), nccl on GPU. Groups already made for the same layout are reused (a
    process may build several models of one layout); another layout is refused.
    """
    from megatron.core import parallel_state, tensor_parallel

    from moe_rl.policy import compat

    env = read_dist_env()
    if layout.world_size != env.world_size:
        raise LayoutError(f"layout {layout.name} needs {layout.world_size} processes, "
                          f"but the job has {env.world_size}")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(env.local_rank)
    else:
        compat.activate()
    compat.define_missing_te_gemm()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo",
                                init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    if parallel_state.model_parallel_is_initialized():
        _check_same_layout(layout)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return env
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return env


def _check_same_layout(layout: ParallelLayout) -> None:
    """Refuse a layout other than the one megatron's groups were made for."""
    from megatron.core import parallel_state as ps

    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size())
    want = (layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp)
    if have != want:
        raise LayoutError(f"this process already has parallel groups for tp/pp/vpp/ep/etp = {have}; layout "
                          f"{layout.name} needs {want} (one layout per process: call destroy_distributed first)")


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default group (tests and clean exits)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def data_parallel_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this process in the data-parallel group (0, 1 when not distributed)."""
    if not dist.is_initialized():
        return 0, 1
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
