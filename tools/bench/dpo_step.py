"""DPO step against the RL update: tokens/s on the same tokens, model and layout.

Both sides train the same model (`common.BASE`) on the same B sequences of T tokens,
B/2 preference pairs (a prompt of T/4 tokens, then two different responses), in the
same layout and micro-batches of the same size, on one policy per rank:

- rl:  one RL minibatch update, as `loop.minibatch_updates` runs it: `Policy.update`
       with the GSPO loss (`compute_loss`, global token and sequence normalisers) on
       old log-probs and advantages, then `combine_loss_metrics`. The rollout, the
       old-log-prob pass and the weight sync of an RL step are not counted.
- dpo: one DPO step's update, as `dpo.update` runs it: `Policy.update` with the DPO
       loss (`dpo.pair_loss`, chosen and rejected in one micro-batch) on cached
       reference log-probs, then `dpo.combine`.

They alternate round by round (`common.interleave`); "DPO / RL" is the median of the
per-round ratios of RL time to DPO time, i.e. DPO tokens/s over RL tokens/s.

    python tools/bench/dpo_step.py                  # 1 rank, then EP2 on 2 gloo ranks
    python tools/bench/dpo_step.py --worlds 1 --rounds 3
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


def _worker(hf_dir: str, batch: int, seq: int, micro: int, rounds: int) -> dict[str, Any]:
    from moe_rl.algo.losses import compute_loss
    from moe_rl.config import RunConfig
    from moe_rl.data.preference import PreferencePair
    from moe_rl.recipes.common import combine_loss_metrics
    from moe_rl.recipes.dpo.step import combine, pair_batch, pair_loss

    layout = common.layout_for(LAYOUT_OF_WORLD[int(os.environ.get("WORLD_SIZE", "1"))])
    common.setup(layout)
    policy = common.make_policy(hf_dir, layout, micro)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, common.read_vocab(hf_dir), (n,), generator=g).tolist()  # noqa: E731
    prompt = seq // 4
    pairs = [PreferencePair(str(i), ids(prompt), ids(seq - prompt), ids(seq - prompt)) for i in range(batch // 2)]
    per = len(pairs) // policy.dp_size
    mine = list(range(policy.dp_rank * per, (policy.dp_rank + 1) * per))
    ref = -50 + torch.rand(len(pairs), 2, generator=g)
    seqs, extras = pair_batch([pairs[i] for i in mine], ref[mine])
    dpo_loss_fn = pair_loss(RunConfig(), len(pairs))

    rl_extras = {"old_logp": policy.logprobs(seqs).logp, "adv": torch.randn(len(seqs), generator=g),
                 "mask": extras["resp"]}
    tokens, seqs_total = float(batch * (seq - prompt)), float(batch)

    def rl_loss(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        ex, valid = mb.extras, (mb.index >= 0).float().unsqueeze(1)
        return compute_loss("gspo", logp=logp, old_logp=ex["old_logp"], advantages=ex["adv"], mask=ex["mask"] * valid,
                            global_num_tokens=tokens, global_num_seqs=seqs_total)

    def rl() -> None:
        combine_loss_metrics(policy, policy.update(seqs, rl_extras, rl_loss).microbatches)

    def dpo() -> None:
        combine(policy, policy.update(seqs, extras, dpo_loss_fn, group_size=2).microbatches)

    t = common.interleave({"rl": rl, "dpo": dpo}, rounds, warmup=1)
    return {"wall": t.wall, "cpu": t.cpu, "load": os.getloadavg()[0]}


def bench_rows(rounds: int = 8, worlds: tuple[int, ...] = (1, 2), shape: Shape = BASE, batch: int = BASE_BATCH,
               seq: int = BASE_SEQ, micro: int = BASE_MICRO) -> list[dict[str, Any]]:
    """One row per layout: medians of both sides and the DPO / RL tokens/s ratio (wall and CPU)."""
    from moe_rl.testing import run_ranks

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = common.write_model(tmp, shape)
        for world in worlds:
            res = run_ranks(_worker, world, hf, batch, seq, micro, rounds, timeout=1800)
            wall, cpu = res[0]["wall"], res[0]["cpu"]
            rows.append({"layout": LAYOUT_OF_WORLD[world], "rl_s": common.median(wall["rl"]),
                         "dpo_s": common.median(wall["dpo"]), "ratio": common.paired_ratio(wall["rl"], wall["dpo"]),
                         "cpu_ratio": common.paired_ratio(cpu["rl"], cpu["dpo"]), "tokens": batch * seq,
                         "load": res[0]["load"], "shape": shape, "batch": batch, "seq": seq, "micro": micro,
                         "rounds": rounds})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    head = (f"Qwen3-MoE-shaped model ({r0['shape'].label}), B={r0['batch']} sequences x T={r0['seq']} tokens "
            f"(B/2 pairs, prompts of T/4), micro-batches of {r0['micro']}, fp32; medians of {r0['rounds']} "
            f"interleaved rounds (load average {r0['load']:.1f} at the end).")
    table = common.md_table(
        ["layout", "RL update (s)", "DPO step (s)", "RL tokens/s", "DPO tokens/s", "DPO / RL, wall", "DPO / RL, CPU"],
        [[r["layout"], f"{r['rl_s']:.3f}", f"{r['dpo_s']:.3f}", f"{r['tokens'] / r['rl_s']:.0f}",
          f"{r['tokens'] / r['dpo_s']:.0f}", f"{r['ratio']:.3f}", f"{r['cpu_ratio']:.3f}"] for r in rows], "lrrrrrr")
    notes = ("DPO / RL: DPO tokens/s over RL tokens/s, the median of per-round ratios (> 1: DPO is faster). "
             "Both run one forward and one backward over the same tokens; the losses differ (DPO sums each "
             "response's log-probs and pairs them, GSPO clips sequence ratios).")
    return "\n\n".join([head, table, notes])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2], choices=sorted(LAYOUT_OF_WORLD),
                   help="1: one rank; 2: EP2 on two gloo ranks")
    p.add_argument("--batch", type=int, default=BASE_BATCH, help="sequences (pairs x 2)")
    p.add_argument("--seq", type=int, default=BASE_SEQ)
    p.add_argument("--micro", type=int, default=BASE_MICRO, help="sequences per micro-batch (even)")
    a = p.parse_args(argv)
    print(format_table(bench_rows(a.rounds, tuple(a.worlds), BASE, a.batch, a.seq, a.micro)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
