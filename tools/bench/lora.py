"""LoRA against full-parameter training on the same model, batch and layout, side by side.

Two policies per rank, built from one checkpoint (`common.BASE`): the full one and one with rank-r
adapters on all seven projections (`model.lora`), each timed on one GSPO minibatch update of the
same B sequences of T tokens, alternating round by round (`common.interleave`). Per layout:

- trainable parameters and optimizer bytes on this rank (Adam's two fp32 moments plus the fp32
  main copy the distributed optimizer keeps: 12 bytes a trainable parameter, 8 without it);
- the update's seconds (median of the rounds) and LoRA / full, the median of per-round ratios;
- what a push carries: the merged model's bytes (a LoRA run's push today: the same as full) and the
  adapter's own bytes (what an adapter push, not built yet, would send).

    python tools/bench/lora.py                   # 1 rank, then EP2 on 2 gloo ranks
    python tools/bench/lora.py --worlds 1 --rounds 3 --rank 16
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import BASE, BASE_BATCH, BASE_MICRO, BASE_SEQ, Shape

LAYOUT_OF_WORLD = {1: "single", 2: "ep2"}


def _worker(hf_dir: str, batch: int, seq: int, micro: int, rounds: int, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from moe_rl.algo.losses import compute_loss
    from moe_rl.policy.lora import LoraSpec, whole_adapters

    layout = common.layout_for(LAYOUT_OF_WORLD[int(os.environ.get("WORLD_SIZE", "1"))])
    common.setup(layout)
    policies = {"full": common.make_policy(hf_dir, layout, micro),
                "lora": common.make_policy(hf_dir, layout, micro, lora=LoraSpec(rank, 2.0 * rank))}
    g = torch.Generator().manual_seed(0)
    vocab = common.read_vocab(hf_dir)
    seqs = [torch.randint(3, vocab, (seq,), generator=g) for _ in range(batch)]
    p0 = policies["full"]
    mine = seqs[p0.dp_rank::p0.dp_size]
    tokens, total = float(batch * (seq - 1)), float(batch)
    extras = {name: {"old_logp": pol.logprobs(mine).logp, "adv": torch.randn(len(mine), generator=g),
                     "mask": torch.ones(len(mine), seq - 1)} for name, pol in policies.items()}

    def loss(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        ex, valid = mb.extras, (mb.index >= 0).float().unsqueeze(1)
        return compute_loss("gspo", logp=logp, old_logp=ex["old_logp"], advantages=ex["adv"], mask=ex["mask"] * valid,
                            global_num_tokens=tokens, global_num_seqs=total)

    def update(name: str) -> Any:
        return lambda: policies[name].update(mine, extras[name], loss)

    t = common.interleave({name: update(name) for name in policies}, rounds, warmup=1)
    out: dict[str, Any] = {"wall": t.wall, "cpu": t.cpu, "load": os.getloadavg()[0]}
    for name, pol in policies.items():
        trainable = sum(p.numel() for c in pol.chunks for p in c.parameters() if p.requires_grad)
        merged = torch.tensor(float(sum(t.numel() * t.element_size() for _, t in pol.hf_tensors())))
        # the adapters' own bytes, each tensor once however many ranks hold a replica of it
        sizes = {stem: t.numel() * t.element_size() for stem, t in whole_adapters(pol.chunks, pol.arch).items()}
        every = [sizes]
        if dist.is_initialized():
            dist.all_reduce(merged)  # each HF tensor comes from one rank: the sum is the push
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, sizes)
        out[name] = {"trainable_rank": trainable, "adapter_bytes": float(sum({k: v for d in every for k, v in d.items()}.values())),
                     "push_bytes": float(merged)}
    return out


def bench_rows(rounds: int = 6, worlds: tuple[int, ...] = (1, 2), shape: Shape = BASE, batch: int = BASE_BATCH,
               seq: int = BASE_SEQ, micro: int = BASE_MICRO, rank: int = 8) -> list[dict[str, Any]]:
    from moe_rl.testing import run_ranks

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = common.write_model(tmp, shape)
        for world in worlds:
            res = run_ranks(_worker, world, hf, batch, seq, micro, rounds, rank, timeout=1800)
            r0 = res[0]
            rows.append({"layout": LAYOUT_OF_WORLD[world], "rank": rank, "shape": shape, "batch": batch, "seq": seq,
                         "rounds": rounds, "load": r0["load"],
                         "full_s": common.median(r0["wall"]["full"]), "lora_s": common.median(r0["wall"]["lora"]),
                         "ratio": common.paired_ratio(r0["wall"]["lora"], r0["wall"]["full"]),
                         "cpu_ratio": common.paired_ratio(r0["cpu"]["lora"], r0["cpu"]["full"]),
                         **{f"{k}_{name}": r0[name][k] for name in ("full", "lora")
                            for k in ("trainable_rank", "adapter_bytes", "push_bytes")}})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    head = (f"Qwen3-MoE-shaped model ({r0['shape'].label}, {r0['shape'].params():,} parameters), B={r0['batch']} "
            f"sequences x T={r0['seq']} tokens, one GSPO minibatch update, fp32, LoRA rank {r0['rank']} (alpha 2r) on "
            f"q/k/v/o and every expert's gate_up/down; medians of {r0['rounds']} interleaved rounds (load average "
            f"{r0['load']:.1f} at the end).")
    mb = 1 / 2**20
    table = common.md_table(
        ["layout", "trainable / rank, full", "trainable / rank, LoRA", "Adam bytes / rank, full (MiB)",
         "Adam bytes / rank, LoRA (MiB)", "update full (s)", "update LoRA (s)", "LoRA / full, wall", "LoRA / full, CPU",
         "push, merged (MiB)", "adapter (MiB)"],
        [[r["layout"], f"{r['trainable_rank_full']:,}", f"{r['trainable_rank_lora']:,}",
          f"{8 * r['trainable_rank_full'] * mb:.2f}", f"{8 * r['trainable_rank_lora'] * mb:.3f}",
          f"{r['full_s']:.3f}", f"{r['lora_s']:.3f}", f"{r['ratio']:.3f}", f"{r['cpu_ratio']:.3f}",
          f"{r['push_bytes_lora'] * mb:.2f}", f"{r['adapter_bytes_lora'] * mb:.3f}"] for r in rows], "lrrrrrrrrrr")
    notes = ("Adam bytes: the two fp32 moments per trainable parameter (the distributed optimizer adds an fp32 main "
             "copy, 4 bytes more, for bf16 models). LoRA / full: LoRA's update time over full's (< 1: LoRA faster); "
             "a LoRA update still runs the whole forward and backward through the frozen base (activation "
             "gradients), and skips only the base's weight gradients, their reduction and their optimizer step. "
             "Push, merged: the bytes a LoRA run's weight push sends today (the whole model, as a full run's); "
             "adapter: the adapters' own bytes, what pushing the adapter alone would send.")
    return "\n\n".join([head, table, notes])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2], choices=sorted(LAYOUT_OF_WORLD),
                   help="1: one rank; 2: EP2 on two gloo ranks")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (alpha 2r)")
    p.add_argument("--batch", type=int, default=BASE_BATCH)
    p.add_argument("--seq", type=int, default=BASE_SEQ)
    p.add_argument("--micro", type=int, default=BASE_MICRO)
    a = p.parse_args(argv)
    print(format_table(bench_rows(a.rounds, tuple(a.worlds), BASE, a.batch, a.seq, a.micro, a.rank)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
