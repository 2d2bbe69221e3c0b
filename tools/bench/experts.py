"""One MoE layer's routed experts, forward + backward: megatron's loop against `GroupedExperts`.

Both are megatron-core's `SequentialMLP` holding the same weights (moe_rl/policy/grouped_experts.py):
`loop` runs it as megatron does without transformer-engine, one `MLP` per local expert; `grouped`
runs the same experts in two `torch.nn.functional.grouped_mm` calls, the path moe_rl's CPU spec
takes where its bounds say it pays (the last column; the grouped time is measured past them too).
Same input, same uneven dispatch (each expert's share drawn at random), same output gradient;
rounds alternate the two, the ratio is the median of per-round CPU-time ratios. Rows: routed tokens
per layer (the demo's update has ~150 samples x ~8 tokens x top-2), the tiny model's dims by default.

    python tools/bench/experts.py
    python tools/bench/experts.py --tokens 2048 16384 --hidden 256 --ffn 512 --experts 16
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleave, md_table, median, paired_ratio


def _measure(tokens: list[int], hidden: int, ffn: int, experts: int, rounds: int) -> list[dict[str, Any]]:
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_rl.policy import grouped_experts as ge
    from moe_rl.policy.parallel import ParallelLayout, init_distributed

    init_distributed(ParallelLayout())
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=experts,
                            moe_ffn_hidden_size=ffn, moe_router_topk=2, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
                            gradient_accumulation_fusion=False, use_cpu_initialization=True)
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(0)
    loop = SequentialMLP(experts, cfg, subs, pg_collection=pgs)
    picks = ge.grouped_supported(loop)               # what moe_rl's bounds choose for these experts
    bounds = ge._MAX_STACKED, ge._MAX_FC1_MACS
    ge._MAX_STACKED = ge._MAX_FC1_MACS = float("inf")  # time the grouped path past its bounds too
    grouped = ge.GroupedExperts(experts, cfg, subs, pg_collection=pgs)
    grouped.load_state_dict(loop.state_dict())
    assert grouped.grouped, "grouped_mm cannot take these dims (see grouped_experts.grouped_supported)"
    rows = []
    for n in tokens:
        share = torch.distributions.Dirichlet(torch.ones(experts)).sample()
        per_expert = torch.floor(share * n).long()
        per_expert[0] += n - int(per_expert.sum())
        x = torch.randn(n, hidden, requires_grad=True)
        probs = torch.rand(n, requires_grad=True)
        grad = torch.randn(n, hidden)

        def step(module: Any) -> Any:
            def run() -> None:
                y, _ = module(x, per_expert, probs)
                y.backward(grad)
            return run

        t = interleave({"loop": step(loop), "grouped": step(grouped)}, rounds=rounds, warmup=2)
        rows.append({"tokens": n, "moe_rl": "grouped" if picks and n * hidden * 2 * ffn <= bounds[1] else "loop",
                     "loop_ms": median(t.cpu["loop"]) * 1e3, "grouped_ms": median(t.cpu["grouped"]) * 1e3,
                     "ratio": paired_ratio(t.cpu["grouped"], t.cpu["loop"])})
    return rows


def bench_rows(tokens: tuple[int, ...] = (256, 2304, 16384), hidden: int = 64, ffn: int = 32, experts: int = 8,
               rounds: int = 20) -> list[dict[str, Any]]:
    """One row per routed-token count, measured in a spawned one-rank process (megatron's groups)."""
    from moe_rl.dist.spawn import run_ranks

    rows = run_ranks(_measure, 1, list(tokens), hidden, ffn, experts, rounds, timeout=1800)[0]
    for r in rows:
        r.update(hidden=hidden, ffn=ffn, experts=experts, rounds=rounds)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    head = (f"{r0['experts']} experts, hidden {r0['hidden']}, expert FFN {r0['ffn']} (SwiGLU), 1 thread, "
            f"{r0['rounds']} alternated rounds; CPU ms per forward + backward of one layer's experts.\n\n")
    return head + md_table(["routed tokens", "loop (megatron SequentialMLP)", "grouped", "× loop", "moe_rl runs"],
                           [[r["tokens"], f"{r['loop_ms']:.2f}", f"{r['grouped_ms']:.2f}", f"{r['ratio']:.2f}",
                             r["moe_rl"]] for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 2304, 16384], help="routed tokens per layer")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=32, help="each expert's FFN width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args(argv)
    print(f"load {os.getloadavg()[0]:.1f}")
    print(format_table(bench_rows(tuple(a.tokens), a.hidden, a.ffn, a.experts, a.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
