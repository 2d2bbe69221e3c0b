"""One sampling step of `LocalEngine`: the token of each row and its log-probs.

Log-probs: `log_softmax(logits / T)[token]`, the distribution the token was sampled from (before top-k /
top-p truncation), as SGLang's sampler returns by default (sglang/srt/layers/sampler.py) and as the
trainer recomputes it. Greedy rows count as T = 1 (SGLang's normalize() turns temperature 0 into top_k=1
at T = 1). `mode="raw"` gives log_softmax(logits) at any T (SGLANG_RETURN_ORIGINAL_LOGPROB=1).
SGLang's top logprobs and token-id logprobs of output tokens are read from the same distribution
(layers/logprob_processor.py); those of prompt tokens from log_softmax(logits), unscaled.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from moe_rl.rollout.engine import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator],
           mode: str = "scaled") -> tuple[list[int], list[float], torch.Tensor]:
    """One token per row of `logits` [B, V]: (tokens, their log-probs, the log-prob rows [B, V])."""
    logits = logits.float().cpu()
    B, V = logits.shape
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params]).view(B, 1)
    scaled = logits / temps
    logp = torch.log_softmax(logits if mode == "raw" else scaled, dim=-1)
    greedy = torch.tensor([p.greedy for p in params])
    u = torch.stack([torch.rand((), generator=g) for g in gens]).view(B, 1)
    # Inverse-CDF sampling over the tokens sorted by probability, for every row alike, so a
    # row's token depends only on its logits and its own generator (not on its batch company).
    # top-k keeps ranks < k; top-p keeps the smallest prefix whose mass reaches top_p (a token
    # is dropped when the mass before it already exceeds top_p).
    srt, index = scaled.sort(dim=-1, descending=True, stable=True)
    ks = torch.tensor([V if p.top_k == -1 else min(p.top_k, V) for p in params]).view(B, 1)
    srt = srt.masked_fill(torch.arange(V).view(1, V) >= ks, -math.inf)
    probs = torch.softmax(srt, dim=-1)
    tps = torch.tensor([p.top_p for p in params]).view(B, 1)
    probs = probs.masked_fill((probs.cumsum(-1) - probs) > tps, 0.0)
    cdf = probs.cumsum(-1)
    choice = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp(max=V - 1).view(B)
    tok = index.gather(1, choice.view(B, 1)).view(B)
    tok = torch.where(greedy, logits.argmax(-1), tok)
    lp = logp.gather(1, tok.view(B, 1)).view(B)
    return tok.tolist(), lp.tolist(), logp


def top_logprobs(logp: torch.Tensor, n: int) -> tuple[list[float], list[int]]:
    """The `n` largest log-probs of one row and their token ids (SGLang's get_top_logprobs)."""
    vals, ids = logp.topk(min(n, logp.shape[-1]))
    return vals.tolist(), ids.tolist()


def ids_logprobs(logp: torch.Tensor, ids: Sequence[int]) -> tuple[list[float], list[int]]:
    """The log-probs of `ids` in one row (SGLang's get_token_ids_logprobs)."""
    return logp[list(ids)].tolist(), list(ids)


def prompt_logprobs(tokens: Sequence[int], start: int, logits: torch.Tensor, top_n: int,
                    ids: Sequence[int] | None) -> tuple[list, list | None, list | None]:
    """SGLang's prompt log-probs from `start` (logprob_start_len), log_softmax(logits) without temperature
    (its logits processor's input_token_logprobs): None for token `start`, then each token's given those
    before it; `logits` [len - 1 - start, V] at positions start .. len - 2. With them the top_n best and
    the `ids` tokens' per position (None first), as SGLang's input_top_logprobs / input_token_ids_logprobs."""
    if start >= len(tokens):
        return [], [] if top_n else None, [] if ids is not None else None
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)
    nxt = torch.tensor(list(tokens[start + 1:]), dtype=torch.long).view(-1, 1)
    lps = [None] + logp.gather(1, nxt).view(-1).tolist()
    top = [None] + [top_logprobs(row, top_n) for row in logp] if top_n else None
    by_id = [None] + [ids_logprobs(row, ids) for row in logp] if ids is not None else None
    return lps, top, by_id
