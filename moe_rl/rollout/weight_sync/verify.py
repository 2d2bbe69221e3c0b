"""`rollout.verify_weights`: after a push, what every server holds is compared with what was sent.

The checksum is SGLang's (`/weights_checker` with action "checksum", sglang 0.5.23
srt/utils/weight_checker.py): per tensor, the first 8 bytes of the SHA-256 of its raw bytes as 16 hex
digits, the form of `tensor_hash` on host tensors. `moe-rl serve` reports it under the checkpoint's HF
names (the names a push sends), so each tensor is compared with what its source sent. SGLang reports
its own runtime names (fused q/k/v, stacked experts, each TP rank's slice), which no HF name matches:
there the servers of one TP size must agree with each other (`per_engine_checksum`), which catches a
server that missed or mis-loaded a push, though not a conversion every server got wrong alike.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """16 hex digits: the first 8 bytes of the SHA-256 of the tensor's bytes (SGLang's host-side hash)."""
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], 'big'):016x}"


def server_checksums(reply: Any) -> dict[str, str]:
    """Tensor name -> checksum from a `/weights_checker` reply (all TP ranks' entries merged)."""
    out: dict[str, str] = {}
    for info in (reply.get("ranks") or []) if isinstance(reply, dict) else []:
        out.update(info.get("checksums") or {})
    return out


def mismatches(sent: Mapping[str, str], replies: Sequence[tuple[str, Any]], version: int | str,
               tp_sizes: Sequence[int]) -> list[str]:
    """Why the servers do not hold what was sent (empty: they do). `sent`: HF name -> checksum of
    what the sources pushed; `replies`: (server url, its `/weights_checker` reply)."""
    problems: list[str] = []
    engine_sums: dict[int, set[str]] = {}
    for (url, reply), tp in zip(replies, tp_sizes):
        held = server_checksums(reply)
        if not held:
            problems.append(f"server {url} reported no checksums for weight version {version}: {reply!r:.200}")
            continue
        if not set(sent) & set(held):  # SGLang's runtime names: compare the servers with each other
            engine_sums.setdefault(int(tp), set()).add(str(reply.get("per_engine_checksum")))
            continue
        for name, want in sent.items():
            got = held.get(name)
            if got != want:
                problems.append(f"server {url} holds {name} with checksum {got} after weight version {version}, "
                                f"the trainer sent {want}" if got is not None else
                                f"server {url} does not report {name} after weight version {version}")
                if len(problems) >= 5:
                    return problems
    for tp, sums in engine_sums.items():
        if len(sums) > 1:
            problems.append(f"the tp-{tp} servers disagree after weight version {version}: "
                            f"per-engine checksums {sorted(sums)}")
    return problems
