"""Bytes each trainer rank receives per RL step, and rank 0's peak host memory, for the step's samples.

Rank 0 alone generates; the other ranks need the samples they train on. Two ways, both run here on
4 gloo processes with the real hand-off code and synthetic samples (token ids, engine log-probs,
engine routes in the engine's uint8 ids), the layout shrunk to 2 data-parallel groups of a 2-rank
model-parallel group (TP2 x DP2):

- `broadcast` (before): the whole step's samples, pickled once, broadcast to every rank
  (`moe_rl.dist.collectives.broadcast_object`, what the trainer did);
- `share_out` (now): rank 0 plans each data-parallel rank's share (`moe_rl.recipes.rl.batch.my_share`)
  and `moe_rl.dist.collectives.share_out` sends each share once to its model-parallel group, which
  broadcasts it among itself: every rank receives 1/DP of the step.

Measured per rank: the pickled bytes it received. Rank 0: the growth of its peak RSS during the
hand-off, over the samples it already holds. Each variant runs in fresh processes. The measured
bytes are compared with the formula below, which then scales them to the flagship
(launch/configs/qwen3_30b_a3b_gspo.yaml: 64 prompts x 8 samples of up to 1,024 + 8,192 tokens,
48 MoE layers, top-8 of 128 experts, tp2 x pp4 on 32 GPUs, so DP = 4):

    step bytes   = N * (8 T + 4 R + (T - 1) L K b)      N samples of T tokens, R generated,
                                                        b = 1 byte per expert id (uint8)
    per rank     = step bytes (broadcast)   |   step bytes / DP (share_out)

The old-pass route recording (R2 and drift) all-reduces a `[B/DP, T, L, K]` buffer over TP x PP:
int32 before, now `moe_rl.routes.record_dtype` (uint8 up to 255 experts).

**Who receives the replies** (`--json FILE` writes these rows): the step's whole intake, from SGLang's
reply bytes to each rank's share, with the product's code on gloo ranks: `path` today
(`rollout.intake=rank0`: rank 0 parses every reply, scores, plans and hands out the shares) and new
(`rollout.intake=heads`: each data-parallel head parses its own groups' replies, the heads share a few
numbers per sample and move the samples the token-balanced plan puts elsewhere). The replies come
from `moe_rl.testing.intake.SeededEngine` in SGLang's format (JSON, routes base64 of int32 over every
decoder layer), at the flagship's geometry (48 layers, top-8 of 128 experts) and shorter answers, R3 on.
Per rank: the bytes it received (reply bytes, the heads' numbers and moved samples, or its share from
its head or rank 0); rank 0's CPU seconds of the step's intake (receive + decode + score + plan +
hand-off; the synthetic server's time to make the replies subtracted: on a cluster each head has its
own cores, here 4 ranks share 2) and its peak RSS growth. Fitted and scaled to the flagship:

    rank 0 bytes in   = N x b x rows x L x K        (today)   |   that / DP + the heads' numbers (new)
    rank 0 seconds    = c x N x rows x L x K        (today)   |   that / DP                     (new)

    python tools/bench/handoff_bytes.py [--json FILE] [--quick]
"""
from __future__ import annotations

import argparse
import json
import pickle
import resource
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table  # noqa: E402

FLAGSHIP = {"samples": 64 * 8, "tokens": 1024 + 8192, "generated": 8192, "layers": 48, "topk": 8, "experts": 128,
            "world": 32, "dp": 4}
MP = [[0, 1], [2, 3]]  # the shrunk layout: model-parallel groups of 2 ranks, 2 data-parallel groups


def step_bytes(n: int, t: int, r: int, layers: int, k: int, id_bytes: int = 1) -> int:
    """The formula of the module docstring."""
    return n * (8 * t + 4 * r + (t - 1) * layers * k * id_bytes)


def _samples(n: int, t: int, r: int, layers: int, k: int, experts: int) -> Any:
    import torch

    from moe_rl.data.dataset import Prompt
    from moe_rl.samples import Samples

    g = torch.Generator().manual_seed(0)
    prompt = Prompt(uid="p", prompt_ids=list(range(t - r)), prompt_text="", answer="")
    return Samples([prompt] * n, [torch.randint(0, 1000, (t,), generator=g) for _ in range(n)],
                   torch.full((n,), t - r), [torch.randn(r, generator=g) for _ in range(n)],
                   [torch.randint(0, experts, (t - 1, layers, k), generator=g, dtype=torch.uint8) for _ in range(n)],
                   [""] * n, torch.rand(n, generator=g), torch.randn(n, generator=g))


