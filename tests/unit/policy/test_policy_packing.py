"""Packed rows: layout, block-diagonal causal mask, unpacking, rotary positions per token."""
from __future__ import annotations

import torch

from moe_rl.policy.packing import block_causal_mask, pack_row, unpack, use_position_ids_for_rope


def test_pack_row_layout():
    row = pack_row([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], length=8, fmt="mask")
    assert row.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert row.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert row.starts.tolist() == [0, 3]
    assert row.cu_seqlens.tolist() == [0, 3, 5, 8] and row.cu_seqlens.dtype == torch.int32
    full = pack_row([torch.tensor([1, 2]), torch.tensor([3, 4])], length=4, fmt="thd")
    assert full.cu_seqlens.tolist() == [0, 2, 4]


def test_block_causal_mask_matches_per_segment_causal():
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    mask = block_causal_mask(cu, 8)[0, 0]
    for q in range(8):
        for k in range(8):
            seg_q = int((cu[1:] <= q).sum())
            seg_k = int((cu[1:] <= k).sum())
            allowed = seg_q == seg_k and k <= q
            assert bool(mask[q, k]) == (not allowed), (q, k)


def test_unpack_gathers_each_sequence_and_is_differentiable():
    flat = torch.arange(10.0, requires_grad=True)
    out = unpack(flat, torch.tensor([0, 4, 7]), width=4)
    assert out.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [7, 8, 9, 9]]  # past the end: clamped
    out[1].sum().backward()
    assert flat.grad.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]


class _Rope(torch.nn.Module):
    """Stands in for megatron's RotaryEmbedding: a `[s, 1, 1, d]` table for positions 0..s-1."""

    def forward(self, seq_len: int) -> torch.Tensor:
        return torch.arange(seq_len, dtype=torch.float).view(-1, 1, 1, 1).repeat(1, 1, 1, 4)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary_pos_emb = _Rope()

    def forward(self, input_ids, position_ids, attention_mask=None):
        return self.rotary_pos_emb(input_ids.shape[1])


def test_rope_follows_position_ids():
    model = _Model()
    use_position_ids_for_rope(model)
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    table = model(torch.zeros(2, 5, dtype=torch.long), pos, attention_mask=None)
    assert table.shape == (5, 2, 1, 4)
    assert table[:, :, 0, 0].t().tolist() == pos.float().tolist()
    plain = model(torch.zeros(1, 5, dtype=torch.long), position_ids=torch.arange(5).view(1, -1))
    assert torch.equal(plain, _Rope()(5))  # positions 0..s-1: the table unchanged


def test_model_kwargs_thd_and_mask():
    """THD (transformer-engine) gets PackedSeqParams with the row's boundaries; the local spec a mask."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from moe_rl.policy.packing import model_kwargs

    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    thd = model_kwargs(pack_row(seqs, length=8, fmt="thd"))
    p = thd["packed_seq_params"]
    assert isinstance(p, PackedSeqParams) and p.qkv_format == "thd" and thd["attention_mask"] is None
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 3, 5, 8]
    assert p.max_seqlen_q == p.max_seqlen_kv == 3
    mask = model_kwargs(pack_row(seqs, length=8, fmt="mask"))
    assert set(mask) == {"attention_mask"} and mask["attention_mask"].shape == (1, 1, 8, 8)


def test_packed_format_refuses_fp32_under_transformer_engine(monkeypatch):
    import types

    import pytest

    import moe_rl.policy.perf as perf
    from moe_rl.policy.forward import packed_format

    chunk = lambda dtype: types.SimpleNamespace(config=types.SimpleNamespace(params_dtype=dtype))  # noqa: E731
    monkeypatch.setattr(perf, "use_transformer_engine", lambda: False)
    assert packed_format([chunk(torch.float32)]) == "mask"
    monkeypatch.setattr(perf, "use_transformer_engine", lambda: True)
    assert packed_format([chunk(torch.bfloat16)]) == "thd"
    with pytest.raises(ValueError, match="need model.dtype bf16 or fp16.*max_tokens_per_microbatch=null"):
        packed_format([chunk(torch.float32)])
