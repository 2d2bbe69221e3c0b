"""Reduce a per-token loss `[B, T]` to a scalar, with normalisers that are global.

Why global normalisers: the trainer splits one RL step's batch into
microbatches (gradient accumulation) and across data-parallel (DP) ranks. A
loss that divides by *local* counts (tokens or sequences in this microbatch)
weights microbatches unequally, so the accumulated gradient depends on how the
batch was cut. Dividing every piece by the count of the *whole* step instead
makes the pieces add up exactly:

    sum over microbatches and DP ranks of aggregate(piece, N_global)
        == aggregate(whole batch)          (and the same for gradients)

Modes (v = per-token values, m = mask, n_i = valid tokens of sequence i,
N_tok / N_seq = global token / sequence counts, L = constant max length):

- ``token-mean``               sum_i sum_t v / N_tok   (DAPO: every token weighs the same)
- ``seq-mean-token-mean``      sum_i (sum_t v / n_i) / N_seq   (GRPO, GSPO, SAPO: every sequence weighs the same)
- ``seq-mean-token-sum``       sum_i (sum_t v) / N_seq
- ``seq-mean-token-sum-norm``  sum_i (sum_t v) / (L * N_seq)   (Dr.GRPO: a constant instead of 1/n_i)

Usage across microbatches and DP ranks (one sequence never spans two pieces)::

    norm = sum((count_normalizers(mb.mask) for mb in my_microbatches), Normalizers.zero())
    counts = torch.stack([norm.num_tokens, norm.num_seqs]); dist.all_reduce(counts)
    for mb in my_microbatches:
        loss, _ = compute_loss(..., global_num_tokens=counts[0], global_num_seqs=counts[1], max_len=L)
        loss.backward()   # moe_rl's DDP sums gradients over DP ranks (calculate_per_token_loss)

With a DDP that averages over DP ranks instead, multiply each loss by the DP size.

A sequence counts towards N_seq when it has at least one valid token, so
all-zero padding rows neither add to nor dilute the loss. Without explicit
normalisers the local counts are used, which is right for a single piece.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.algo._checks import require, require_choice

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

Count = int | float | Tensor


@dataclass(frozen=True)
class Normalizers:
    """Token and sequence counts of one piece of a batch; add pieces, all-reduce over DP."""

    num_tokens: Tensor
    num_seqs: Tensor

    @staticmethod
    def zero() -> "Normalizers":
        return Normalizers(torch.tensor(0), torch.tensor(0))

    def __add__(self, other: "Normalizers") -> "Normalizers":
        return Normalizers(self.num_tokens + other.num_tokens, self.num_seqs + other.num_seqs)


def count_normalizers(mask: Tensor) -> Normalizers:
    """Valid tokens and non-empty sequences of `mask` `[B, T]` (0-dim integer tensors)."""
    mask = mask.bool()
    return Normalizers(mask.sum(), (mask.sum(-1) > 0).sum())


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce `values` `[B, T]` over valid tokens of `mask` `[B, T]` to a 0-dim tensor.

    `global_num_tokens` is used by ``token-mean``; `global_num_seqs` by the
    ``seq-mean-*`` modes; `max_len` (default `T`, the padded length of *this*
    piece, so pass it when pieces are padded differently) by
    ``seq-mean-token-sum-norm``. Masked positions may hold any value, even
    inf or nan: they are selected away, never multiplied by zero.
    """
    require_choice(mode, AGG_MODES, "aggregate", "aggregation mode")
    for name, given in (("global_num_tokens", global_num_tokens), ("global_num_seqs", global_num_seqs)):
        # tensors (e.g. all-reduced counts) are not checked: that would sync with the device
        require(given is None or isinstance(given, Tensor) or given >= 0, "aggregate", name, given, ">= 0")
    require(max_len is None or max_len > 0, "aggregate", "max_len", max_len, "> 0")
    mask = mask.bool()
    # torch.where, not values * mask: 0 * inf is nan
    masked = torch.where(mask, values, 0.0)
    if mode == "token-mean":
        n_tok = _count(global_num_tokens, mask.sum(), values)
        return masked.sum() / n_tok
    tokens_per_seq = mask.sum(-1)
    seq_sums = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        # empty rows have a zero sum; clamp only avoids 0/0
        per_seq = seq_sums / tokens_per_seq.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sums
    else:
        per_seq = seq_sums / (values.shape[-1] if max_len is None else max_len)
    n_seq = _count(global_num_seqs, (tokens_per_seq > 0).sum(), values)
    return per_seq.sum() / n_seq


def _count(given: Count | None, local: Tensor, like: Tensor) -> Tensor:
    """The normaliser as a tensor >= 1 (an empty batch gives loss 0, not nan)."""
    count = local if given is None else given
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


# Statistics over valid tokens, for metrics. An empty mask gives 0, not nan,
# so a padding-only microbatch cannot poison a logged average.


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over `mask` (same shape; bool) as a 0-dim tensor."""
    total = torch.where(mask, x, 0.0).sum()
    return total / mask.sum().clamp(min=1)


def masked_seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean of `x` over valid tokens: `[B, T]` -> `[B, 1]` (0 for empty rows)."""
    total = torch.where(mask, x, 0.0).sum(-1, keepdim=True)
    return total / mask.sum(-1, keepdim=True).clamp(min=1)


def masked_std(x: Tensor, mask: Tensor) -> Tensor:
    """Population standard deviation of `x` over `mask` as a 0-dim tensor."""
    centred = x - masked_mean(x, mask)
    return masked_mean(centred.square(), mask).sqrt()


def masked_min(x: Tensor, mask: Tensor) -> Tensor:
    """Minimum of `x` over `mask`; 0 when nothing is valid."""
    return _masked_extreme(x, mask, largest=False)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Maximum of `x` over `mask`; 0 when nothing is valid."""
    return _masked_extreme(x, mask, largest=True)


def _masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    # fill with the identity of min/max rather than index with the mask: no host sync
    filled = torch.where(mask, x, float("-inf") if largest else float("inf"))
    value = filled.max() if largest else filled.min()
    return torch.where(mask.any(), value, x.new_zeros(()))