def _rank(variant: str, n: int, t: int, r: int, layers: int, k: int, experts: int) -> dict[str, float]:
    from types import SimpleNamespace

    import torch.distributed as dist

    from moe_rl.config import load_config
    from moe_rl.dist import collectives
    from moe_rl.recipes.rl.batch import StepBatch, my_share

    me = dist.get_rank()
    collectives.init_control_group(600.0)
    peers = next(g for g in MP if me in g)
    dp_rank = MP.index(peers)
    samples = _samples(n, t, r, layers, k, experts) if me == 0 else None
    collectives.all_errors(None)  # every rank ready: the hand-off starts together
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if variant == "broadcast":
        got = collectives.broadcast_object(samples)
    else:
        cfg = load_config(None, ["algo.num_minibatches=2", "algo.shuffle_minibatches=false"])
        run = SimpleNamespace(cfg=cfg, policy=SimpleNamespace(dp_size=len(MP), packs_sequences=False))
        plans = {d: StepBatch({}, my_share(run, samples, 1, d), 0) for d in range(len(MP))} if me == 0 else None
        got = collectives.share_out(plans, dp_rank, peers)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rank": me, "received": len(pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL)),
            "rss_growth": (peak - before) * 1024.0}


LAYOUTS = {"dp2": [[0], [1]], "tp2xdp2": [[0, 1], [2, 3]], "dp4": [[0], [1], [2], [3]]}


def _intake_rank(path: str, layout: str, prompts: int, answer: int, hidden: int, k: int, experts: int
                 ) -> dict[str, Any]:
    """One rank's intake of one step (`path` today or new), measured."""
    import time

    import common
    import torch.distributed as dist

    from moe_rl.config import load_config
    from moe_rl.dist import collectives
    from moe_rl.recipes.rl import heads as heads_module
    from moe_rl.recipes.rl.batch import RankZeroIntake
    from moe_rl.recipes.rl.heads import HeadsIntake
    from moe_rl.recipes.rl.rollouts import SyncRollouts
    from moe_rl.routes import Geometry
    from moe_rl.testing.intake import SeededEngine, intake_run

    me, groups = dist.get_rank(), LAYOUTS[layout]
    collectives.init_control_group(600.0)
    peers = next(g for g in groups if me in g)
    cfg = load_config(None, ["rollout.n_samples=2", f"data.prompts_per_step={prompts}", "algo.num_minibatches=1",
                             "algo.replay=r3", "algo.shuffle_minibatches=true"])
    geo = Geometry(num_layers=hidden, topk=k, num_experts=experts, moe_layers=list(range(hidden)))
    lo, hi = int(answer * 0.75), int(answer * 1.25)
    if path == "new":
        intake = HeadsIntake(me, groups.index(peers), peers, prompts)
        engine = SeededEngine(geo, (lo, hi), wire=True) if intake.is_head else None
        rollouts = SyncRollouts(draw=intake.draw, request=intake.request)
    else:
        intake, rollouts = RankZeroIntake(), SyncRollouts()
        engine = SeededEngine(geo, (lo, hi), wire=True) if me == 0 else None
    run = intake_run(cfg, me, groups.index(peers), len(groups), peers, engine, list(range(hidden)))
    run.intake, run.rollouts = intake, rollouts
    between = {"bytes": 0}  # what the heads receive from one another: the shared numbers, the moved samples
    exchange, gather = heads_module.exchange, heads_module.all_gather_objects

    def counted_exchange(outgoing: dict[int, Any], group: Any) -> dict[int, Any]:
        got = exchange(outgoing, group)
        between["bytes"] += sum(len(pickle.dumps(v)) for r, v in got.items() if r != collectives.rank(group))
        return got

    def counted_gather(obj: Any, group: Any = None) -> list[Any]:
        parts = gather(obj, group)
        between["bytes"] += sum(len(pickle.dumps(p)) for r, p in enumerate(parts) if r != collectives.rank(group))
        return parts

    heads_module.exchange, heads_module.all_gather_objects = counted_exchange, counted_gather
    collectives.all_errors(None)  # every rank ready: the step starts together
    with common.returned_memory(), common.PeakAbove() as peak:
        cpu, wall = time.process_time(), time.perf_counter()
        batch = intake.batch(run, 1)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    rows = sum(n - 1 for n in batch.share.samples.lengths())
    replies = engine.bytes_in if engine is not None else 0
    receives = engine is not None  # it asked the servers: reply bytes in, its share made here
    share_bytes = 0 if receives else len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
    return {"rank": me, "bytes_in": replies + between["bytes"] + share_bytes, "reply_bytes": replies,
            "cpu_s": cpu - (engine.make_s if engine is not None else 0.0), "wall_s": wall, "peak_mb": peak.mb,
            "share_rows": rows, "tokens": batch.tokens}


