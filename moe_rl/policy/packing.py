"""Sequence packing: several sequences in one row, each attending only to itself.

A packed microbatch is one row `[1, S]` holding sequences back to back, then a
padding tail up to the common length S. Positions restart at 0 for each
sequence. Two ways to keep sequences apart, chosen by the attention backend:

- "thd" (transformer-engine, bf16/fp16): megatron's `PackedSeqParams` with
  `cu_seqlens`; TE runs varlen attention and megatron applies rotary embeddings
  per sequence.
- "mask" (the local spec, on CPU and on GPUs without TE): a block-diagonal
  causal mask `[1, 1, S, S]`, and rotary embeddings read at each token's own
  position. megatron's `GPTModel` computes rotary embeddings for positions
  0..S-1 and ignores `position_ids` under rope, so `use_position_ids_for_rope`
  hooks the model to gather them at `position_ids` instead; megatron has no
  option for this outside THD, hence the hook.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PackedRow:
    """The model's view of a packed microbatch.

    tokens, positions: `[1, S]`; starts: `[b]` offset of each sequence in the row;
    cu_seqlens: `[n + 1]` int32 boundaries of the n segments (the sequences, then
    the padding tail as one more segment when there is one); max_seqlen: the
    longest segment (kept on the host: THD needs it as a number); fmt: "thd" or "mask".
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    starts: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    fmt: str

    def to(self, device: torch.device) -> "PackedRow":
        return PackedRow(self.tokens.to(device), self.positions.to(device), self.starts.to(device),
                         self.cu_seqlens.to(device), self.max_seqlen, self.fmt)


def pack_row(sequences: list[torch.Tensor], length: int, fmt: str, pad_id: int = 0) -> PackedRow:
    """Concatenate `sequences` (each `[T_i]`) into a row of `length` tokens."""
    used = sum(s.shape[0] for s in sequences)
    if used > length:
        raise ValueError(f"{used} tokens do not fit a packed row of {length}")
    tokens = torch.full((1, length), pad_id, dtype=torch.long)
    positions = torch.zeros((1, length), dtype=torch.long)
    bounds = [0]
    for seq in sequences:
        a = bounds[-1]
        tokens[0, a: a + len(seq)] = seq
        positions[0, a: a + len(seq)] = torch.arange(len(seq))
        bounds.append(a + len(seq))
    if used < length:
        positions[0, used:] = torch.arange(length - used)
        bounds.append(length)
    return PackedRow(tokens=tokens, positions=positions, starts=torch.tensor(bounds[: len(sequences)]),
                     cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
                     max_seqlen=max(b - a for a, b in zip(bounds, bounds[1:])), fmt=fmt)


def block_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """`[1, 1, S, S]` bool, True where attention is masked: across segments or to the future."""
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device),
                                  (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    t = torch.arange(length, device=cu_seqlens.device)
    allowed = (seg.view(-1, 1) == seg.view(1, -1)) & (t.view(1, -1) <= t.view(-1, 1))
    return (~allowed).view(1, 1, length, length)


def model_kwargs(row: PackedRow) -> dict[str, Any]:
    """The keyword arguments `GPTModel.forward` needs to keep the row's sequences apart."""
    if row.fmt == "mask":
        return {"attention_mask": block_causal_mask(row.cu_seqlens, row.tokens.shape[1])}
    from megatron.core.packed_seq_params import PackedSeqParams

    return {"attention_mask": None,
            "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=row.cu_seqlens,
                                                 cu_seqlens_kv=row.cu_seqlens, max_seqlen_q=row.max_seqlen,
                                                 max_seqlen_kv=row.max_seqlen)}


def unpack(flat: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """Per-sequence rows from a packed row: flat `[S', ...]` -> `[b, width, ...]` (differentiable).

    Row j takes `flat[starts[j] : starts[j] + width]`; entries past the end of the
    row are clamped to its last element (callers mask them).
    """
    idx = (starts.view(-1, 1) + torch.arange(width, device=flat.device).view(1, -1)).clamp(max=flat.shape[0] - 1)
    return flat[idx]


def use_position_ids_for_rope(model: Any) -> None:
    """Make a local-spec `GPTModel` apply rotary embeddings at `position_ids`, per token.

    A pre-hook on the model keeps the call's `position_ids` `[b, s]`; a hook on the
    rotary module turns its `[s, 1, 1, d]` table for positions 0..s-1 into
    `[s, b, 1, d]` rows for the given positions (identical values when positions are
    0..s-1, as for unpacked microbatches). Under multi-latent attention (DeepSeek-V3) the
    model has no rotary module of its own: each layer's attention holds one (YaRN's returns
    `(table, mscale)`), and each is hooked the same way.
    """
    rope = getattr(model, "rotary_pos_emb", None)
    ropes = [rope] if rope is not None else [m for name, m in model.named_modules()
                                             if name.endswith("self_attention.rotary_pos_emb")]
    if not ropes:
        return  # no rotary embedding: position_ids reach the (learned) position embedding as they are
    seen: dict[str, torch.Tensor | None] = {"pos": None}

    def keep_positions(module: Any, args: tuple, kwargs: dict) -> None:
        seen["pos"] = kwargs.get("position_ids", args[1] if len(args) > 1 else None)

    def at_positions(table: torch.Tensor) -> torch.Tensor:
        pos = seen["pos"]
        if pos is None or table.dim() != 4:
            return table
        return table[:, 0, 0, :][pos.t().to(table.device)].unsqueeze(2)

    def gather(module: Any, args: tuple, out: Any) -> Any:
        return (at_positions(out[0]), *out[1:]) if isinstance(out, tuple) else at_positions(out)

    model.register_forward_pre_hook(keep_positions, with_kwargs=True)
    for r in ropes:
        r.register_forward_hook(gather)
