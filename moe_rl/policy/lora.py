"""LoRA adapters on the megatron policy: attention and every MLP, routed experts included, under
TP, SP, PP, EP and DP, with the base frozen.

megatron-core 0.16.1 has no LoRA of its own, and no library adds one to its local layers:
Megatron-Bridge's PEFT wraps them but its wheel needs Python 3.12 and an older transformers, and the
`peft` library adapts HF modules (and its megatron hook expects megatron's fused linear layers to be
HF-shaped, without TP's communication or the fused q/k/v and gate/up layouts). So the adapters are
written here, as small modules hung on megatron's own `ColumnParallelLinear` / `RowParallelLinear`
(a forward hook adds the low-rank term), which leaves every base weight where it was: its name,
its checkpoint entry, its conversion to HF and its weight sync.

What is adapted follows the HF model the adapter is for, so an adapter here is a PEFT adapter there:
each HF projection (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`)
has its own A and B, scaled by alpha / rank, and megatron's fused layers (q/k/v per query group,
gate/up stacked) combine the projections' outputs the way they combine the weights (`families/`).
A routed expert is what transformers 5 makes of it and what PEFT's `target_parameters` adapts: one
`gate_up_proj` (gate and up share A; B's rows are [gate; up]) and one `down_proj`, per expert. SGLang
takes that stacked form as well (its LoRA loader repeats the shared A over the two slots).

Communication, per megatron layer (the adapter's is the layer's own, on its TP group):
- column-parallel (A replicated, B split by output rows like the weight): without SP the rank of x
  goes through `copy_to_tensor_model_parallel_region` (its backward sums the partial gradients of
  A x over TP); with SP A x is gathered over the sequence (`gather_from_sequence_parallel_region`,
  r columns, not the hidden size), and A is marked `sequence_parallel` so megatron sums its
  per-shard gradient over TP in `finalize_model_grads`;
- row-parallel (A split by input columns like the weight, B replicated): the partial A x is summed
  over TP (`reduce_from_tensor_model_parallel_region`) or reduce-scattered to sequence shards under SP
  (B then marked `sequence_parallel`).
A routed expert's layers do no communication of their own (the token dispatcher does it), so their
adapters are local matmuls; expert TP > 1 would split an expert's A x over ranks the dispatcher does
not sum for A's gradient, and is refused.
"""
from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from moe_rl.policy.arch import MoEArch
from moe_rl.policy.convert import RankPlace, chunk_offsets, shard_for
from moe_rl.policy.config import LORA_TARGETS
from moe_rl.policy.families.registry import engine_name

# The HF projection names PEFT users target are transformers' module names: a family whose checkpoint
# names differ, as Mixtral's w1/w2/w3, is read through its `engine_name`.
TARGETS = LORA_TARGETS
_EXPERT = re.compile(r"\.mlp\.experts\.")


class LoraError(ValueError):
    """A LoRA setting this model or layout cannot take."""


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how: PEFT's `r`, `lora_alpha`, `lora_dropout` and `target_modules`."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = TARGETS
    seed: int = 0  # A's initial draw, per projection by its HF name, so every layout draws the same

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, model: Any) -> "LoraSpec | None":
        """The run config's `model` section (`model.lora`, `model.seed`) as a spec; None when off."""
        lora = model.lora
        return cls(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules), model.seed) if lora.rank else None


def _role(hf_name: str) -> str:
    return hf_name.rsplit(".", 2)[-2]  # "...self_attn.q_proj.weight" -> "q_proj"


@dataclass(frozen=True)
class Part:
    """One HF projection's adapter on a megatron layer (or, for a routed expert's fc1, gate and up
    together): its HF weight names, where its output goes in the layer's output and its sizes."""

    key: str  # parameter key in the adapter ("q_proj", "gate_up_proj", ...)
    hf: tuple[str, ...]  # the HF weights it adapts (gate and up for an expert's gate_up_proj)
    in_features: int  # this rank's
    out_features: int  # this rank's