def intake_rows(quick: bool = False) -> list[dict[str, Any]]:
    """The step's intake today and new over the layouts, at a fixed step size."""
    from moe_rl.testing import run_ranks

    f = FLAGSHIP
    prompts, answer = (8, 256) if quick else (32, 1024)
    out = []
    for layout, groups in LAYOUTS.items():
        ranks = sum(len(g) for g in groups)
        for path in ("today", "new"):
            per = run_ranks(_intake_rank, ranks, path, layout, prompts, answer, f["layers"], f["topk"], f["experts"],
                            timeout=900)
            others = [p["bytes_in"] for p in per[1:]]
            out.append({"path": path, "ranks": ranks, "layout": layout, "dp": len(groups), "samples": 2 * prompts,
                        "tokens": per[0]["tokens"], "layers": f["layers"], "topk": f["topk"],
                        "rank0_bytes_in": per[0]["bytes_in"], "mean_other_rank_bytes_in": sum(others) / len(others),
                        "rank0_seconds": per[0]["cpu_s"], "rank0_wall_seconds": per[0]["wall_s"],
                        "rank0_peak_rss_mb": per[0]["peak_mb"], "step_reply_bytes": sum(p["reply_bytes"] for p in per),
                        "bytes_in_per_rank": [p["bytes_in"] for p in per]})
    return out


def intake_table(rows: list[dict[str, Any]]) -> str:
    """The rows, the targets, and the fitted formulas at the flagship."""
    f = FLAGSHIP
    mb = lambda b: f"{b / 1e6:.1f} MB"  # noqa: E731
    table = [(r["layout"], r["path"], mb(r["rank0_bytes_in"]), mb(r["mean_other_rank_bytes_in"]),
              f"{r['rank0_bytes_in'] / max(1.0, r['mean_other_rank_bytes_in']):.2f}", f"{r['rank0_seconds']:.2f}",
              f"{r['rank0_peak_rss_mb']:.0f}") for r in rows]
    ids = lambda r: r["tokens"] * r["layers"] * r["topk"]  # noqa: E731  route ids of the step (about rows x L x K)
    fit = {}  # per path: bytes and seconds per route id of the step, x DP for new (each head its 1/DP)
    for path in ("today", "new"):
        mine = [r for r in rows if r["path"] == path]
        per = lambda r: 1 if path == "today" else r["dp"]  # noqa: E731
        fit[path] = (sum(r["rank0_bytes_in"] * per(r) for r in mine) / sum(ids(r) for r in mine),
                     sum(r["rank0_seconds"] * per(r) for r in mine) / sum(ids(r) for r in mine))
    speed = {r["layout"]: r["rank0_seconds"] for r in rows if r["path"] == "today"}
    drop = [(r["layout"], r["dp"], speed[r["layout"]] / r["rank0_seconds"]) for r in rows if r["path"] == "new"]
    flag_ids, dp = f["samples"] * (f["tokens"] - 1) * f["layers"] * f["topk"], f["dp"]
    (b, c), (b_new, c_new) = fit["today"], fit["new"]
    lines = [f"Measured: one step of {rows[0]['samples']} samples ({rows[0]['tokens']:,} tokens), {f['layers']} MoE "
             f"layers, top-{f['topk']}, R3 on; bytes each rank received, rank 0's CPU seconds and peak RSS growth.", "",
             md_table(["layout", "path", "rank 0 bytes in", "mean of the other ranks", "ratio", "rank 0 s",
                       "rank 0 peak MB"], table), "",
             "Rank 0's seconds today / new: " + ", ".join(f"{lay} (DP {dp}) {x:.2f}x" for lay, dp, x in drop) + ".",
             f"Fitted per route id of the step: today b = {b:.3f} bytes, c = {c * 1e9:.1f} ns on rank 0; new "
             f"b = {b_new:.3f} bytes, c = {c_new * 1e9:.1f} ns x 1/DP (its own replies and the samples moved to it).",
             "", md_table(["flagship (estimate, fitted)", "today (rank 0 receives)", f"new (rank 0, one of {dp} heads)"], [
                 ("bytes in per step, rank 0", f"{b * flag_ids / 1e9:.1f} GB", f"{b_new * flag_ids / dp / 1e9:.1f} GB"),
                 ("seconds per step, rank 0", f"{c * flag_ids:.0f} s", f"{c_new * flag_ids / dp:.0f} s")])]
    return "\n".join(lines)


