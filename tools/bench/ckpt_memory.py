"""Host memory of a checkpoint save and load with the distributed optimizer, per rank: today's vs each rank's own range.

Four gloo ranks run the megatron policy as DP2 x EP2 (`ep2-dp2`: the dense part over 4 data-parallel
ranks, the experts over 2 expert-parallel x 2 expert-data-parallel) with megatron's distributed
optimizer, train one update, save a distributed checkpoint (`Policy.save_sharded`) and load it
back, for two models 4x apart in size (more layers, same shapes otherwise).

- `today`: megatron-core's own `fully_reshardable` (`gathered=True`): every rank gathers its model
  shard's fp32 optimizer state (param, exp_avg, exp_avg_sq) over DP into host memory to save, and
  allocates it zero-filled to load.
- `new`: each DP rank writes and reads only its own range (`moe_rl/policy/optim_shards.py`), under
  the same keys.

Per rank and phase: `peak_rss_growth_mb`, the peak resident memory during the phase over the rank's
resident memory just before it (Linux's VmHWM, reset before the phase through /proc/self/clear_refs,
glibc handing freed blocks back); `own_optimizer_shard_mb`, the rank's own fp32 optimizer state;
`model_shard_optimizer_mb`, its model shard's (what today gathers). megatron's file writers run in
forked processes, which share the rank's pages; their peak is `writer_peak_rss_mb` (pages shared
with the rank included), not part of the growth. Target: growth <= 1.5 x the own shard, flat as the
model grows.

    python tools/bench/ckpt_memory.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import weight_sync_cost as inv
from common import Shape

LAYOUT = "ep2-dp2"
BASE = Shape(vocab_size=512, hidden_size=256, head_dim=32, moe_intermediate_size=256, num_experts=8)
SIZES = (BASE.with_(num_hidden_layers=4), BASE.with_(num_hidden_layers=16))  # ~3.9x the parameters
PATHS = ("today", "new")
MB = 1 << 20


def _optimizer_mb(policy: Any) -> tuple[float, float]:
    """(this rank's own fp32 optimizer state, its model shard's), MiB: 3 fp32 values per element."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from moe_rl.policy.train_step import sub_optimizers

    own = whole = 0
    for opt in sub_optimizers(policy.opt.optimizer):
        assert isinstance(opt, DistributedOptimizer)
        for gbuf_index, by_dtype in enumerate(opt.gbuf_ranges):
            for buckets in by_dtype.values():
                own += sum(len(r["param"]) for b in buckets for r in b["param_map"].values())
            whole += sum(p.numel() for p in opt.buffers[gbuf_index].param_index_map)
    return own * 12 / MB, whole * 12 / MB