class LoraLinear(torch.nn.Module):
    """The adapters of one megatron linear layer: A and B per part, and the layer's combine of the
    parts' outputs (`kind`: copy, qkv or glu, as in `families.family.Shard`)."""

    def __init__(self, layer: Any, parts: Sequence[Part], kind: str, column: bool, spec: LoraSpec,
                 groups: int = 1) -> None:
        super().__init__()
        self.parts, self.kind, self.column, self.groups = list(parts), kind, column, groups
        self.scale, self.dropout = spec.scale, spec.dropout
        self.tp_group = layer.tp_group
        self.tp = layer.tp_group.size()
        self.sequence_parallel = bool(getattr(layer, "sequence_parallel", False)) and self.tp > 1
        self.local = bool(getattr(layer, "explicit_expert_comm", False)) or self.tp == 1
        dtype, device = layer.weight.dtype, layer.weight.device
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        rank = spec.rank
        tp_rank = layer.tp_group.rank()
        for p in self.parts:
            a = _initial_a(rank, p.in_features * (1 if column else self.tp), p.hf[0], spec.seed)
            if not column:
                a = a.chunk(self.tp, dim=1)[tp_rank]
            self.A[p.key] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.B[p.key] = torch.nn.Parameter(torch.zeros(p.out_features, rank, device=device, dtype=dtype))
            self._mark(self.A[p.key], self.B[p.key])

    def _mark(self, a: torch.nn.Parameter, b: torch.nn.Parameter) -> None:
        """megatron's parameter attributes: which tensors are split over TP (grad-norm counting, export)
        and which need their gradient summed over TP under SP."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        split, whole = (b, a) if self.column else (a, b)
        set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
        if self.sequence_parallel:
            setattr(whole, "sequence_parallel", True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The low-rank term of this rank's output of the layer for input `x` (what the layer itself got)."""
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   gather_from_sequence_parallel_region,
                                                   reduce_from_tensor_model_parallel_region,
                                                   reduce_scatter_to_sequence_parallel_region)

        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        outs = []
        for p in self.parts:
            h = F.linear(x, self.A[p.key])
            if not self.local:
                if self.column:
                    h = (gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel
                         else copy_to_tensor_model_parallel_region(h, group=self.tp_group))
                else:
                    h = (reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                         if self.sequence_parallel else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
            outs.append(F.linear(h, self.B[p.key]) * self.scale)
        return self._combine(outs)

    def _combine(self, outs: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
        """The parts' outputs (or weight rows, `dim` 0) laid out as the fused layer lays out its own."""
        if self.kind == "qkv":  # per local query group [q heads | k | v], as the fused weight's rows
            g, dim = self.groups, dim % outs[0].dim()
            return torch.cat([o.unflatten(dim, (g, -1)) for o in outs], dim=dim + 1).flatten(dim, dim + 1)
        return torch.cat(outs, dim=dim)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """This rank's piece of alpha / rank * B A in the layer's weight layout: what merging adds to the
        weight (pushes and HF exports carry W + this). Local: each rank has its rows (column-parallel)
        or columns (row-parallel) of every part's B A."""
        return self._combine([(self.B[p.key] @ self.A[p.key]) * self.scale for p in self.parts], dim=0)


def _initial_a(rank: int, in_features: int, name: str, seed: int) -> torch.Tensor:
    """PEFT's initial A (kaiming-uniform, a = sqrt(5)), drawn whole from a generator seeded by the
    projection's HF name, so TP ranks agree on a replicated A and slice the same split one."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(rank, in_features)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    return a


def _hook(layer: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    out, bias = output
    return out + layer.lora(args[0] if args else kwargs["input_"]), bias


def _with_adapter(layer: Any) -> Any:
    """The layer's `sharded_state_dict` (megatron's, as `ColumnParallelLinear` / `RowParallelLinear` make
    it) with its adapter in it: the split tensors (B of a column-parallel layer, A of a row-parallel one)
    sharded over TP along their split dimension like the weight, the others replicated (megatron's own
    treats every key it does not know as replicated, which would keep TP rank 0's piece alone)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    lora = layer.lora
    axis = {"weight": 0, "bias": 0} if lora.column else {"weight": 1}
    split = "B" if lora.column else "A"
    axis.update({f"lora.{split}.{p.key}": 0 if lora.column else 1 for p in lora.parts})

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        return make_sharded_tensors_for_checkpoint(layer.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                   sharded_offsets, tp_group=layer.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    return sharded_state_dict


def _parts(name: str, layer: Any, shard: Any, targets: set[str], arch: MoEArch) -> tuple[list[Part], int]:
    """The adapted parts of one megatron linear layer (none when no projection is targeted), and for
    q/k/v the layer's local query groups."""
    chosen = [h for h in shard.hf if _role(h) in targets]
    if not chosen:
        return [], 1
    out_local, in_local = layer.weight.shape
    if shard.dim == 1:  # row-parallel: one projection
        return [Part(_role(chosen[0]), tuple(chosen), in_local, out_local)], 1
    if _EXPERT.search("." + name) and shard.kind == "glu":
        if len(chosen) != 2:
            raise LoraError(f"model.lora.target_modules: a routed expert's gate_proj and up_proj are one weight "
                            f"in HF (gate_up_proj, {name}): target both or neither")
        return [Part("gate_up_proj", tuple(shard.hf), in_local, out_local)], 1
    if shard.kind == "glu":
        return [Part(_role(h), (h,), in_local, out_local // 2) for h in shard.hf if h in chosen], 1
    if shard.kind == "qkv":
        d, per = arch.kv_channels, arch.num_attention_heads // arch.num_query_groups
        groups = out_local // ((per + 2) * d)
        widths = {"q_proj": groups * per * d, "k_proj": groups * d, "v_proj": groups * d}
        if len(chosen) != 3:
            raise LoraError(f"model.lora.target_modules: q_proj, k_proj and v_proj are one fused layer here "
                            f"({name}); target all three or none")
        return [Part(_role(h), (h,), in_local, widths[_role(h)]) for h in shard.hf], groups
    if shard.kind == "copy":
        return [Part(_role(chosen[0]), tuple(chosen), in_local, out_local)], 1
    raise LoraError(f"model.lora: {name} ({shard.kind} layout) cannot take an adapter yet; drop "
                    f"{', '.join(sorted({_role(h) for h in chosen}))} from model.lora.target_modules")


def attach_lora(chunks: list[Any], arch: MoEArch, spec: LoraSpec) -> int:
    """Hang adapters on this rank's targeted linear layers and freeze everything else. Returns the
    number of adapted layers on this rank. Call once, after the base weights are loaded."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    unknown = sorted(set(spec.target_modules) - set(TARGETS))
    if unknown:
        raise LoraError(f"model.lora.target_modules: {unknown} are not projections moe_rl adapts; use some of "
                        f"{list(TARGETS)}")
    if spec.rank < 1:
        raise LoraError(f"model.lora.rank: {spec.rank} must be >= 1")
    from moe_rl.policy.model import use_transformer_engine

    if use_transformer_engine():
        raise LoraError("model.lora: adapters hang on megatron's local linear layers; transformer-engine's fused "
                        "ones (layer norm inside the q/k/v and fc1 GEMMs) cannot take them yet: run without "
                        "transformer-engine or set model.lora.rank=0")
    targets = set(spec.target_modules)
    place = RankPlace.current()
    count = 0
    for model, offset in chunk_offsets(chunks):
        for name, layer in list(model.named_modules()):
            if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) or hasattr(layer, "lora"):
                continue
            shard = _module_names(shard_for(name + ".weight", offset, place, arch))
            if shard is None or shard.dim is None:
                continue
            parts, groups = _parts(name, layer, shard, targets, arch)
            if not parts:
                continue
            if _EXPERT.search("." + name) and place.etp_size > 1:
                raise LoraError("model.lora on routed experts needs parallel.etp=1 (expert TP splits an "
                                "expert's A x over ranks whose gradients of A nobody sums); set parallel.etp=1 "
                                "or drop gate_proj, up_proj and down_proj from model.lora.target_modules")
            layer.lora = LoraLinear(layer, parts, shard.kind, isinstance(layer, ColumnParallelLinear), spec, groups)
            layer.register_forward_hook(_hook, with_kwargs=True)
            layer.weight.lora_delta = layer.lora.delta_weight  # the HF conversion merges it (convert.py)
            layer.sharded_state_dict = _with_adapter(layer)
            count += 1
        for name, module in model.named_modules():
            if hasattr(module, "grouped") and any(hasattr(m, "lora") for m in module.modules()):
                module.grouped = False  # the grouped experts' matmuls bypass the layers' hooks
        for name, param in model.named_parameters():
            param.requires_grad_(is_adapter(name))
            if is_adapter(name) and _EXPERT.search("." + name):
                param.allreduce = False  # an expert's: reduced over expert-DP, as build_model marks the weights
    return count


def is_adapter(name: str) -> bool:
    """Whether a megatron parameter name is an adapter's."""
    return ".lora.A." in name or ".lora.B." in name


def adapter_items(chunks: list[Any], arch: MoEArch) -> Iterator[tuple[str, torch.Tensor, Any, int]]:
    """(PEFT name stem, this rank's tensor, its `LoraLinear`, global expert id or -1) for every adapter
    parameter on this rank; the stem is the HF module path (`model.layers.0.self_attn.q_proj`, and for an
    expert `model.layers.0.mlp.experts` + the part) plus `.lora_A` / `.lora_B`."""
    place = RankPlace.current()
    for model, offset in chunk_offsets(chunks):
        for name, layer in model.named_modules():
            lora = getattr(layer, "lora", None)
            if not isinstance(lora, LoraLinear):
                continue
            shard = _module_names(shard_for(name + ".weight", offset, place, arch))
            expert = _expert_id(shard)
            for p in lora.parts:
                module = p.hf[0].rsplit(".", 1)[0]  # "...q_proj.weight" -> "...q_proj"
                if expert >= 0:
                    module = module.rsplit(".", 1)[0] + "." + p.key  # "...experts.3.gate_proj" -> "...experts.3.gate_up_proj"
                yield f"{module}.lora_A", lora.A[p.key], lora, expert
                yield f"{module}.lora_B", lora.B[p.key], lora, expert


def _module_names(shard: Any) -> Any:
    """The shard with its HF names as transformers' (and PEFT's) module names."""
    return None if shard is None else replace(shard, hf=tuple(engine_name(h) for h in shard.hf))


def _expert_id(shard: Any) -> int:
    m = re.search(r"\.experts\.(\d+)\.", shard.hf[0])
    return int(m.group(1)) if m else -1


@torch.no_grad()
def whole_adapters(chunks: list[Any], arch: MoEArch) -> dict[str, torch.Tensor]:
    """This rank's adapters as whole tensors (gathered over TP; a routed expert's: this rank's experts),
    named as `adapter_items` names them (collective over each layer's TP group)."""
    import torch.distributed as dist

    out = {}
    for stem, param, lora, _ in adapter_items(chunks, arch):
        t = param.detach()
        if _split(stem, lora) and not lora.local:
            pieces = [torch.empty_like(t) for _ in range(lora.tp)]
            dist.all_gather(pieces, t.contiguous(), group=lora.tp_group)
            t = torch.cat(pieces, dim=0 if lora.column else 1)
        out[stem] = t.clone()
    return out


def _split(stem: str, lora: LoraLinear) -> bool:
    """Whether this adapter tensor is split over TP like its layer's weight (B of a column-parallel layer,
    A of a row-parallel one)."""
    return stem.endswith("lora_B") if lora.column else stem.endswith("lora_A")


_EXPERT_STEM = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(lora_[AB])$")
EXPERT_PARTS = ("gate_up_proj", "down_proj")  # PEFT's target_parameters order (its wrappers nest by it)


def peft_tensors(whole: dict[str, torch.Tensor], num_experts: int) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Whole adapters (every rank's, merged) in PEFT's names and layout for the transformers model:
    projections as `base_model.model.<module>.lora_A|B.weight`; a layer's routed experts stacked as
    PEFT's `target_parameters` wrapper holds them (A [r*E, in], expert e's rows e*r..; B [out, r*E],
    column j*E + e), the first-listed parameter's wrapper the innermost (`.base_layer`). Returns the
    tensors, `target_modules` and `target_parameters`."""
    out: dict[str, torch.Tensor] = {}
    modules, params = set(), set()
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for stem, t in whole.items():
        if m := _EXPERT_STEM.match(stem):
            experts.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = t
            params.add(m.group(3))
        else:
            out[f"base_model.model.{stem}.weight"] = t
            modules.add(stem.rsplit(".", 2)[-2])
    parts = [p for p in EXPERT_PARTS if p in params]
    for (path, part, ab), per in experts.items():
        if sorted(per) != list(range(num_experts)):
            raise LoraError(f"{path}.{part}: adapters of experts {sorted(per)} only; every rank's are needed")
        nest = ".base_layer" * (len(parts) - 1 - parts.index(part))
        stacked = [per[e] for e in range(num_experts)]
        t = torch.cat(stacked, 0) if ab == "lora_A" else torch.stack(stacked, -1).flatten(1)
        out[f"base_model.model.{path}{nest}.{ab}.weight"] = t
    return out, sorted(modules), [f"mlp.experts.{p}" for p in parts]


@torch.no_grad()
def export_peft(chunks: list[Any], arch: MoEArch, spec: LoraSpec, out_dir: str, base_model: str = "") -> None:
    """Write the adapters as a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`) that
    `peft.PeftModel.from_pretrained` loads on the HF base (collective; rank 0 writes). The adapters are
    gathered whole to rank 0 (small beside the model, not small: rank 8 on every routed expert of
    Qwen3-30B-A3B is ~0.3 B parameters, 1.3 GB in fp32; a streaming writer is left for later)."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    mine = {k: v.cpu() for k, v in whole_adapters(chunks, arch).items()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    every: list[Any] = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, every, dst=0)
    if rank != 0:
        dist.barrier()
        return
    whole = {k: v for part in every for k, v in part.items()}
    tensors, modules, params = peft_tensors(whole, arch.num_moe_experts or 0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "bias": "none",
              "target_modules": modules, "target_parameters": params or None, "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()


def read_peft(path: str, arch: MoEArch) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter directory (`export_peft`'s, or PEFT's `save_pretrained` of a transformers 5
    model) for `arch`, as a `LoraSpec` and whole tensors in `adapter_items`' names, for `set_adapters`.
    A layer's two routed-expert wrappers are told apart by their shapes (gate_up_proj: A [r*E, hidden],
    B [2 * expert FFN, r*E]; down_proj: A [r*E, expert FFN], B [hidden, r*E]): PEFT nests them in the
    order it was given, which its saved config need not keep."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    modules, params = cfg.get("target_modules") or [], cfg.get("target_parameters") or []
    if cfg.get("peft_type") != "LORA" or isinstance(modules, str):
        raise LoraError(f"{path}: a LoRA adapter with target_modules as a list is needed (got peft_type "
                        f"{cfg.get('peft_type')!r}, target_modules {modules!r})")
    if cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise LoraError(f"{path}: DoRA, rsLoRA and per-module ranks or alphas are not supported")
    parts = {p.rsplit(".", 1)[-1] for p in params}
    if parts - set(EXPERT_PARTS):
        raise LoraError(f"{path}: target_parameters {sorted(parts - set(EXPERT_PARTS))} are not routed experts' "
                        f"{list(EXPERT_PARTS)}")
    targets = set(modules)
    if "gate_up_proj" in parts:
        targets |= {"gate_proj", "up_proj"}
    if "down_proj" in parts:
        targets.add("down_proj")
    spec = LoraSpec(int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout") or 0.0),
                    tuple(t for t in TARGETS if t in targets))
    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    whole: dict[str, torch.Tensor] = {}
    shapes = {"gate_up_proj": (arch.hidden_size, 2 * (arch.moe_ffn_hidden_size or 0)),
              "down_proj": (arch.moe_ffn_hidden_size, arch.hidden_size)}
    for name, t in tensors.items():
        stem = name.removeprefix("base_model.model.").removesuffix(".weight")
        module, ab = stem.rsplit(".", 1)
        if not module.endswith(".experts") and ".experts.base_layer" not in module:
            whole[stem] = t
            continue
        a, b = (tensors[name.replace(f".{ab}.", f".{x}.")] for x in ("lora_A", "lora_B"))
        part = next((p for p, shape in shapes.items() if (a.shape[1], b.shape[0]) == shape), None)
        if part is None:
            raise LoraError(f"{path}: {name}: shapes {tuple(a.shape)} / {tuple(b.shape)} fit neither routed-expert "
                            f"weight of this model")
        r, base = spec.rank, module.replace(".base_layer", "")
        experts = a.shape[0] // r
        for e in range(experts):
            whole[f"{base}.{e}.{part}.{ab}"] = (t.reshape(experts, r, -1)[e] if ab == "lora_A"
                                                else t.reshape(t.shape[0], r, experts)[:, :, e]).clone()
    return spec, whole


@torch.no_grad()
def set_adapters(chunks: list[Any], arch: MoEArch, full: dict[str, torch.Tensor]) -> int:
    """Copy whole (unsplit) adapter tensors, named as `adapter_items` names them (`...q_proj.lora_A`,
    `...experts.3.gate_up_proj.lora_B`), into this rank's pieces. Returns how many were set; a missing
    or misshapen one is an error naming it."""
    count = 0
    for stem, param, lora, _ in adapter_items(chunks, arch):
        if stem not in full:
            raise LoraError(f"adapter tensor {stem} is missing")
        t = full[stem]
        if _split(stem, lora) and not lora.local:
            t = t.chunk(lora.tp, dim=0 if lora.column else 1)[lora.tp_group.rank()]
        if tuple(t.shape) != tuple(param.shape):
            raise LoraError(f"adapter tensor {stem}: shape {tuple(full[stem].shape)} does not fit this model "
                            f"(this rank's piece {tuple(param.shape)})")
        param.copy_(t.to(param.dtype))
        count += 1
    return count
