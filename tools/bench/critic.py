"""What a critic costs: the trainer's part of an RL step with a critic (PPO / VAPO) vs GRPO.

Same model, batch and layout (EP2 on two gloo ranks by default); the rollout, which is
the same for both, is left out. Variants, built one after another (peak memory each
adds: weights, gradients, Adam state, the step's working memory) and timed interleaved
round by round, so the ratios hold on a busy machine:

- grpo: policy old pass recording routes, one policy update under R2 (GRPO loss,
        per-sequence advantages)
- gae:  the same, plus the critic: its value pass recording its routes, GAE with decoupled
        lambdas, one critic update under R2 (clipped value loss), then the policy update
        with per-token advantages (DAPO loss, VAPO's NTP term)

    python tools/bench/critic.py [--rounds 5] [--world 2] [--batch 16] [--seq 128]
"""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

import common


def _builders(hf_dir: str, layout: Any, batch: int, seq: int, micro: int) -> dict[str, Any]:
    from moe_rl.algo.advantages import compute_gae, token_rewards
    from moe_rl.algo.losses import compute_loss, ntp_loss, value_loss

    common.setup(layout)
    seqs = common.shard(common.random_batch(batch, seq, common.read_vocab(hf_dir)))
    n = len(seqs)
    width = seq - 1
    mask = torch.zeros(n, width)
    mask[:, seq // 2:] = 1  # the second half of each sequence is the response
    rewards = (torch.arange(n) % 2).float()  # half the samples are correct
    tokens = float(mask.sum()) * (batch // n)

    def policy_loss(name: str):
        def loss(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
            valid = (mb.index >= 0).float().unsqueeze(1)
            ex = mb.extras
            value, metrics = compute_loss(name, logp=logp, old_logp=ex["old_logp"], advantages=ex["adv"],
                                          mask=ex["mask"] * valid, global_num_tokens=tokens, global_num_seqs=batch)
            if name == "dapo":
                value = value + 0.1 * ntp_loss(logp, ex["mask"] * valid, ex["correct"] > 0, global_num_tokens=tokens)
            return value, metrics
        return loss

    def critic_loss(v: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        valid = (mb.index >= 0).float().unsqueeze(1)
        ex = mb.extras
        return value_loss(v, ex["old_values"], ex["returns"], ex["mask"] * valid, global_num_tokens=tokens)

    def grpo() -> Any:
        policy = common.make_policy(hf_dir, layout, micro)

        def step() -> None:
            old = policy.logprobs(seqs, record_routes=True)
            extras = {"old_logp": old.logp, "adv": rewards - rewards.mean(), "mask": mask}
            policy.update(seqs, extras, policy_loss("grpo"), replay_routes=old.routes)
        return step

    def gae() -> Any:
        from dataclasses import replace

        from moe_rl.policy.critic import Critic

        policy = common.make_policy(hf_dir, layout, micro)
        critic = Critic(replace(policy.spec, optim=replace(policy.spec.optim, lr=1e-5)))

        def step() -> None:
            old = policy.logprobs(seqs, record_routes=True)
            values, routes = critic.values(seqs, record_routes=True)
            r = token_rewards(rewards, mask)
            adv, _ = compute_gae(r, values[:, :width], mask, lam=0.95)
            _, returns = compute_gae(r, values[:, :width], mask, lam=1.0)
            critic.update(seqs, {"old_values": values[:, :width], "returns": returns, "mask": mask}, critic_loss,
                          replay_routes=routes)
            extras = {"old_logp": old.logp, "adv": adv, "mask": mask, "correct": rewards}
            policy.update(seqs, extras, policy_loss("dapo"), replay_routes=old.routes)
        return step

    return {"grpo": grpo, "gae": gae}


def _worker(hf_dir: str, layout_name: str, batch: int, seq: int, micro: int, rounds: int) -> dict[str, Any]:
    fns, mem = common.build_measured(_builders(hf_dir, common.layout_for(layout_name), batch, seq, micro))
    t = common.interleave(fns, rounds, warmup=0)
    return {"wall": t.wall, "cpu": t.cpu, "mem": mem, "load": os.getloadavg()[0]}


def bench_rows(rounds: int = 5, layout: str = "ep2", batch: int = 16, seq: int = 128,
               micro: int = 4) -> list[dict[str, Any]]:
    """Rows `{variant, wall_s, cpu_s, wall_ratio, cpu_ratio, mem_mb, mem_ratio, ...}`, grpo first."""
    from moe_rl.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        hf = common.write_model(tmp, common.BASE)
        res = run_ranks(_worker, common.layout_for(layout).world_size, hf, layout, batch, seq, micro, rounds,
                        timeout=1800)
    wall, cpu = res[0]["wall"], res[0]["cpu"]
    mem = {v: max(r["mem"][v] for r in res) for v in ("grpo", "gae")}
    return [{"variant": v, "layout": layout, "wall_s": common.median(wall[v]), "cpu_s": common.median(cpu[v]),
             "wall_ratio": common.paired_ratio(wall[v], wall["grpo"]),
             "cpu_ratio": common.paired_ratio(cpu[v], cpu["grpo"]), "mem_mb": mem[v],
             "mem_ratio": mem[v] / mem["grpo"], "batch": batch, "seq": seq, "micro": micro, "rounds": rounds,
             "load": res[0]["load"]} for v in ("grpo", "gae")]


def format_table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    head = (f"Qwen3-MoE-shaped model ({common.BASE.label}, {common.BASE.params() / 1e6:.1f}M parameters), "
            f"{r0['layout']}, B={r0['batch']} x T={r0['seq']} (global, half of it response), microbatches of "
            f"{r0['micro']}, fp32; the trainer's part of one RL step (rollout excluded); medians of "
            f"{r0['rounds']} interleaved rounds (load average {r0['load']:.1f} at the end).")
    table = common.md_table(
        ["variant", "step, wall (s)", "step, CPU (s)", "× grpo, CPU", "× grpo, wall", "peak memory/rank (MiB)",
         "× grpo, memory"],
        [[r["variant"], f"{r['wall_s']:.3f}", f"{r['cpu_s']:.3f}", f"{r['cpu_ratio']:.2f}", f"{r['wall_ratio']:.2f}",
          f"{r['mem_mb']:.0f}", f"{r['mem_ratio']:.2f}"] for r in rows], "lrrrrrr")
    notes = ("gae: a second model (the critic) with its own forward, backward and optimizer step. Peak memory: "
             "what the variant added while built and stepped (its models' weights, gradients, Adam state and the "
             "step's working memory), the largest over ranks.")
    return "\n\n".join([head, table, notes])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layout", default="ep2", help="trainer layout, e.g. ep2, single, tp2")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    a = p.parse_args(argv)
    print(format_table(bench_rows(a.rounds, a.layout, a.batch, a.seq, a.micro)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