def _rank(path: str, hf_dir: str, ckpt: str) -> dict[str, Any]:
    import gc

    from moe_rl.policy.dist_ckpt import load_sharded, save_sharded
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    import torch.distributed as dist

    policy = Policy(PolicySpec(hf_dir=hf_dir, layout=ParallelLayout.parse(LAYOUT), micro_batch_size=2,
                               optim=OptimConfig(lr=1e-4, total_steps=4, distributed_optimizer=True)))
    batch = common.random_batch(8, 32, common.read_vocab(hf_dir), seed=dist.get_rank())
    policy.update(batch[policy.dp_rank::policy.dp_size], {}, common.token_loss(8 * 32))
    own, whole = _optimizer_mb(policy)
    gathered = path == "today"
    out = {"own_optimizer_shard_mb": own, "model_shard_optimizer_mb": whole, "rank": dist.get_rank()}
    with common.returned_memory():
        for phase, run in (("save", lambda: save_sharded(policy, ckpt, gathered=gathered)),
                           ("load", lambda: load_sharded(policy, ckpt, gathered=gathered))):
            gc.collect()
            dist.barrier()
            with common.PeakAbove() as peak:
                run()
            out[f"{phase}_growth_mb"] = peak.mb
            if phase == "save":  # the largest finished child's peak, over the process's life: the save's writers
                out["save_writer_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            dist.barrier()
    return out


def bench_rows(sizes: tuple[Shape, ...] = SIZES) -> list[dict[str, Any]]:
    from moe_rl.testing import run_ranks

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, shape in enumerate(sizes):
            hf_dir = common.write_model(Path(tmp) / f"m{i}", shape)
            for path in PATHS:
                ckpt = str(Path(tmp) / f"ckpt_{i}_{path}")
                for r in run_ranks(_rank, 4, path, hf_dir, ckpt, timeout=900):
                    for phase in ("save", "load"):
                        rows.append({"path": path, "phase": phase, "model": shape.label, "params": shape.params(),
                                     "layout": LAYOUT, "rank": r["rank"],
                                     "peak_rss_growth_mb": round(r[f"{phase}_growth_mb"], 1),
                                     "own_optimizer_shard_mb": round(r["own_optimizer_shard_mb"], 1),
                                     "model_shard_optimizer_mb": round(r["model_shard_optimizer_mb"], 1),
                                     "writer_peak_rss_mb": round(r["save_writer_mb"], 1) if phase == "save" else None})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The busiest rank per model, path and phase, and its growth over its own optimizer shard."""
    lines = [f"Layout {LAYOUT}, 4 gloo ranks, megatron's distributed optimizer; the rank with the largest growth "
             "per row.", "",
             "| model (params) | phase | path | peak growth MB | own optimizer shard MB | model shard's MB "
             "| growth / own shard | forked writer peak MB |", "|---|---|---|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["params"], r["model"], r["phase"], r["path"]) for r in rows},
                  key=lambda k: (k[0], k[2] != "save", PATHS.index(k[3])))
    for params, model, phase, path in keys:
        mine = [r for r in rows if (r["params"], r["phase"], r["path"]) == (params, phase, path)]
        top = max(mine, key=lambda r: r["peak_rss_growth_mb"])
        lines.append(f"| {params / 1e6:.1f}M | {phase} | {path} | {top['peak_rss_growth_mb']:.1f} | "
                     f"{top['own_optimizer_shard_mb']:.1f} | {top['model_shard_optimizer_mb']:.1f} | "
                     f"{top['peak_rss_growth_mb'] / top['own_optimizer_shard_mb']:.2f} | "
                     f"{'-' if top['writer_peak_rss_mb'] is None else format(top['writer_peak_rss_mb'], '.1f')} |")
    return "\n".join(lines)


def _shard_params(fs: inv.Flagship) -> tuple[float, float]:
    """(model shard, own range) parameters of the busiest rank of a flagship layout for each: a stage's dense
    tensors over TP (split ones) or whole (norms), its experts over EP x ETP; the own range of each
    over its data-parallel group (dense: world / (tp pp), experts: world / (pp ep etp))."""
    lay, n = fs.layout, fs.config["num_hidden_layers"]
    stage = lay.stage_of_layer(n)
    dp, edp = lay.world // (lay.tp * lay.pp), lay.world // (lay.pp * lay.ep * lay.etp)
    dense, experts = [0.0] * lay.pp, [0.0] * lay.pp
    for t in fs.tensors:
        s = 0 if t.layer < 0 else lay.pp - 1 if t.layer >= n else stage[t.layer]
        if t.expert is None:
            dense[s] += t.numel / (lay.tp if t.split else 1)
        else:
            experts[s] += t.numel / (lay.ep * lay.etp)
    return (max(d + e for d, e in zip(dense, experts)),        # each the busiest stage of its own
            max(d / dp + e / edp for d, e in zip(dense, experts)))  # (the first, dense, stage vs an MoE one)


def flagship_table(rows: list[dict[str, Any]]) -> str:
    """The measured growth per optimizer byte (today: over the model shard's; new: over the own
    range's), largest over models and ranks, times the flagship layouts' bytes: an estimate."""
    def ratio(path: str, phase: str, over: str) -> float:
        return max(r["peak_rss_growth_mb"] / r[over] for r in rows if (r["path"], r["phase"]) == (path, phase))

    fit = {(path, phase): ratio(path, phase, "model_shard_optimizer_mb" if path == "today" else "own_optimizer_shard_mb")
           for path in PATHS for phase in ("save", "load")}
    lines = ["Estimate (not measured): host memory growth of the busiest trainer rank at the shipped flagship "
             "layouts, the measured growth per fp32 optimizer byte above times 12 bytes per parameter of the rank's "
             f"model shard (today: x {fit['today', 'save']:.2f} save, x {fit['today', 'load']:.2f} load) or of its "
             f"own range (new: x {fit['new', 'save']:.2f} save, x {fit['new', 'load']:.2f} load).", "",
             "| model, layout | model shard fp32 state GB | own range GB | today save / load GB | new save / load GB |",
             "|---|---:|---:|---:|---:|"]
    a = inv.Assumptions()
    for name in inv.FLAGSHIPS:
        fs = inv.flagship(inv.CONFIGS / name, a, 0.03)
        shard, own = (12 * x / 1e9 for x in _shard_params(fs))
        lay = fs.layout
        lines.append(f"| {lay.model}, tp{lay.tp} pp{lay.pp} ep{lay.ep} ({lay.world} GPUs) | {shard:,.1f} | {own:,.1f} | "
                     f"{fit['today', 'save'] * shard:,.1f} / {fit['today', 'load'] * shard:,.1f} | "
                     f"{fit['new', 'save'] * own:,.1f} / {fit['new', 'load'] * own:,.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--quick", action="store_true", help="the smaller model only")
    a = p.parse_args(argv)
    rows = bench_rows(SIZES[:1] if a.quick else SIZES)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
    print(format_table(rows))
    print()
    print(flagship_table(rows))


if __name__ == "__main__":
    main()
