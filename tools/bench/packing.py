"""Sequence packing: tokens per second of the update step, packed vs padded.

A batch with a realistic spread of lengths (uniform in [min_len, max_len]) is
trained on two ways, interleaved round by round on the same policy:

- padded: `micro_batch_size` sequences per micro-batch, right-padded to the
  batch's longest sequence (`parallel.max_tokens_per_microbatch: null`);
- packed: sequences packed into rows of at most `max_tokens` tokens
  (`parallel.max_tokens_per_microbatch`).

Both see the same sequences and loss. Reported: real tokens per second of one
update (forward, loss, backward, optimizer), the fraction of computed token slots
that are real tokens, and packed / padded throughput. On CPU the local spec's
attention is a masked dense S x S product per packed row, so the gain comes from
the MLP / expert / logit work saved on padding; under transformer-engine (THD),
attention also skips the cross-sequence blocks.

    python tools/bench/packing.py [--num 16] [--min-len 16] [--max-len 1024] [--rounds 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from typing import Any

import torch


def _worker(hf_dir: str, lengths: list[int], max_tokens: int, micro_batch_size: int,
            rounds: int) -> dict[str, Any]:
    from moe_rl.policy.forward import build_microbatches
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    policy = Policy(PolicySpec(hf_dir, ParallelLayout(), OptimConfig(lr=1e-5), micro_batch_size=micro_batch_size))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=g) for n in lengths]
    real = sum(lengths)
    extras = {"w": torch.ones(len(seqs), max(lengths) - 1)}

    def loss(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        valid = (mb.index >= 0).float().unsqueeze(1)
        return -(logp * mb.extras["w"] * mb.loss_mask * valid).sum() / real, {}

    specs = {"padded": policy.spec, "packed": dataclasses.replace(policy.spec, max_tokens_per_microbatch=max_tokens)}
    slots = {}
    for name, spec in specs.items():
        mbs = build_microbatches(seqs, spec.micro_batch_size, spec.max_tokens_per_microbatch)
        slots[name] = sum(mb.model_tokens.numel() for mb in mbs)

    def update(name: str) -> float:
        policy.spec = specs[name]
        start = time.perf_counter()
        policy.update(seqs, extras, loss)
        return time.perf_counter() - start

    for name in specs:  # warm-up
        update(name)
    times: dict[str, list[float]] = {k: [] for k in specs}
    for _ in range(rounds):
        for name in specs:
            times[name].append(update(name))
    return {"times": times, "slots": slots, "real": real}


def bench_rows(num: int = 16, min_len: int = 16, max_len: int = 1024, max_tokens: int | None = None,
               micro_batch_size: int = 1, rounds: int = 2, seed: int = 0) -> list[dict[str, Any]]:
    """One row per variant: median seconds, real tokens/s, real share of computed slots, × padded."""
    from moe_rl.testing import make_tiny_qwen3_moe, run_ranks
    from moe_rl.policy.tiny import TinyMoEConfig

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    max_tokens = max_tokens or max_len
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_qwen3_moe(tmp, seed=0, config=TinyMoEConfig(max_position_embeddings=max(2 * max_len, 512)))
        res = run_ranks(_worker, 1, str(hf), lengths, max_tokens, micro_batch_size, rounds, timeout=1800)[0]
    base = None
    rows = []
    for name in ("padded", "packed"):
        s = statistics.median(res["times"][name])
        tps = res["real"] / s
        base = base or tps
        rows.append({"variant": name, "median_s": s, "tokens_per_s": tps, "real_share": res["real"] / res["slots"][name],
                     "ratio": tps / base, "num": num, "min_len": min_len, "max_len": max_len,
                     "max_tokens": max_tokens, "micro_batch_size": micro_batch_size})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    about = (f"{r0['num']} sequences, lengths uniform in [{r0['min_len']}, {r0['max_len']}]; padded: "
             f"{r0['micro_batch_size']} sequence(s) per micro-batch; packed: rows of <= {r0['max_tokens']} tokens. "
             "Update step (forward, loss, backward, optimizer), tiny Qwen3-MoE, 1 rank.")
    lines = [about, "",
             "| variant | median step (s) | real tokens/s | real tokens / computed slots | × padded |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['median_s']:.3f} | {r['tokens_per_s']:.0f} | {r['real_share']:.2f} | "
              f"{r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num", type=int, default=16, help="sequences in the batch")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=None, help="packed row budget (default: --max-len)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per padded micro-batch")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    table = format_table(bench_rows(a.num, a.min_len, a.max_len, a.max_tokens, a.micro_batch_size, a.rounds))
    print(table)
    return table


if __name__ == "__main__":
    main()
