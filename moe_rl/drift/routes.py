"""Routes and log-probs of a HF transformers MoE model from one teacher-forced forward.

A forward hook on every router module records the expert ids the model itself
chose. transformers 5's `Qwen3MoeTopKRouter` returns `(router_logits, scores,
indices)`: the indices are taken as they are, so the top-k rule is the
model's own. A router that returns only logits gets softmax + top-k
(`num_experts_per_tok`), the Qwen / Mixtral rule.

Batches of different lengths are right-padded: with a causal mask, real tokens
never attend to the padding after them, so their routes and log-probs are those
of the unpadded sequence.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Fallback when a model does not declare its router class for output recording.
_ROUTER_NAME_RE = re.compile(r"layers\.\d+\.(mlp|block_sparse_moe)\.(gate|router)$")


class RouteCaptureError(RuntimeError):
    """The model's routers could not be found or did not run."""


@dataclass(eq=False)
class RoutedForward:
    """One teacher-forced forward of a batch `[B, T]`.

    routes          [B, T, L, K] int64  expert ids of every position (padding: meaningless)
    logprobs        [B, T-1] float32    log p(input_ids[:, t+1] | input_ids[:, :t+1])
    attention_mask  [B, T] bool         real tokens
    layer_ids       L ints              HF decoder-layer index of each MoE layer
    """

    routes: Tensor
    logprobs: Tensor
    attention_mask: Tensor
    layer_ids: list[int]

    @property
    def logprob_mask(self) -> Tensor:
        """[B, T-1] bool: position t predicts a real token (t and t+1 both real)."""
        m = self.attention_mask
        return m[:, :-1] & m[:, 1:]


def router_modules(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(HF layer index, router module) of every MoE layer, in layer order."""
    cls = None
    for m in model.modules():  # the inner PreTrainedModel declares what records router logits
        spec = (getattr(m, "_can_record_outputs", None) or {}).get("router_logits")
        cls = getattr(spec, "target_class", None)
        if cls is not None:
            break
    found = []
    for name, mod in model.named_modules():
        if (isinstance(mod, cls) if cls is not None else _ROUTER_NAME_RE.search(name)):
            m = _LAYER_RE.search(name)
            if m is None:
                raise RouteCaptureError(f"cannot tell the decoder layer of router module {name!r}")
            found.append((int(m.group(1)), mod))
    return sorted(found, key=lambda x: x[0])


def router_topk(out: object, topk: int) -> Tensor:
    """Expert ids `[tokens, K]` from a router's output."""
    if isinstance(out, tuple) and len(out) >= 3 and torch.is_tensor(out[2]) \
            and not out[2].is_floating_point():
        return out[2]  # the router's own choice
    logits = out[0] if isinstance(out, tuple) else out
    return torch.topk(torch.softmax(logits.float(), dim=-1), topk, dim=-1).indices


@contextlib.contextmanager
def recording_routes(model: torch.nn.Module) -> Iterator[dict[int, Tensor]]:
    """Hooks on the routers while the block runs; yields {layer index: ids [tokens, K]}.

    The dict is filled by each forward (a later forward overwrites it) and the
    hooks are removed on exit, so the model is left as it was.
    """
    topk = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    routers = router_modules(model)
    if not routers or topk < 1:
        raise RouteCaptureError(f"{type(model).__name__} has no MoE router modules "
                                f"(num_experts_per_tok={topk})")
    seen: dict[int, Tensor] = {}

    def hook_for(layer: int):
        def hook(_mod, _inp, out):
            seen[layer] = router_topk(out, topk).detach()
        return hook

    handles = [mod.register_forward_hook(hook_for(layer)) for layer, mod in routers]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """[B, T-1] log-probs of the next tokens from logits [B, T, V] (fp32 log-softmax)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def hf_forward(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None) -> RoutedForward:
    """Routes `[B, T, L, K]` and next-token log-probs `[B, T-1]` of one forward.

    input_ids       [B, T] int, right-padded when rows differ in length
    attention_mask  [B, T] 1 for real tokens, 0 for padding; None: all real
    The model runs in eval mode (its mode is restored afterwards), without a KV cache.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, "
                         f"input_ids has shape {tuple(input_ids.shape)}")
    was_training = model.training
    model.eval()
    try:
        with recording_routes(model) as seen:
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        model.train(was_training)
    layer_ids = [layer for layer, _ in router_modules(model)]
    missing = [layer for layer in layer_ids if layer not in seen]
    if missing:
        raise RouteCaptureError(f"routers of layers {missing} did not run in the forward")
    # Routers see the flattened [B*T, H] hidden states; restore the batch axes.
    routes = torch.stack([seen[layer].reshape(B, T, -1) for layer in layer_ids], dim=2)
    return RoutedForward(routes=routes.long(), logprobs=_token_logprobs(out.logits, input_ids),
                         attention_mask=attention_mask.bool(), layer_ids=layer_ids)


def hf_routes(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Expert ids `[B, T, L, K]` the model routes each position to (see `hf_forward`)."""
    return hf_forward(model, input_ids, attention_mask).routes


def pad_right(rows: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Right-pad token lists into input_ids `[B, T]` int64 and attention_mask `[B, T]` int64."""
    T = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), T), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask
