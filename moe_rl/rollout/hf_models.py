"""HF transformers models as `moe-rl serve`'s engine holds them: loading a checkpoint so that
nothing is silently left out, keeping some batch rows of a generation cache, and building one from
cached prefixes (prefix_cache.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """Load a HF causal LM and refuse anything that did not load completely."""
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, output_loading_info=True)
    except Exception as e:  # corrupt file, bad config, unknown architecture
        raise ValueError(f"cannot load weights from {str(path)!r}: {type(e).__name__}: {e}") from e
    problems = []
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        vals = info.get(key) or []
        if vals:
            problems.append(f"{key}: {sorted(map(str, vals))[:5]}{' ...' if len(vals) > 5 else ''}")
    if problems:
        raise ValueError(f"incomplete checkpoint in {str(path)!r}: " + "; ".join(problems))
    return model.to(device).eval()


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's tokenizer (transformers' AutoTokenizer), or None when it has no tokenizer files."""
    # transformers 5 builds an empty tokenizer for a dir without tokenizer files: look first.
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    if not any((Path(model_dir) / f).is_file() for f in files):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception:
        return None


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only batch `rows` of a HF cache, in place. transformers 5.24's linear-attention cache layers
    (the gated delta net of Qwen3-Next and Qwen3.5-MoE: conv and recurrent states) have no
    `batch_select_indices`; their `reorder_cache` selects the same batch rows."""
    layers = getattr(cache, "layers", None)
    if layers is None or all(hasattr(layer, "batch_select_indices") for layer in layers):
        cache.batch_select_indices(rows)
        return
    for layer in layers:
        if hasattr(layer, "batch_select_indices") and not hasattr(layer, "recurrent_states"):
            layer.batch_select_indices(rows)
        else:
            layer.reorder_cache(rows)


def caches_plain_kv(config: Any) -> bool:
    """Whether every layer of the model's generation cache holds plain keys and values of every position
    (`DynamicLayer`): what a prefix cache can store and give back. Sliding-window, linear-attention
    (Qwen3-Next, Qwen3.5-MoE) and indexer layers hold other state."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def prefilled_cache(config: Any, hits: Sequence[Any], tokens: Sequence[Sequence[int]], pad: int,
                    device: Any) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of a prefill whose rows start with cached prefixes (`PrefixHit`s, length 0 for none):
    a cache holding each row's prefix keys and values, right-aligned in [0, Lc), and the uncached rest of
    each row's tokens left-padded to S; returns (cache, input ids [B, S], attention mask [B, Lc + S],
    positions [B, S]). Padding sits before each prefix and between prefix and rest, masked out."""
    from transformers.cache_utils import DynamicCache

    B = len(tokens)
    c = [h.length for h in hits]
    s = [len(t) - n for t, n in zip(tokens, c)]
    Lc, S = max(c), max(s)
    ids = torch.full((B, S), pad, dtype=torch.long)
    mask = torch.zeros((B, Lc + S), dtype=torch.long)
    for i, t in enumerate(tokens):
        ids[i, S - s[i]:] = torch.tensor(list(t[c[i]:]), dtype=torch.long)
        mask[i, Lc - c[i]:Lc] = 1
        mask[i, Lc + S - s[i]:] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, Lc:]
    cache = DynamicCache(config=config)
    if Lc:
        ref = next(h for h in hits if h.length)
        L, H, _, dk = ref.keys.shape
        keys = ref.keys.new_zeros((L, B, H, Lc, dk))
        values = ref.values.new_zeros((L, B, H, Lc, ref.values.shape[-1]))
        for i, h in enumerate(hits):
            if h.length:
                keys[:, i, :, Lc - h.length:] = h.keys
                values[:, i, :, Lc - h.length:] = h.values
        for layer in range(L):
            cache.update(keys[layer].to(device), values[layer].to(device), layer)
    return cache, ids.to(device), mask.to(device), pos.to(device)


def row_kv(cache: Any, b: int, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of batch row `b` at the cache columns `cols` (bool), as [layers, kv_heads, n, dim]."""
    keys = torch.stack([layer.keys[b][:, cols] for layer in cache.layers])
    values = torch.stack([layer.values[b][:, cols] for layer in cache.layers])
    return keys, values


def kv_bytes_per_token(model: torch.nn.Module, cache_kw: str, device: Any) -> int:
    """Bytes of keys and values one token takes in the model's generation cache, measured on one token."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True,
              logits_to_keep=1, **{cache_kw: cache})
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
