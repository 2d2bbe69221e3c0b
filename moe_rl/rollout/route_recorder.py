"""Routes as the HF model itself chooses them: forward hooks on every router module.

A hook on each router (`Qwen3MoeTopKRouter`, which returns (router_logits, scores, indices)) records
the indices the model used, so the top-k rule is the model's own. Routers that return only logits get
softmax + top-k (`num_experts_per_tok`), the Qwen/Mixtral rule (`moe_rl.drift.routes.router_topk`).
"""
from __future__ import annotations

import torch

from moe_rl.drift.routes import RouteCaptureError, router_modules, router_topk
from moe_rl.rollout.engine import RolloutError


class RouteRecorder:
    """Forward hooks on the router modules; `take()` returns this forward's top-k ids.

    `take()` gives an int64 tensor [num_tokens, num_moe_layers, topk] in layer order.
    """

    def __init__(self, model: torch.nn.Module, topk: int):
        self.topk = topk
        try:
            routers = router_modules(model)  # (layer, module) in layer order
        except RouteCaptureError as e:
            raise RolloutError(str(e)) from None
        self.layer_ids: list[int] = [layer for layer, _ in routers]
        self._slots: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = [mod.register_forward_hook(self._hook(pos)) for pos, (_, mod) in enumerate(routers)]

    def _hook(self, pos: int):
        def hook(_mod, _inp, out):
            idx = router_topk(out, self.topk)
            self._slots[pos] = idx.reshape(-1, idx.shape[-1]).detach().to("cpu", torch.int64)
        return hook

    def take(self) -> torch.Tensor | None:
        if not self._slots:
            return None
        if any(s is None for s in self._slots):
            missing = [self.layer_ids[i] for i, s in enumerate(self._slots) if s is None]
            raise RolloutError(f"no routes recorded for MoE layers {missing}")
        out = torch.stack(self._slots, dim=1)  # [tokens, layers, k]
        self._slots = [None] * len(self._slots)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def make_recorder(model: torch.nn.Module) -> RouteRecorder | None:
    """The recorder of `model`'s routers, or None for a dense model."""
    topk = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    recorder = RouteRecorder(model, topk) if topk else None
    if recorder is not None and not recorder.layer_ids:
        recorder.remove()
        recorder = None
    return recorder
