"""`Policy`: the trainer's one handle on the megatron model.

Everything the RL loop asks of the policy goes through here: log-probs (recording
or replaying routes), minibatch updates under replay, HF export for weight sync,
and state for checkpoints. Inputs and outputs are plain tensors, so code outside
`moe_rl/policy/` never touches megatron.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from moe_rl.dist.devices import compute_device
from moe_rl.policy.convert import export_hf, is_hf_writer, iter_hf_tensors, load_hf_weights
from moe_rl.policy.dist_ckpt import load_sharded, load_sharded_weights, save_sharded
from moe_rl.policy.forward import LogProbs, Microbatch, build_microbatches, compute_logprobs, microbatch_logprobs
from moe_rl.policy.lora import LoraSpec, attach_lora, export_peft
from moe_rl.policy.model import MoEArch, build_model, read_hf_config
from moe_rl.policy.parallel import ParallelLayout, data_parallel_rank_and_size, init_distributed
from moe_rl.policy.perf import PerfRequest, resolve
from moe_rl.policy.replay import RouteReplay
from moe_rl.policy.train_step import NonFiniteLoss, OptimConfig, PolicyOptimizer, frozen_rows, sync_params

log = logging.getLogger(__name__)

# (logp [b, s-1] of the microbatch under the current weights, microbatch) -> (loss, metrics)
PolicyLoss = Callable[[torch.Tensor, Microbatch], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class PolicySpec:
    """What to build: checkpoint, layout, precision, memory and batch settings."""

    hf_dir: str
    layout: ParallelLayout
    optim: OptimConfig
    dtype: str = "fp32"
    recompute: bool = False
    micro_batch_size: int = 4
    seed: int = 1234
    max_tokens_per_microbatch: int | None = None  # set: pack sequences into rows of this many tokens
    temperature: float = 1.0  # log-probs of softmax(logits / T), the rollout's sampling distribution
    collective_timeout_s: float = 1800.0  # of the default and megatron's process groups
    perf: PerfRequest = PerfRequest()  # fused kernels and DDP overlap (moe_rl/policy/perf.py; auto: on GPU)
    moe_aux_loss_coef: float | None = None  # set: replaces the checkpoint's router_aux_loss_coef
    expert_bias_update_rate: float = 0.0  # sigmoid routers' selection bias: 0 frozen, > 0 balanced per update
    lora: LoraSpec | None = None  # set: train adapters on a frozen base (moe_rl/policy/lora.py)


def with_aux_loss_coef(arch: MoEArch, coef: float | None) -> MoEArch:
    """`arch` with the routers' load-balancing loss weight `coef` (None: the checkpoint's)."""
    return arch if coef is None else replace(arch, moe_aux_loss_coeff=float(coef))


def expert_biases(chunks: list[Any]) -> list[torch.Tensor]:
    """The selection biases of this rank's sigmoid routers (megatron's `expert_bias` buffers), in order."""
    return [m.expert_bias for c in chunks for m in c.modules() if getattr(m, "expert_bias", None) is not None]


@dataclass
class UpdateResult:
    """What one `Policy.update` reports: loss metrics per microbatch (this rank's, on the
    last pipeline stage; empty elsewhere) and step metrics (grad norm, learning rate)."""

    microbatches: list[dict[str, float]]
    step: dict[str, float]


class MegatronModel:
    """A megatron model on this rank, built from a HF checkpoint in the spec's layout, with its
    optimizer and routing replay: what `Policy` and the critic (`moe_rl.policy.critic`) share.
    Subclasses say what the output becomes per token (`per_token`) and may change the
    architecture (`_model_arch`) and how the HF weights go in (`_load_weights`). Call every
    method on every rank: they are collective."""

    def per_token(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        raise NotImplementedError

    def __init__(self, spec: PolicySpec) -> None:
        self.spec = spec
        arch = with_aux_loss_coef(read_hf_config(spec.hf_dir), spec.moe_aux_loss_coef)
        if arch.expert_bias:
            arch = replace(arch, expert_bias_update_rate=float(spec.expert_bias_update_rate))
        self.hf_config: dict[str, Any] = json.loads((Path(spec.hf_dir) / "config.json").read_text())
        spec.layout.validate(arch)
        if arch.linear_attention is not None and spec.max_tokens_per_microbatch is not None:
            raise ValueError(f"{spec.hf_dir}: max_tokens_per_microbatch={spec.max_tokens_per_microbatch} packs sequences "
                             "into rows, and megatron-core's gated delta net (the linear attention of Qwen3-Next and "
                             "Qwen3.5-MoE) refuses packed sequences; use max_tokens_per_microbatch=None")
        if arch.extra.get("mtp_layers") and os.environ.get("RANK", "0") == "0":
            log.info("%s: its %d multi-token-prediction layer(s) are not read: RL trains the decoder layers",
                     spec.hf_dir, arch.extra["mtp_layers"])
        init_distributed(spec.layout, timeout_s=spec.collective_timeout_s, seed=spec.seed)
        self.arch: MoEArch = self._model_arch(arch)
        self.perf = resolve(spec.perf, distributed_optimizer=spec.optim.distributed_optimizer,
                            moe=self.arch.num_moe_experts is not None)
        chunks = build_model(self.arch, spec.layout, spec.dtype, spec.recompute, self.perf)
        self._load_weights(chunks)
        if spec.lora is not None:  # after the base weights: the optimizer then holds the adapters only
            attach_lora(chunks, self.arch, spec.lora)
        self.opt = PolicyOptimizer(chunks, replace(spec.optim, overlap_grad_reduce=self.perf.overlap_grad_reduce,
                                                   overlap_param_gather=self.perf.overlap_param_gather),
                                   frozen_rows(self.arch))
        self.replay = RouteReplay(self.opt.chunks, self.arch) if self.arch.num_moe_experts else None
        self.dp_rank, self.dp_size = data_parallel_rank_and_size()

    def _model_arch(self, arch: MoEArch) -> MoEArch:
        """The architecture to build (the checkpoint's)."""
        return arch

    def _load_weights(self, chunks: list[Any]) -> None:
        """Put the HF checkpoint's weights into the freshly built `chunks`."""
        load_hf_weights(chunks, self.spec.hf_dir, self.arch)

    @property
    def chunks(self) -> list[Any]:
        return self.opt.bare_chunks

    @property
    def packs_sequences(self) -> bool:
        """Whether micro-batches are packed by a token budget (`max_tokens_per_microbatch`)."""
        return self.spec.max_tokens_per_microbatch is not None

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's loss metrics count: the last pipeline stage, first TP rank (the
        other TP ranks of that stage hold copies; earlier stages have none)."""
        if not dist.is_initialized():
            return True
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0

    @property
    def model_parallel_ranks(self) -> list[int]:
        """World ranks of this rank's model-parallel group (TP x PP): they train on the same samples."""
        if not dist.is_initialized():
            return [0]
        from megatron.core import parallel_state as ps

        return dist.get_process_group_ranks(ps.get_model_parallel_group())

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group (None when not distributed)."""
        if not dist.is_initialized():
            return None
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    # ------------------------------------------------------------ forward

    def _forward(self, sequences: list[torch.Tensor], *, record_routes: bool = False,
                 replay_routes: torch.Tensor | None = None, entropy: bool = False,
                 route_confidence: bool = False) -> LogProbs:
        """`per_token` of this DP rank's sequences, `[B, T - 1]`, in one pass without gradients
        (see `Policy.logprobs` for the arguments)."""
        routing = None
        if replay_routes is not None:
            routing = lambda mbs: self.replay.replay(replay_routes, mbs)  # noqa: E731
        elif record_routes and self.replay is not None:
            routing = lambda mbs: self.replay.record(mbs, confidence=route_confidence)  # noqa: E731
        return compute_logprobs(self.chunks, sequences, self.spec.micro_batch_size, with_entropy=entropy,
                                routing=routing, max_tokens=self.spec.max_tokens_per_microbatch,
                                temperature=self.spec.temperature, per_token=self.per_token)

    # ------------------------------------------------------------ updates

    def update(self, sequences: list[torch.Tensor], extras: dict[str, torch.Tensor], loss: PolicyLoss,
               replay_routes: torch.Tensor | None = None, group_size: int = 1) -> "UpdateResult":
        """One optimizer step on this DP rank's `sequences` (all DP ranks step together).

        extras: per-sequence tensors the loss reads from `mb.extras`, padded to `[B, T - 1]`
        for per-token values. Returns the loss metrics of each microbatch this rank ran
        (how to combine them is the loss's business) and the step's metrics.
        group_size: runs of that many consecutive sequences share a microbatch, in order
        (DPO pairs: 2), so the loss sees them together.
        """
        mbs = build_microbatches(sequences, self.spec.micro_batch_size, self.spec.max_tokens_per_microbatch,
                                 extras=extras, chunks=self.chunks, group_size=group_size)

        def loss_fn(logits: torch.Tensor, mb: Microbatch):
            value, metrics = loss(self.per_token(logits, mb), mb)
            return value, {"metrics": metrics}

        routing = (lambda m: self.replay.replay(replay_routes, m)) if replay_routes is not None else None
        biases = expert_biases(self.chunks) if self.arch.expert_bias_update_rate > 0 else []
        before = [b.clone() for b in biases]
        try:
            outputs, step_metrics = self.opt.step(mbs, loss_fn, routing)
        except NonFiniteLoss:  # a skipped update leaves every weight as it was, the selection biases too
            with torch.no_grad():
                for b, o in zip(biases, before):
                    b.copy_(o)
            raise
        if biases:  # megatron's balancing moved them in finalize_model_grads: by how much (max over layers)
            step_metrics["moe/expert_bias_change"] = max(float((b - o).abs().max()) for b, o in zip(biases, before))
        return UpdateResult([{k: float(v) for k, v in out["metrics"].items()} for out in outputs], step_metrics)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and scheduler state of this rank (for a same-layout resume).

        With the distributed optimizer this includes this rank's shard of the Adam moments
        and main parameters; it works before the first optimizer step too.
        """
        sync_params(self.opt.chunks)
        return {"model": [c.state_dict() for c in self.opt.chunks],
                "optimizer": self.opt.optimizer_state_dict(),
                "scheduler": self.opt.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` of the same layout and optimizer settings (model first: the
        distributed optimizer's main parameters then come from the checkpoint's own shard)."""
        for chunk, sd in zip(self.opt.chunks, state["model"]):
            chunk.load_state_dict(sd)
        self.opt.load_optimizer_state_dict(state["optimizer"])
        self.opt.scheduler.load_state_dict(state["scheduler"])

    def save_sharded(self, ckpt_dir: str | Path, *, async_save: bool = False) -> Any:
        """Model, optimizer and scheduler as a megatron distributed checkpoint in `ckpt_dir`, which
        any layout and world size can load (`load_sharded`; moe_rl/policy/dist_ckpt.py). Collective."""
        return save_sharded(self, ckpt_dir, async_save=async_save)

    def load_sharded(self, ckpt_dir: str | Path, *, weights_only: bool = False) -> None:
        """Restore `save_sharded`'s checkpoint, whatever layout saved it; `weights_only`: the model
        alone (the optimizer state in it is not read). Collective."""
        (load_sharded_weights if weights_only else load_sharded)(self, ckpt_dir)

    # ------------------------------------------------------------ collectives for the loop

    def all_reduce_sum(self, values: torch.Tensor, group: str = "dp") -> torch.Tensor:
        """Sum a small tensor over the data-parallel group (or the whole world)."""
        return self._all_reduce(values, dist.ReduceOp.SUM, group) if dist.is_initialized() else values

    def all_reduce_max(self, values: torch.Tensor, group: str = "dp") -> torch.Tensor:
        """Element-wise maximum of a small tensor over the data-parallel group (or the whole world)."""
        return self._all_reduce(values, dist.ReduceOp.MAX, group) if dist.is_initialized() else values

    def _all_reduce(self, values: torch.Tensor, op: Any, group: str) -> torch.Tensor:
        """Reduce a copy on the compute device (NCCL groups take no host tensors); return it
        on `values`' device, so callers passing host tensors get host tensors back."""
        out = values.to(compute_device(), copy=True)
        dist.all_reduce(out, op=op, group=self.dp_group if group == "dp" else None)
        return out.to(values.device)


class Policy(MegatronModel):
    """The megatron policy on this rank (call every method on every rank: they are collective)."""

    def per_token(self, logits: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """Log-probs of softmax(logits / T) at the spec's sampling temperature, per token."""
        return microbatch_logprobs(logits, mb, self.spec.temperature)

    def logprobs(self, sequences: list[torch.Tensor], *, record_routes: bool = False,
                 replay_routes: torch.Tensor | None = None, entropy: bool = False,
                 route_confidence: bool = False) -> LogProbs:
        """Per-token log-probs `[B, T - 1]` of this DP rank's sequences, of softmax(logits / T)
        at the spec's sampling temperature T.

        record_routes: also return the routes the routers chose (`[B, T - 1, L, K]`);
            with route_confidence, also each router's confidence (`[B, T - 1, L, 2]`: top-k
            gate mass, k-th minus (k+1)-th logit).
        replay_routes: make the routers use these routes (R3 old-log-prob pass).
        """
        return self._forward(sequences, record_routes=record_routes, replay_routes=replay_routes,
                             entropy=entropy, route_confidence=route_confidence)

    # ------------------------------------------------------------ weights

    def load_hf_weights(self, hf_dir: str | Path) -> None:
        """Copy a HF checkpoint of the same architecture into the model (e.g. a reference model
        for one pass). The optimizer's master copies are not touched: load the policy's own
        checkpoint back before the next update."""
        load_hf_weights(self.chunks, hf_dir, self.arch)

    def export_hf(self, out_dir: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write the current weights as a HF checkpoint (collective); `dtype`: cast them."""
        sync_params(self.opt.chunks)  # overlap_param_gather left the gather to the next forward
        export_hf(self.chunks, out_dir, self.arch, self.hf_config, dtype=dtype)

    def export_peft(self, out_dir: str | Path) -> None:
        """Write the LoRA adapters in PEFT's format (collective; `lora.export_peft`)."""
        if self.spec.lora is None:
            raise ValueError("export_peft: this policy trains the full model (model.lora.rank=0): it has no adapter")
        sync_params(self.opt.chunks)
        export_peft(self.chunks, self.arch, self.spec.lora, str(out_dir), self.spec.hf_dir)

    def hf_tensors(self, spread: bool = False, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for the tensors this rank owns (collective); `spread`: over every data-parallel
        replica (`iter_hf_tensors`), not replica 0 alone; `dtype`: cast before the gathers."""
        sync_params(self.opt.chunks)
        return iter_hf_tensors(self.chunks, self.arch, spread=spread, dtype=dtype)

    # The two methods a weight sync takes (moe_rl.rollout.weight_sync.PolicyWeights).
    def export(self, out_dir: str | Path) -> None:
        """`export_hf`: disk sync."""
        self.export_hf(out_dir)

    def is_source(self) -> bool:
        """Whether this rank owns HF tensors of a push (`named_tensors`), known before the gathers run."""
        return is_hf_writer(spread=True)

    def named_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """`hf_tensors` spread over the data-parallel replicas, in `dtype`: tensor and nccl syncs (each
        sender its share, in the dtype the servers hold)."""
        return self.hf_tensors(spread=True, dtype=dtype)
