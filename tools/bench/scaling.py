"""How the moe_rl update step scales: with the number of experts, the sequence length, the layout.

One update = `Policy.update(seqs, {}, loss)` with the mean next-token NLL, as in
overhead.py. Three tables, each with ratios to its first row:

- experts: 8, 16, 32, 64 experts at the same top-k, batch and tokens. Active
  parameters (the FLOPs per token) stay the same; what grows is the weights, the
  optimizer state and the per-expert work outside the matmuls.
- sequence length: 64 ... 512 tokens per sequence at the same tokens per step and
  per microbatch (fewer, longer sequences), so what grows is attention.
- layout: one rank against EP2, TP2 and PP2 on two gloo ranks, same global batch.
  Each rank runs one thread, so two ranks have twice the cores of one.

Experts and sequence-length variants live in one process and alternate round by
round; the layouts need their own process groups, so they run one after another
(EP2, TP2, PP2 in one pair of processes; the one-rank row is the base model of the
experts table). Peak memory: what each variant added while built and stepped
(`common.build_measured`), the largest over ranks.

    python tools/bench/scaling.py                          # all three tables
    python tools/bench/scaling.py --experts 8 16 --seqs 64 128 --layouts ep2 --rounds 2
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import BASE, BASE_BATCH, BASE_MICRO, BASE_SEQ

TOKENS = BASE_BATCH * BASE_SEQ  # per step, in every row
MICRO_TOKENS = BASE_MICRO * BASE_SEQ  # per microbatch, in the sequence-length table


def _policy_step(hf_dir: str, layout: Any, batch: int, seq: int, micro: int) -> Any:
    """Builder of one variant: a Policy and its update on this rank's share of a fixed batch."""
    def build() -> Any:
        policy = common.make_policy(hf_dir, layout, micro)
        seqs = common.shard(common.random_batch(batch, seq, common.read_vocab(hf_dir)))
        loss = common.token_loss(batch * (seq - 1))
        return lambda: policy.update(seqs, {}, loss)
    return build


STEPS = 1  # steps each variant takes while its memory is measured (the first makes the Adam state)


def _summary(fns_mem: tuple[dict[str, Any], dict[str, float]], rounds: int) -> dict[str, Any]:
    fns, mem = fns_mem
    t = common.interleave(fns, rounds, warmup=0)
    return {"wall": t.wall, "cpu": t.cpu, "mem": mem}


