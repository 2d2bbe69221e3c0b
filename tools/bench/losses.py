"""Forward + backward time of each policy loss against a plain policy-gradient loss.

The baseline is −(Â·log π) averaged over valid tokens: the least any loss can
cost on the same tensors. Cases are timed round-robin within each repeat
(not one case after another), so clock drift and thermal state hit all of
them alike; the table reports medians. Each `compute_loss` call includes its
metrics (one host transfer), as in training.

    python tools/bench/losses.py                      # B=64, T=2048 on CPU
    python tools/bench/losses.py --threads 1           # steadier on a shared machine
    python tools/bench/losses.py --device cuda --repeats 50

One run on an H200 host (16-core CPU, torch 2.11), ms (× plain PG):

| loss               | cuda         | cpu, 16 threads | cpu, 1 thread |
|--------------------|--------------|-----------------|---------------|
| plain PG           | 0.62 (1.00)  | 0.52 (1.00)     | 0.62 (1.00)   |
| grpo               | 2.64 (4.24)  | 3.84 (7.46)     | 5.83 (9.43)   |
| dapo               | 2.53 (4.06)  | 6.51 (12.64)    | 9.38 (15.16)  |
| gspo               | 3.22 (5.17)  | 6.56 (12.74)    | 8.87 (14.33)  |
| gspo_token         | 3.07 (4.91)  | 6.21 (12.06)    | 8.19 (13.24)  |
| sapo               | 2.64 (4.22)  | 5.10 (9.90)     | 6.97 (11.27)  |
| grpo + TIS + k3 KL | 3.75 (6.02)  | 7.71 (14.96)    | 11.58 (18.73) |

At this size the GPU time is mostly kernel launches and Python (a few dozen
small elementwise kernels and one host transfer for the metrics); on the CPU
it is the number of elementwise passes over [B, T].
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from moe_rl.algo import LOSSES, aggregate, compute_loss

Case = Callable[[], torch.Tensor]


def _inputs(batch: int, seq_len: int, device: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (batch,), generator=g)
    old = -torch.rand(batch, seq_len, generator=g) * 3
    t = {
        "mask": torch.arange(seq_len)[None, :] < lengths[:, None],
        "old_logp": old,
        "logp": old + 0.05 * torch.randn(batch, seq_len, generator=g),
        "advantages": torch.randn(batch, generator=g),
        "rollout_logp": old + 0.05 * torch.randn(batch, seq_len, generator=g),
        "ref_logp": old + 0.05 * torch.randn(batch, seq_len, generator=g),
    }
    t = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in t.items()}
    t["logp"].requires_grad_()
    return t


def _cases(t: dict[str, torch.Tensor]) -> dict[str, Case]:
    core = {k: t[k] for k in ("logp", "old_logp", "advantages", "mask")}

    def plain_pg() -> torch.Tensor:
        return aggregate(-t["advantages"][:, None] * t["logp"], t["mask"], "token-mean")

    cases: dict[str, Case] = {"plain PG (baseline)": plain_pg}
    for name in LOSSES:
        cases[name] = lambda name=name: compute_loss(name, **core)[0]
    cases["grpo + TIS + k3 KL"] = lambda: compute_loss(
        "grpo", **core, rollout_logp=t["rollout_logp"], ref_logp=t["ref_logp"], beta=0.01)[0]
    return cases


def _time_once(case: Case, logp: torch.Tensor, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    case().backward()
    sync()
    elapsed = time.perf_counter() - start
    logp.grad = None
    return elapsed * 1e3


def bench_rows(batch: int = 64, seq_len: int = 2048, repeats: int = 20, warmup: int = 3,
               device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> list[dict]:
    """Median forward+backward ms per loss and its ratio to the plain-PG baseline.

    Returns rows ``{"loss", "ms", "ratio", "batch", "seq_len", "device", "threads"}``,
    the baseline first.
    """
    t = _inputs(batch, seq_len, device, dtype, seed)
    cases = _cases(t)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(warmup + repeats):
        for name, case in cases.items():  # round-robin: every case sees the same conditions
            ms = _time_once(case, t["logp"], sync)
            if rep >= warmup:
                times[name].append(ms)
    base = statistics.median(times["plain PG (baseline)"])
    return [{"loss": name, "ms": statistics.median(ms), "ratio": statistics.median(ms) / base,
             "batch": batch, "seq_len": seq_len, "device": device, "threads": torch.get_num_threads()}
            for name, ms in times.items()]


def format_table(rows: list[dict]) -> str:
    """Markdown table of `bench_rows` output."""
    r0 = rows[0]
    head = f"forward+backward, B={r0['batch']}, T={r0['seq_len']}, {r0['device']} ({r0['threads']} threads)"
    lines = [head, "", "| loss | ms | × plain PG |", "|---|---:|---:|"]
    lines += [f"| {r['loss']} | {r['ms']:.2f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 is steadiest on a busy machine")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = bench_rows(args.batch, args.seq_len, args.repeats, args.warmup, args.device)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
