"""HF safetensors <-> megatron-core model state, for any TP/PP/VPP/EP/ETP layout.

Import: every rank reads, tensor by tensor, only the HF tensors its own shard
needs (its pipeline stage's layers, its experts) and slices them for its TP/ETP
rank, so no rank ever holds the whole model.

Export: tensors are gathered over TP (dense) or ETP (experts) one at a time; one
writer per shard group (DP rank 0 and TP rank 0 for dense weights, expert-DP rank 0
and ETP rank 0 for experts) streams them into safetensors files of bounded size.
Rank 0 then names the files `model-0000i-of-0000N.safetensors` and writes
`model.safetensors.index.json` with the config, giving a standard HF checkpoint
with per-expert tensor names that transformers and SGLang load.

Written by hand because no maintained library maps megatron-core's local and
transformer-engine parameter names to HF for arbitrary layouts (each family's names
are in `families/<name>.py`; the slicing and gathering by them is here)
(megatron-bridge targets NeMo's stack and is not a dependency here).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from moe_rl.policy.arch import MoEArch
from moe_rl.policy.families.family import Shard
from moe_rl.policy.families.registry import WEIGHT_MAPS


class ConversionError(ValueError):
    """A tensor is missing or has the wrong shape."""


# ---------------------------------------------------------------- reading HF checkpoints

class HFCheckpoint:
    """Lazy access to the tensors of a HF safetensors checkpoint (single file or sharded)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            with safe_open(self.dir / "model.safetensors", "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ConversionError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.dir / file, "pt")
        return self._handles[file].get_tensor(name)


# ---------------------------------------------------------------- the weight map (each family's: families/)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")


@dataclass(frozen=True)
class RankPlace:
    """This rank's coordinates in every group the weight map needs."""

    tp_rank: int
    tp_size: int
    etp_rank: int
    etp_size: int
    ep_rank: int
    ep_size: int
    dp_rank: int
    edp_rank: int
    dp_size: int = 1
    edp_size: int = 1

    @classmethod
    def current(cls) -> "RankPlace":
        from megatron.core import parallel_state as ps

        return cls(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                   etp_rank=ps.get_expert_tensor_parallel_rank(),
                   etp_size=ps.get_expert_tensor_parallel_world_size(),
                   ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                   dp_rank=ps.get_data_parallel_rank(), edp_rank=ps.get_expert_data_parallel_rank(),
                   dp_size=ps.get_data_parallel_world_size(), edp_size=ps.get_expert_data_parallel_world_size())


def shard_for(name: str, offset: int, place: RankPlace, arch: MoEArch) -> Shard | None:
    """The Shard of a chunk-local megatron parameter name (layer ids made global)."""
    wmap = WEIGHT_MAPS[arch.family]
    m = _LAYER.match(name)
    if not m:
        return wmap(name, None, None, arch)
    layer, rest = offset + int(m.group(1)), m.group(2)
    em = _LOCAL_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
    if em:
        local, fc = (int(em.group(1)), em.group(2)) if em.re is _LOCAL_EXPERT else (int(em.group(2)), em.group(1))
        per_rank = arch.num_moe_experts // place.ep_size
        return wmap(fc, layer, place.ep_rank * per_rank + local, arch)
    return wmap(rest, layer, None, arch)


def _qkv_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: MoEArch) -> torch.Tensor:
    """HF q/k/v -> megatron's fused layout: per query group [q heads..., k, v] rows (biases: entries)."""
    if q.dim() == 1:
        return _qkv_full(q[:, None], k[:, None], v[:, None], arch)[:, 0]
    g, d = arch.num_query_groups, arch.kv_channels
    qg = q.reshape(g, -1, d, q.shape[-1])
    return torch.cat([qg, k.reshape(g, 1, d, -1), v.reshape(g, 1, d, -1)], dim=1).reshape(-1, q.shape[-1])


def _qkv_split(w: torch.Tensor, arch: MoEArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if w.dim() == 1:
        return tuple(t[:, 0] for t in _qkv_split(w[:, None], arch))  # type: ignore[return-value]
    g, d = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // g
    x = w.reshape(g, per + 2, d, w.shape[-1])
    return (x[:, :per].reshape(-1, w.shape[-1]), x[:, per].reshape(-1, w.shape[-1]),
            x[:, per + 1].reshape(-1, w.shape[-1]))


def _qgkv_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: MoEArch) -> torch.Tensor:
    """HF gated q ([q_h | gate_h] per head), k, v -> megatron's per query group [q... | gate... | k | v]."""
    g, d, cols = arch.num_query_groups, arch.kv_channels, q.shape[-1]
    qg = q.reshape(g, -1, 2, d, cols)
    return torch.cat([qg[:, :, 0], qg[:, :, 1], k.reshape(g, 1, d, cols), v.reshape(g, 1, d, cols)],
                     dim=1).reshape(-1, cols)


