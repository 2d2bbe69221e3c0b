"""Checkpoint tensors that SGLang's loaders fuse inside one `load_weights` call, so a weight push must
send them together.

SGLang 0.5.23's DeepSeek loader (`srt/models/deepseek_common/deepseek_weight_loader.py`, used for
DeepSeek-V3, Kimi-K2 and Moonlight) concatenates each layer's `q_a_proj` and `kv_a_proj_with_mqa`
into `fused_qkv_a_proj_with_mqa` once both have arrived, from a cache local to the call: a call that
brings one of them without the other drops it, and that layer keeps its old weights without a word.
Pushes therefore keep each pair adjacent (`pair_fused`) and in one bucket (`buckets.plan_buckets`),
and `moe-rl serve` refuses a push that splits one, as SGLang would lose it.
"""
from __future__ import annotations

import re
from typing import Iterable, TypeVar

_PAIR = re.compile(r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$")
_OTHER = {"q_a_proj": "kv_a_proj_with_mqa", "kv_a_proj_with_mqa": "q_a_proj"}

T = TypeVar("T")


def fused_key(name: str) -> str | None:
    """What the partners of a fused pair share (their layer's attention prefix); None for a tensor
    SGLang loads on its own."""
    m = _PAIR.search(name)
    return name[:m.start()] if m else None


def partner(name: str) -> str | None:
    """The other tensor of `name`'s fused pair (None: not one)."""
    m = _PAIR.search(name)
    return None if m is None else f"{name[:m.start()]}.self_attn.{_OTHER[m.group(1)]}.weight"


def pair_fused(items: list[tuple[str, T]]) -> list[tuple[str, T]]:
    """`items` in their order, except that the second tensor of a fused pair moves up to right
    after the first (so the bucket plan can keep them together)."""
    by_key: dict[str, list[tuple[str, T]]] = {}
    for name, value in items:
        key = fused_key(name)
        if key is not None:
            by_key.setdefault(key, []).append((name, value))
    out: list[tuple[str, T]] = []
    for name, value in items:
        key = fused_key(name)
        if key is None:
            out.append((name, value))
        elif key in by_key:
            out += by_key.pop(key)
    return out


def split_pairs(names: Iterable[str], known: Iterable[str]) -> list[str]:
    """The tensors in `names` whose fused partner is a weight of the model (`known`) but is not in
    `names`: SGLang would drop them."""
    names, known = set(names), set(known)
    return sorted(n for n in names if (p := partner(n)) is not None and p in known and p not in names)
