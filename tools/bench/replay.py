"""Cost of routing replay and of drift measurement, as ratios measured side by side.

One "step" is what the trainer does per RL step on the policy: the old-log-prob
pass, then one update (forward + backward + optimizer). Variants, interleaved
round by round so machine noise hits them alike:

- off:     old pass (no routes), update without replay
- replay:  old pass recording routes (R2), update replaying them
- drift:   replay + one extra forward recording routes after the update and the
           volatility computation (what `drift.every=1` costs each step)

    python tools/bench/replay.py [--rounds 5] [--batch 16] [--seq 64] [--world 1]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch


def _worker(hf_dir: str, batch: int, seq: int, rounds: int) -> dict[str, list[float]]:
    import os

    from moe_rl.drift.metrics import route_stats
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout(ep=world, world_size=world) if world > 1 else ParallelLayout()
    policy = Policy(PolicySpec(hf_dir, layout, OptimConfig(lr=1e-5), micro_batch_size=4))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (seq,), generator=g) for _ in range(batch)]
    extras = {"w": torch.ones(batch, seq - 1)}

    def loss(logp, mb):
        valid = (mb.index >= 0).float().unsqueeze(1)
        return -(logp * mb.extras["w"] * mb.loss_mask * valid).sum() / (batch * seq), {}

    def off() -> None:
        policy.logprobs(seqs)
        policy.update(seqs, extras, loss)

    def replay() -> Any:
        old = policy.logprobs(seqs, record_routes=True)
        policy.update(seqs, extras, loss, replay_routes=old.routes)
        return old

    def drift() -> None:
        old = replay()
        after = policy.logprobs(seqs, record_routes=True).routes
        route_stats(old.routes.flatten(0, 1), after.flatten(0, 1)).all_reduce(policy.dp_group).summary()

    variants = {"off": off, "replay": replay, "drift": drift}
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def bench_rows(rounds: int = 5, batch: int = 16, seq: int = 64, world: int = 1) -> list[dict[str, Any]]:
    from moe_rl.testing import make_tiny_qwen3_moe, run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_qwen3_moe(tmp, seed=0)
        times = run_ranks(_worker, world, str(hf), batch, seq, rounds, timeout=1800)[0]
    base = statistics.median(times["off"])
    return [{"variant": k, "median_s": statistics.median(v), "ratio": statistics.median(v) / base}
            for k, v in times.items()]


def format_table(rows: list[dict[str, Any]], title: str = "") -> str:
    lines = [title, "", "| variant | median step (s) | × off |", "|---|---:|---:|"] if title else \
        ["| variant | median step (s) | × off |", "|---|---:|---:|"]
    lines += [f"| {r['variant']} | {r['median_s']:.3f} | {r['ratio']:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--world", type=int, default=1, help="ranks (EP over them when > 1)")
    a = p.parse_args(argv)
    table = format_table(bench_rows(a.rounds, a.batch, a.seq, a.world),
                         f"replay / drift overhead, tiny Qwen3-MoE, B={a.batch}, T={a.seq}, {a.world} rank(s)")
    print(table)
    return table


if __name__ == "__main__":
    main()