def _qgkv_split(w: torch.Tensor, arch: MoEArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, cols = arch.num_query_groups, arch.kv_channels, w.shape[-1]
    per = arch.num_attention_heads // g
    x = w.reshape(g, 2 * per + 2, d, cols)
    q = torch.stack([x[:, :per], x[:, per:2 * per]], dim=2)  # [g, per, (q, gate), d, cols]
    return q.reshape(-1, cols), x[:, 2 * per].reshape(-1, cols), x[:, 2 * per + 1].reshape(-1, cols)


def _gdn_sizes(arch: MoEArch, with_gates: bool) -> list[int]:
    """Row counts of megatron's delta-net parts: [q, k, v] (the conv) or [q, k, v, z, b, a] (in_proj)."""
    la = arch.linear_attention
    qk, v = la.key_heads * la.key_head_dim, la.value_heads * la.value_head_dim
    return [qk, qk, v, v, la.value_heads, la.value_heads] if with_gates else [qk, qk, v]


def _gdn_in_full(*parts: torch.Tensor, arch: MoEArch) -> torch.Tensor:
    """HF in_proj_qkvz (per key head [q | k | v | z]) and in_proj_ba (per key head [b | a]) -> megatron's
    [q | k | v | z | b | a], each part key-head major; Qwen3.5-MoE's four projections are that already."""
    if len(parts) == 4:
        return torch.cat(parts)
    qkvz, ba = parts
    la = arch.linear_attention
    r, cols = la.value_heads // la.key_heads, qkvz.shape[-1]
    x = qkvz.reshape(la.key_heads, -1, cols)
    y = ba.reshape(la.key_heads, 2 * r, cols)
    parts = list(torch.split(x, [la.key_head_dim, la.key_head_dim, r * la.value_head_dim, r * la.value_head_dim], 1))
    parts += list(torch.split(y, [r, r], 1))
    return torch.cat([t.reshape(-1, cols) for t in parts])


def _gdn_in_split(w: torch.Tensor, arch: MoEArch, names: int) -> tuple[torch.Tensor, ...]:
    la = arch.linear_attention
    cols = w.shape[-1]
    if names == 4:  # Qwen3.5-MoE: in_proj_qkv, _z, _b, _a
        sizes = _gdn_sizes(arch, True)
        return tuple(torch.split(w, [sum(sizes[:3]), *sizes[3:]]))
    q, k, v, z, b, a = (t.reshape(la.key_heads, -1, cols) for t in torch.split(w, _gdn_sizes(arch, True)))
    return torch.cat([q, k, v, z], 1).reshape(-1, cols), torch.cat([b, a], 1).reshape(-1, cols)


def _rank_and_size(shard: Shard, place: RankPlace) -> tuple[int, int]:
    return (place.tp_rank, place.tp_size) if shard.group == "tp" else (place.etp_rank, place.etp_size)


def _local_slice(shard: Shard, parts: list[torch.Tensor], place: RankPlace, arch: MoEArch) -> torch.Tensor:
    """Build this rank's piece of a megatron tensor from full HF tensors."""
    rank, size = _rank_and_size(shard, place)
    if shard.kind == "qkv":
        full = _qkv_full(*parts, arch)
        return full.chunk(size, dim=0)[rank]
    if shard.kind == "glu":
        return torch.cat([p.chunk(size, dim=0)[rank] for p in parts], dim=0)
    if shard.kind == "qgkv":
        return _qgkv_full(*parts, arch).chunk(size, dim=0)[rank]
    if shard.kind in ("gdn_in", "gdn_conv"):
        full = _gdn_in_full(*parts, arch=arch) if shard.kind == "gdn_in" else parts[0]
        pieces = torch.split(full, _gdn_sizes(arch, shard.kind == "gdn_in"))
        return torch.cat([p.chunk(size, dim=0)[rank] for p in pieces], dim=0)
    (t,) = parts
    return t if shard.dim is None else t.chunk(size, dim=shard.dim)[rank]


# Buffers that are weights of the checkpoint: a sigmoid router's selection bias (not trained by the
# optimizer; megatron's aux-loss-free balancing may update it, and the engines must get it).
_WEIGHT_BUFFERS = ("mlp.router.expert_bias",)


def chunk_offsets(chunks: list[Any]) -> Iterator[tuple[Any, int]]:
    """(bare model, global index of its first layer) per chunk of this rank."""
    from moe_rl.policy.model import layer_offset

    for chunk in chunks:
        model = unwrap(chunk)
        yield model, layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None))