def _single_worker(expert_dirs: dict[int, str], seqs: list[int], rounds: int) -> dict[str, Any]:
    """Experts table, then sequence-length table, on one rank."""
    layout = common.layout_for("single")
    common.setup(layout)
    experts = _summary(common.build_measured(
        {e: _policy_step(d, layout, BASE_BATCH, BASE_SEQ, BASE_MICRO) for e, d in expert_dirs.items()}, STEPS), rounds)
    gc.collect()
    base_dir = expert_dirs.get(BASE.num_experts) or next(iter(expert_dirs.values()))
    by_seq = _summary(common.build_measured(
        {t: _policy_step(base_dir, layout, TOKENS // t, t, max(MICRO_TOKENS // t, 1)) for t in seqs}, STEPS), rounds)
    return {"experts": experts, "seq": by_seq, "base_mb": common.rss_mb()}


def _layout_worker(hf_dir: str, layouts: list[str], rounds: int) -> dict[str, Any]:
    """Each layout in turn on these ranks: build, measure, time, tear down the groups."""
    from megatron.core import parallel_state

    out = {}
    for i, name in enumerate(layouts):
        layout = common.layout_for(name)
        common.setup(layout)
        builder = _policy_step(hf_dir, layout, BASE_BATCH, BASE_SEQ, BASE_MICRO)
        out[name] = _summary(common.build_measured({name: builder}, STEPS, warm_first=i == 0), rounds)
        gc.collect()
        parallel_state.destroy_model_parallel()
    return out


def bench_rows(rounds: int = 3, experts: tuple[int, ...] = (8, 16, 32, 64), seqs: tuple[int, ...] = (64, 128, 256, 512),
               layouts: tuple[str, ...] = ("ep2", "tp2", "pp2")) -> dict[str, list[dict[str, Any]]]:
    """`{"experts": rows, "seq": rows, "layout": rows}`; each row has wall/CPU medians, ratios to the
    first row (paired within a process, else ratios of medians) and `mem_mb`."""
    from moe_rl.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {e: common.write_model(tmp, BASE.with_(num_experts=e)) for e in experts}
        single = run_ranks(_single_worker, 1, dirs, list(seqs), rounds, timeout=1800)[0]
        multi = (run_ranks(_layout_worker, 2, dirs[experts[0]], list(layouts), rounds, timeout=1800)
                 if layouts else [])

    def rows(res: dict[str, Any], keys: list[Any], paired: bool, **extra: Any) -> list[dict[str, Any]]:
        first = keys[0]
        out = []
        for k in keys:
            wall, cpu = res["wall"][k], res["cpu"][k]
            ratio = (common.paired_ratio(wall, res["wall"][first]), common.paired_ratio(cpu, res["cpu"][first])) \
                if paired else (common.median(wall) / common.median(res["wall"][first]),
                                common.median(cpu) / common.median(res["cpu"][first]))
            out.append({"key": k, "wall_s": common.median(wall), "cpu_s": common.median(cpu), "ratio": ratio[0],
                        "cpu_ratio": ratio[1], "mem_mb": res["mem"][k], "rounds": rounds, **extra})
        return out

    e_rows = rows(single["experts"], list(experts), True)
    for r in e_rows:
        shape = BASE.with_(num_experts=r["key"])
        r.update(params=shape.params(), active=shape.params(active=True))
    s_rows = rows(single["seq"], list(seqs), True)
    for r in s_rows:
        r.update(batch=TOKENS // r["key"], micro=max(MICRO_TOKENS // r["key"], 1))
    # The one-rank row of the layout table is the base model of the experts table (same batch).
    merged = {"wall": {"single": single["experts"]["wall"][experts[0]]},
              "cpu": {"single": single["experts"]["cpu"][experts[0]]},
              "mem": {"single": single["experts"]["mem"][experts[0]]}}
    for name in layouts:
        for kind in ("wall", "cpu"):  # per round, the slower rank: it sets the pace
            merged[kind][name] = [max(ts) for ts in zip(*(m[name][kind][name] for m in multi))]
        merged["mem"][name] = max(m[name]["mem"][name] for m in multi)
    l_rows = rows(merged, ["single", *layouts], False)
    return {"experts": e_rows, "seq": s_rows, "layout": l_rows}


def _cells(r: dict[str, Any]) -> list[str]:
    return [f"{r['wall_s']:.3f}", f"{r['ratio']:.2f}", f"{r['cpu_s']:.3f}", f"{r['cpu_ratio']:.2f}",
            f"{r['mem_mb']:.0f}"]


_TIMES = ["step, wall (s)", "× first, wall", "step, CPU (s)", "× first, CPU", "peak memory/rank (MiB)"]


def format_table(tables: dict[str, list[dict[str, Any]]]) -> str:
    rounds = tables["experts"][0]["rounds"]
    parts = [(f"Update step of {BASE.label} unless a column says otherwise; {TOKENS} tokens per step, "
              f"fp32, one thread per rank, medians of {rounds} rounds. Peak memory: what the variant added "
              "(weights, gradients, Adam state, working memory) over the process's baseline; rows of one "
              "table compare to within a few MiB, absolute values move by ~20 MiB with what the process "
              "ran before.")]
    parts.append(f"By number of experts (top-{BASE.num_experts_per_tok}, B={BASE_BATCH} x T={BASE_SEQ}, "
                 "variants interleaved):\n\n" + common.md_table(
                     ["experts", "parameters", "active parameters", *_TIMES],
                     [[r["key"], f"{r['params'] / 1e6:.1f}M", f"{r['active'] / 1e6:.1f}M", *_cells(r)]
                      for r in tables["experts"]]))
    parts.append(f"By sequence length ({TOKENS} tokens per step, {MICRO_TOKENS} per microbatch, variants "
                 "interleaved):\n\n" + common.md_table(
                     ["T", "sequences", "per microbatch", *_TIMES],
                     [[r["key"], r["batch"], r["micro"], *_cells(r)] for r in tables["seq"]]))
    parts.append(f"By layout (B={BASE_BATCH} x T={BASE_SEQ} global; layouts run one after another, so "
                 "ratios are of medians; each round counts its slower rank):\n\n" + common.md_table(
                     ["layout", "ranks", *_TIMES],
                     [[r["key"], 1 if r["key"] == "single" else 2, *_cells(r)] for r in tables["layout"]]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--seqs", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--layouts", nargs="*", default=["ep2", "tp2", "pp2"], help="two-rank layouts")
    a = p.parse_args(argv)
    print(format_table(bench_rows(a.rounds, tuple(a.experts), tuple(a.seqs), tuple(a.layouts))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
