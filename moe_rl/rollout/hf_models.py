"""HF transformers models as `moe-rl serve`'s engine holds them: loading a checkpoint so that
nothing is silently left out, and keeping some batch rows of a generation cache."""
from __future__ import annotations

from pathlib import Path
from typing import Any

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