def _param_items(chunks: list[Any], buffers: bool = True) -> Iterator[tuple[int, str, torch.Tensor, int]]:
    """(chunk index, name, parameter, layer offset) over this rank's chunks, in a fixed order; with
    `buffers`, the checkpoint's buffers (`_WEIGHT_BUFFERS`) after the parameters. LoRA adapters
    (`policy/lora.py`, `<layer>.lora.A|B.<part>`) are not the base checkpoint's and are left out."""
    for i, (model, offset) in enumerate(chunk_offsets(chunks)):
        for name, param in model.named_parameters():
            if ".lora.A." not in name and ".lora.B." not in name:
                yield i, name, param, offset
        if buffers:
            for name, buf in model.named_buffers():
                if buf is not None and name.endswith(_WEIGHT_BUFFERS):
                    yield i, name, buf, offset


def unwrap(module: Any) -> Any:
    while hasattr(module, "module"):
        module = module.module
    return module


@torch.no_grad()
def load_hf_weights(chunks: list[Any], hf_dir: str | Path, arch: MoEArch) -> int:
    """Copy a HF checkpoint into this rank's model chunks. Returns the number of tensors set.

    Fails with the parameter's name and both shapes when a tensor does not fit.
    """
    ckpt = HFCheckpoint(hf_dir)
    place = RankPlace.current()
    count = 0
    for _, name, param, offset in _param_items(chunks):
        shard = shard_for(name, offset, place, arch)
        if shard is None:
            raise ConversionError(f"megatron parameter {name!r} has no HF counterpart for {arch.family}")
        piece = _local_slice(shard, [ckpt.get(h) for h in shard.hf], place, arch)
        if tuple(piece.shape) != tuple(param.shape):
            raise ConversionError(f"{name} (from {', '.join(shard.hf)}): checkpoint gives shape "
                                  f"{tuple(piece.shape)}, model expects {tuple(param.shape)}")
        param.copy_(piece.to(param.dtype))
        count += 1
    return count


# ---------------------------------------------------------------- export