def bench_rows(samples: int = 64, tokens: int = 2048, generated: int = 1024) -> list[dict[str, Any]]:
    from moe_rl.testing import run_ranks

    f = FLAGSHIP
    rows = []
    for variant in ("broadcast", "share_out"):
        per_rank = run_ranks(_rank, 4, variant, samples, tokens, generated, f["layers"], f["topk"], f["experts"],
                             timeout=600)
        rows.append({"variant": variant, "received": [p["received"] for p in per_rank],
                     "rank0_rss": per_rank[0]["rss_growth"]})
    return rows


def format_table(rows: list[dict[str, Any]], samples: int = 64, tokens: int = 2048, generated: int = 1024) -> str:
    from moe_rl.routes import record_dtype

    f = FLAGSHIP
    shrunk = step_bytes(samples, tokens, generated, f["layers"], f["topk"])
    full = step_bytes(f["samples"], f["tokens"], f["generated"], f["layers"], f["topk"])
    dp_shrunk = len(MP)
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    mb = lambda b: f"{b / 1e6:.1f} MB"  # noqa: E731
    measured = []
    for row in rows:
        share = row["variant"] == "share_out"
        formula = shrunk / dp_shrunk if share else shrunk
        other = max(row["received"][1:])
        measured.append((row["variant"], mb(other), mb(formula), f"{other / formula:.3f}", mb(row["rank0_rss"])))
    lines = [f"Measured on 4 gloo ranks (TP2 x DP2), {samples} samples of {tokens} tokens ({generated} generated), "
             f"{f['layers']} MoE layers, top-{f['topk']}: bytes one rank received (the largest of ranks 1-3), "
             "the formula's, and the growth of rank 0's peak RSS during the hand-off.", "",
             md_table(["hand-off", "received per rank", "formula", "measured / formula", "rank 0 peak RSS growth"],
                      measured), ""]
    # rank 0's peak grows with what it serialises at once: the whole step, or one share (1/DP of it)
    scale = {"broadcast": full / shrunk, "share_out": (full / f["dp"]) / (shrunk / dp_shrunk)}
    rss = {row["variant"]: row["rank0_rss"] * scale[row["variant"]] for row in rows}
    rec_before = f["samples"] / f["dp"] * f["tokens"] * f["layers"] * f["topk"] * 4
    rec_after = rec_before / 4 * record_dtype(f["experts"]).itemsize
    lines += [f"Flagship (formula): step bytes = N (8 T + 4 R + (T - 1) L K) = {f['samples']} x (8 x {f['tokens']} + "
              f"4 x {f['generated']} + {f['tokens'] - 1} x {f['layers']} x {f['topk']}) = {gb(full)}.", "",
              md_table(["per trainer rank, per step", "before (broadcast)", "now", "ratio"], [
                  ("samples and engine routes received", gb(full), gb(full / f["dp"]), f"1/{f['dp']}"),
                  ("route recording all-reduced over TP x PP (per old pass)", gb(rec_before), gb(rec_after),
                   f"{rec_after / rec_before:.2f}"),
                  ("rank 0: serialised at once", gb(full), gb(full / f["dp"]), f"1/{f['dp']}"),
                  ("rank 0: peak host memory growth in the hand-off (measured, x the ratio of what it "
                   "serialises at once)", gb(rss["broadcast"]), gb(rss["share_out"]),
                   f"{rss['share_out'] / rss['broadcast']:.2f}" if rss["broadcast"] else
                   "n/a (too small to raise the peak)"),
              ]),
              "", f"- {f['world']} ranks (tp2 x pp4 x dp4); each of the {f['world'] // f['dp']} ranks of a "
              "model-parallel group trains on the same share. The weight sync still moves every parameter through "
              "trainer rank 0 (SGLang 0.5.23 receives an update broadcast from group rank 0 only); its gather of "
              "bucket i + 1 now overlaps the broadcast of bucket i."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--generated", type=int, default=1024)
    p.add_argument("--json", type=Path, default=None, help="write the intake rows here ({\"rows\": [...]})")
    p.add_argument("--quick", action="store_true", help="a smaller step (8 prompts, 256-token answers)")
    a = p.parse_args(argv)
    if not a.quick:
        print(format_table(bench_rows(a.samples, a.tokens, a.generated), a.samples, a.tokens, a.generated), "\n")
    rows = intake_rows(a.quick)
    if a.json is not None:
        a.json.write_text(json.dumps({"rows": rows}, indent=1))
    print(intake_table(rows))


if __name__ == "__main__":
    main()