def _gather(t: torch.Tensor, shard: Shard, place: RankPlace, arch: MoEArch) -> torch.Tensor:
    """All-gather a sharded tensor over its group and undo the sharding."""
    from megatron.core import parallel_state as ps

    rank, size = _rank_and_size(shard, place)
    if shard.dim is None or size == 1:
        return t
    group = ps.get_tensor_model_parallel_group() if shard.group == "tp" else ps.get_expert_tensor_parallel_group()
    pieces = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(pieces, t.contiguous(), group=group)
    if shard.kind == "glu":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])], dim=0)
    if shard.kind in ("gdn_in", "gdn_conv"):  # each rank holds its share of every part
        sizes = [n // size for n in _gdn_sizes(arch, shard.kind == "gdn_in")]
        split = [torch.split(p, sizes) for p in pieces]
        return torch.cat([torch.cat([s[i] for s in split]) for i in range(len(sizes))], dim=0)
    return torch.cat(pieces, dim=shard.dim)


def _to_hf(full: torch.Tensor, shard: Shard, arch: MoEArch) -> list[tuple[str, torch.Tensor]]:
    if shard.kind == "qkv":
        return list(zip(shard.hf, _qkv_split(full, arch)))
    if shard.kind == "glu":
        return list(zip(shard.hf, full.chunk(2, dim=0)))
    if shard.kind == "qgkv":
        return list(zip(shard.hf, _qgkv_split(full, arch)))
    if shard.kind == "gdn_in":
        return list(zip(shard.hf, _gdn_in_split(full, arch, len(shard.hf))))
    return [(shard.hf[0], full)]


class _ShardWriter:
    """Streams tensors into safetensors files of at most `max_bytes` each."""

    def __init__(self, out_dir: Path, tag: str, max_bytes: int) -> None:
        self.out_dir, self.tag, self.max_bytes = out_dir, tag, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor.detach().to("cpu").contiguous().clone()
        self.size += nbytes

    def flush(self) -> None:
        if not self.buffer:
            return
        fname = f"part-{self.tag}-{len(self.files):05d}.safetensors"
        save_file(self.buffer, str(self.out_dir / fname), metadata={"format": "pt"})
        self.files.append((fname, list(self.buffer)))
        self.buffer, self.size = {}, 0


def _writes(shard: Shard, place: RankPlace, index: int) -> bool:
    """Whether this rank writes the tensor(s) of its `index`-th parameter (one rank of the whole job does):
    tensor-parallel rank 0 of one data-parallel replica, the replicas taking the parameters in turn, so
    the weight push and the export spread over every replica rather than one (experts alike, over the
    expert-data-parallel replicas, at expert-tensor rank 0)."""
    if shard.group == "etp":
        return place.etp_rank == 0 and index % place.edp_size == place.edp_rank
    return place.tp_rank == 0 and index % place.dp_size == place.dp_rank


def is_hf_writer(spread: bool = False) -> bool:
    """Whether `iter_hf_tensors(..., spread=spread)` yields tensors on this rank: tensor-parallel rank 0 of
    data-parallel replica 0 (the dense tensors of its stage) or expert-tensor rank 0 of expert-data
    replica 0 (its experts); with `spread`, of any replica (they take the parameters in turn). Known
    without iterating, which runs the gathers."""
    place = RankPlace.current()
    if spread:
        return place.tp_rank == 0 or place.etp_rank == 0
    return (place.dp_rank == 0 and place.tp_rank == 0) or (place.edp_rank == 0 and place.etp_rank == 0)


@torch.no_grad()
def iter_hf_tensors(chunks: list[Any], arch: MoEArch, buffers: bool = True, spread: bool = False,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the tensors this rank writes (collective: call on every rank).

    Each HF tensor is yielded by exactly one rank of the whole job; the others take
    part in the TP / ETP gathers and yield nothing for it. `buffers`: with the checkpoint's
    buffers (a router's selection bias); off for gradients, which buffers have none.
    `spread`: the data-parallel replicas (expert-data-parallel for experts) take the parameters
    in turn, so a weight push leaves every replica with a share; else replica 0 writes them all
    (gradients, whose replicas may hold only their own reduced shard, need that). `dtype`: cast
    before the gathers (a push in the servers' bf16 gathers half the bytes of fp32 parameters).
    A layer with LoRA adapters (`policy/lora.py`) gives its merged weight.
    """
    place = RankPlace.current()
    for index, (_, name, param, offset) in enumerate(_param_items(chunks, buffers)):
        shard = shard_for(name, offset, place, arch)
        if shard is None:
            raise ConversionError(f"megatron parameter {name!r} has no HF counterpart for {arch.family}")
        data = param.data
        if (delta := getattr(param, "lora_delta", None)) is not None:  # a LoRA'd layer: W + alpha / r * B A
            data = data + delta()
        full = _gather(data if dtype is None else data.to(dtype), shard, place, arch)
        if not _writes(shard, place, index if spread else 0) or (name == "output_layer.weight" and arch.tie_word_embeddings):
            continue
        yield from _to_hf(full, shard, arch)


@torch.no_grad()
def export_hf(chunks: list[Any], out_dir: str | Path, arch: MoEArch, hf_config: dict[str, Any],
              dtype: torch.dtype | None = None, max_shard_bytes: int = 2 << 30) -> Path | None:
    """Write this model as a HF checkpoint into `out_dir` (collective: call on every rank).

    `out_dir` must be on a filesystem all ranks see. Returns the directory on rank 0.
    Tied output weights are written once (as the embedding).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, f"r{rank:05d}", max_shard_bytes)
    for hf_name, t in iter_hf_tensors(chunks, arch):
        writer.add(hf_name, t if dtype is None else t.to(dtype))
    writer.flush()
    files = writer.files
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, files)
        files = [f for per_rank in gathered for f in per_rank]
    if rank == 0:
        _finalize(out, files, hf_config)
    if dist.is_initialized():
        dist.barrier()
    return out if rank == 0 else None


def _file_mode() -> int:
    """0o666 less the umask, the mode open() gives (read from /proc: setting it to read it races threads)."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as f:
        return next((0o666 & ~int(line.split()[1], 8) for line in f if line.startswith("Umask:")), 0o644)
    return 0o644


def _finalize(out: Path, files: list[tuple[str, list[str]]], hf_config: dict[str, Any]) -> None:
    """Rename the parts to HF's shard names and write the index and config."""
    n = len(files)
    weight_map: dict[str, str] = {}
    total = 0
    mode = _file_mode()
    for i, (tmp, names) in enumerate(sorted(files)):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.chmod(out / tmp, mode)  # safetensors writes 0600: readable as the other files are
        os.replace(out / tmp, out / final)
        total += (out / final).stat().st_size
        for name in names:
            if name in weight_map:
                raise ConversionError(f"tensor {name} written twice ({weight_map[name]} and {final})")
            weight_map[name] = final
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))


def copy_aux_files(src: str | Path, dst: str | Path) -> None:
    """Copy tokenizer and generation files (everything but weights and config) between HF dirs."""
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(f, Path(dst) / f.name)
