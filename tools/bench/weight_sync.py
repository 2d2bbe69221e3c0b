"""Weight sync time against parameter count: trainer -> rollout engine, both sync paths.

For each model size a Policy and a `LocalEngine` on the same checkpoint share one
process (one rank), and four variants alternate round by round:

- disk:   `DiskSync.sync`: `Policy.export_hf` writes safetensors into a version
          directory, the engine loads and validates it (`update_weights_from_disk`).
- tensor: `TensorSync.sync`: `Policy.hf_tensors()` gathers HF-named tensors, the
          engine validates and copies them in place (`update_weights_from_tensors`).
- export: `Policy.export_hf` alone (the trainer's share of the disk path).
- gather: iterating `Policy.hf_tensors()` alone (the trainer's share of the tensor path).

MB/s is the checkpoint's fp32 bytes over the median time; "× smallest" is the time
against the smallest model's, to read against the parameter ratio.

`--scale`: the update-group push (rollout.weight_sync=nccl, gloo on CPU) from 1, 2 and 4
trainer processes (layouts single, ep2, pp2-ep2, tp2-ep2) of the megatron policy to one
`moe-rl serve --dtype bfloat16`, for models of 8, 32 and 64 experts (the other shapes fixed),
four variants alternating round by round in one run: `funnel` (the earlier path, every
tensor to rank 0 by its own message, rank 0 broadcasts; `FunnelSync`), `sources` full (with and
without hashing the verify checksums as it sends: the funnel hashes nothing, so the unhashed row
is the like-for-like one) and `sources` delta (`NcclSync`: every rank sends its own share; delta after a step of ±1e-6 on
every weight, what Adam's normalised step does at lr 1e-6). Bytes and messages are counted by
wrapping torch.distributed's calls in each rank (weights messages: point-to-point sends and
the broadcasts of the update groups; the TP gathers' bytes count, their calls are `gathers`).
Every row is verified against the server's checksums. Slopes are log-log fits.

    python tools/bench/weight_sync.py                     # three sizes, 3 rounds
    python tools/bench/weight_sync.py --sizes 0 1 2 3     # up to 110M parameters
    python tools/bench/weight_sync.py --scale --json ws.json
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import BASE, Shape

# Roughly 4x apart in parameters (2.3M, 8.8M, 35M, 110M); all layers MoE as in Qwen3-MoE.
# The default run takes the first three: the fourth adds ~20 s for the same slope.
SIZES: tuple[Shape, ...] = (
    BASE,
    BASE.with_(hidden_size=256, moe_intermediate_size=256, vocab_size=4096),
    BASE.with_(hidden_size=384, moe_intermediate_size=384, num_experts=16, vocab_size=8192),
    BASE.with_(hidden_size=512, moe_intermediate_size=512, num_experts=32, vocab_size=8192),
)
DEFAULT_SIZES = SIZES[:3]
VARIANTS = ("disk", "tensor", "export", "gather")


def _measure(hf_dir: str, work: Path, rounds: int) -> dict[str, Any]:
    from moe_rl.rollout.local_engine import LocalEngine
    from moe_rl.rollout.weight_sync import DiskSync, TensorSync

    policy = common.make_policy(hf_dir)
    engine = LocalEngine(hf_dir)
    nbytes = sum(t.numel() * t.element_size() for _, t in policy.hf_tensors())
    disk, tensor, version = DiskSync(work / "versions", keep_last=1), TensorSync(), itertools.count(1)
    exports = itertools.count()

    variants = {
        "disk": lambda: disk.sync(next(version), policy.export_hf, engine),
        "tensor": lambda: tensor.sync(next(version), policy.hf_tensors(), engine),
        "export": lambda: policy.export_hf(work / f"export{next(exports)}"),
        "gather": lambda: sum(1 for _ in policy.hf_tensors()),
    }
    t = common.interleave(variants, rounds, warmup=1)
    return {"wall": t.wall, "bytes": nbytes}


def _worker(hf_dirs: list[str], rounds: int) -> list[dict[str, Any]]:
    common.setup(common.layout_for("single"))
    out = []
    for hf_dir in hf_dirs:
        with tempfile.TemporaryDirectory() as tmp:
            out.append(_measure(hf_dir, Path(tmp), rounds))
        gc.collect()
    return out


def bench_rows(rounds: int = 3, sizes: tuple[Shape, ...] = DEFAULT_SIZES) -> list[dict[str, Any]]:
    """One row per size: `{shape, params, mb, <variant>_s, <variant>_ratio, ...}`, smallest first."""
    from moe_rl.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        dirs = [common.write_model(tmp, s) for s in sizes]
        res = run_ranks(_worker, 1, dirs, rounds, timeout=1800)[0]
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for shape, r in zip(sizes, res):
        row: dict[str, Any] = {"shape": shape, "params": shape.params(), "mb": r["bytes"] / 2**20, "rounds": rounds}
        for v in VARIANTS:
            row[f"{v}_s"] = common.median(r["wall"][v])
            row[f"{v}_ratio"] = row[f"{v}_s"] / (rows[0][f"{v}_s"] if rows else row[f"{v}_s"])
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"One rank, fp32 weights, engine = LocalEngine in the trainer's process; medians of "
            f"{rows[0]['rounds']} interleaved rounds. × smallest: time against the first row "
            "(the parameter ratio is in the second column).")
    cells = []
    for r in rows:
        p = r["params"] / rows[0]["params"]
        cells.append([f"{r['params'] / 1e6:.1f}M (×{p:.0f})", f"{r['mb']:.0f}",
                      *(f"{r[f'{v}_s']:.3f} / {r['mb'] / r[f'{v}_s']:.0f} / ×{r[f'{v}_ratio']:.1f}"
                        for v in VARIANTS)])
    table = common.md_table(["parameters", "MB", "disk sync: s / MB/s / × smallest",
                             "tensor sync: s / MB/s / × smallest", "export only", "gather only"], cells)
    shapes = "; ".join(f"{r['params'] / 1e6:.1f}M = {r['shape'].label}" for r in rows)
    return f"{head}\n\n{table}\n\nModels: {shapes}."


# ------------------------------------------------------------------------------------------- --scale

SCALE_LAYOUTS = (("single", 1), ("ep2", 2), ("pp2-ep2", 4), ("tp2-ep2", 4))
SCALE_EXPERTS = (8, 32, 64)
# The variants of one round, in order (the delta first: its base is what the server holds after the round
# before); the unhashed ones compute no checksums while they push, so their push_s compare like with like.
VARIANTS_SCALE = ("sources/delta", "sources/full", "sources/full-unhashed", "funnel/full")
UNHASHED = ("sources/full-unhashed", "funnel/full")


def _variant(name: str) -> tuple[str, str, bool]:
    """A variant's row fields: path, mode, and whether it hashes the verify checksums as it sends."""
    path, mode = name.split("/")
    return path, mode.removesuffix("-unhashed"), name not in UNHASHED
SCALE_BUCKET = 4 << 20  # ~6 buckets for the 64-expert model, as 1 GiB buckets cut a 30B model into ~60


class _Counter:
    """Bytes and messages this rank moves through torch.distributed while counting is on."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.update_groups: set[Any] = set()
        self.on = False
        self.reset()
        self._orig = {k: getattr(dist, k) for k in ("isend", "irecv", "broadcast", "all_gather")}
        counter = self

        def nbytes(t: Any) -> int:
            return t.numel() * t.element_size()

        def isend(t: Any, *a: Any, **k: Any) -> Any:
            if counter.on:
                counter.sent += nbytes(t)
                counter.messages += 1
            return counter._orig["isend"](t, *a, **k)

        def irecv(t: Any, *a: Any, **k: Any) -> Any:
            if counter.on:
                counter.recv += nbytes(t)
            return counter._orig["irecv"](t, *a, **k)

        def broadcast(t: Any, src: int = 0, group: Any = None, **k: Any) -> Any:
            if counter.on and group in counter.update_groups:
                counter.sent += nbytes(t) * (dist.get_world_size(group) - 1)
                counter.messages += 1
                counter.broadcasts += 1
            return counter._orig["broadcast"](t, src, group, **k)

        def all_gather(out: Any, t: Any, group: Any = None, **k: Any) -> Any:
            if counter.on:
                n = dist.get_world_size(group)
                counter.sent += nbytes(t) * (n - 1)
                counter.recv += nbytes(t) * (n - 1)
                counter.gathers += 1
            return counter._orig["all_gather"](out, t, group, **k)

        for name, fn in (("isend", isend), ("irecv", irecv), ("broadcast", broadcast), ("all_gather", all_gather)):
            setattr(dist, name, fn)

    def reset(self) -> None:
        self.sent = self.recv = self.messages = self.gathers = self.broadcasts = 0

    def track_groups(self, *modules: Any) -> None:
        """Record the update groups the syncs of `modules` form (their `new_custom_group`)."""
        for mod in modules:
            make = mod.new_custom_group

            def wrapped(*a: Any, _make: Any = make, **k: Any) -> Any:
                pg = _make(*a, **k)
                self.update_groups.add(pg)
                return pg
            mod.new_custom_group = wrapped


def _nudge(policy: Any, round_: int, step: float = 1e-6) -> None:
    """±step on every weight (Adam's normalised update at lr = step), the same on every replica."""
    import zlib

    from megatron.core import parallel_state as ps

    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for i, chunk in enumerate(policy.chunks):
            for name, p in chunk.named_parameters():
                key = f"{round_}|{i}|{name}|tp{tp}|ep{ep if '.experts.' in name else 0}"
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                p.add_(torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * (2 * step) - step)


def _scale_worker(hf_dir: str, layout: str, url: str, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    from moe_rl.policy.compat import native
    from moe_rl.rollout.weight_sync import FunnelSync, NcclSync, WeightSyncError
    from moe_rl.rollout.weight_sync import funnel as funnel_mod
    from moe_rl.rollout.weight_sync import nccl as nccl_mod

    common.setup(common.layout_for(layout))
    counter = _Counter()
    counter.track_groups(funnel_mod, nccl_mod)
    policy = common.make_policy(hf_dir, common.layout_for(layout))
    me = dist.get_rank()
    port = common_free_port() if me == 0 else 1
    kw = dict(master_address="127.0.0.1", backend="gloo", bucket_bytes=SCALE_BUCKET, http_timeout=300.0)
    # The delta push goes first in each round: its base is what the server holds after the round before.
    syncs = {"sources/delta": NcclSync([url], master_port=common_free_port() if me == 0 else 1,
                                       group_name="bench_delta", verify=True, delta=True, **kw),
             "sources/full": NcclSync([url], master_port=port, group_name="bench_full", verify=True, **kw),
             # without the checksums hashed as it sends (`rollout.verify_weights=false`), like the funnel;
             # checked afterwards, untimed, against the sums the verified push of the round took
             "sources/full-unhashed": NcclSync([url], master_port=common_free_port() if me == 0 else 1,
                                               group_name="bench_unhashed", verify=False, **kw),
             "funnel/full": FunnelSync([url], master_port=common_free_port() if me == 0 else 1, dtype=torch.bfloat16,
                                       group_name="bench_funnel", **kw)}
    out: dict[str, Any] = {k: {"push_s": [], "sent": [], "recv": [], "messages": [], "gathers": [], "buckets": [],
                               "peak_mb": [], "verified": True, "delta_bytes": [], "verify_s": []} for k in syncs}
    for r in range(rounds + 1):  # round 0 joins the groups and makes the delta base: not timed
        _nudge(policy, r)
        for name, sync in syncs.items():  # one version label per round: the delta's base stays the servers'
            dist.barrier()
            counter.reset()
            counter.on = True
            with common.PeakAbove() as peak, native():  # as a run pushes (recipes/rl/step.py)
                t0 = time.perf_counter()
                try:
                    sync.sync(r + 1, policy)
                    ok = True
                except WeightSyncError as e:
                    ok = False
                    print(f"{name}: {e}", flush=True)
                took = time.perf_counter() - t0
            counter.on = False
            stats = getattr(sync, "stats", None)
            verify_s = stats.verify_s if stats is not None else 0.0
            if name in UNHASHED:  # checked against what the sources sent this round: the same weights
                t0 = time.perf_counter()
                problems = syncs["sources/full"]._verify(r + 1)
                verify_s = time.perf_counter() - t0
                if problems:
                    print(f"{name}: {problems[:2]}", flush=True)
                ok = ok and not problems
            if r == 0:
                continue
            row = out[name]
            row["push_s"].append(took - (verify_s if name not in UNHASHED else 0.0))
            row["verify_s"].append(verify_s)
            row["sent"].append(counter.sent)
            row["recv"].append(counter.recv)
            row["messages"].append(counter.messages)
            row["gathers"].append(counter.gathers)
            row["peak_mb"].append(peak.mb)
            row["verified"] = row["verified"] and ok
            row["buckets"].append(stats.buckets if stats is not None else counter.broadcasts)
            row["delta_bytes"].append(stats.sent_bytes if stats is not None and not stats.full else 0)
    model_bytes = sum(t.numel() * 2 for _, t in policy.hf_tensors())  # bf16, as the server holds them
    for sync in syncs.values():
        sync.close()
    out["model_bytes"] = model_bytes
    return out


def common_free_port() -> int:
    from moe_rl.testing import free_port

    return free_port()


def scale_rows(rounds: int = 3, experts: tuple[int, ...] = SCALE_EXPERTS,
               layouts: tuple[tuple[str, int], ...] = SCALE_LAYOUTS) -> list[dict[str, Any]]:
    """One row per (layout, experts, variant): the fields `--json` writes (see the module docstring)."""
    from moe_rl.testing import run_ranks
    from moe_rl.testing.serve import start_serve_process, stop_process

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for e in experts:
            hf_dir = common.write_model(tmp, BASE.with_(num_experts=e))
            server = start_serve_process(hf_dir, "--dtype", "bfloat16", routed_experts=False)
            try:
                for layout, ranks in layouts:
                    per_rank = run_ranks(_scale_worker, ranks, hf_dir, layout, server.url, rounds, timeout=1800)
                    model_bytes = sum(r["model_bytes"] for r in per_rank)
                    for variant in VARIANTS_SCALE:
                        path, mode, hashed = _variant(variant)
                        v = [r[variant] for r in per_rank]
                        busiest = max(common.median([s + rc for s, rc in zip(x["sent"], x["recv"])]) for x in v)
                        rows.append({
                            "path": path, "mode": mode, "hashed": hashed, "ranks": ranks, "layout": layout, "experts": e,
                            "model_bytes": model_bytes, "busiest_rank_bytes": int(busiest),
                            "messages_per_push": int(sum(common.median(x["messages"]) for x in v)),
                            "gathers_per_push": int(sum(common.median(x["gathers"]) for x in v)),
                            "buckets": int(sum(common.median(x["buckets"]) for x in v)),
                            "push_s": common.median([max(t) for t in zip(*(x["push_s"] for x in v))]),
                            "peak_rss_mb": max(max(x["peak_mb"]) for x in v),
                            "delta_bytes": int(sum(common.median(x["delta_bytes"]) for x in v)),
                            "verify_s": common.median([max(t) for t in zip(*(x["verify_s"] for x in v))]),
                            "verified": all(x["verified"] for x in v), "rounds": rounds})
            finally:
                stop_process(server.proc)
    return rows


def _slope(xs: list[float], ys: list[float]) -> float:
    import math

    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return float("nan")
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else float("nan")


def format_scale(rows: list[dict[str, Any]]) -> str:
    cells = [[r["path"], r["mode"], "yes" if r["hashed"] else "no", r["layout"], r["experts"], f"{r['model_bytes'] / 2**20:.1f}",
              f"{r['busiest_rank_bytes'] / r['model_bytes']:.2f}", r["messages_per_push"], r["gathers_per_push"],
              r["buckets"], f"{r['push_s']:.3f}", f"{r['verify_s']:.3f}", f"{r['peak_rss_mb']:.0f}",
              f"{r['delta_bytes'] / r['model_bytes']:.3f}" if r["mode"] == "delta" else "", r["verified"]]
             for r in rows]
    table = common.md_table(["path", "mode", "hashes as it sends", "layout", "experts", "model MB (bf16)", "busiest rank bytes / model",
                             "messages", "gathers", "buckets", "push s", "verify s", "peak MB added",
                             "delta bytes / model",
                             "verified"], cells)
    lines = []
    for variant in VARIANTS_SCALE:
        sel = [r for r in rows if (r["path"], r["mode"], r["hashed"]) == _variant(variant)]
        path, mode = variant.split("/")  # the label: "full-unhashed" says which full push
        for layout, _ in SCALE_LAYOUTS:
            by_size = [r for r in sel if r["layout"] == layout]
            if len(by_size) > 1:
                lines.append(f"- {path} {mode}, {layout}: against model size, busiest-rank bytes slope "
                             f"{_slope([r['model_bytes'] for r in by_size], [r['busiest_rank_bytes'] for r in by_size]):.2f}, "
                             f"push s slope {_slope([r['model_bytes'] for r in by_size], [r['push_s'] for r in by_size]):.2f}")
        top = max((r["experts"] for r in sel), default=0)
        by_ranks = [r for r in sel if r["experts"] == top and r["layout"] in ("single", "ep2", "pp2-ep2")]
        if len(by_ranks) > 1:
            lines.append(f"- {path} {mode}, {top} experts, single -> ep2 -> pp2-ep2: against ranks, busiest-rank "
                         f"bytes slope {_slope([r['ranks'] for r in by_ranks], [r['busiest_rank_bytes'] for r in by_ranks]):.2f}, "
                         f"push s slope {_slope([r['ranks'] for r in by_ranks], [r['push_s'] for r in by_ranks]):.2f}")
    top = max(r["experts"] for r in rows)
    for layout, _ in SCALE_LAYOUTS:
        pick = {(r["path"], r["hashed"]): r["push_s"] for r in rows if r["layout"] == layout and r["experts"] == top
                and r["mode"] == "full"}
        if ("funnel", False) in pick and ("sources", False) in pick:
            lines.append(f"- {layout}, {top} experts: the funnel's push s over the sources' (neither hashing) "
                         f"{pick['funnel', False] / pick['sources', False]:.2f}x")
    head = (f"gloo on CPU, one `moe-rl serve --dtype bfloat16` receiving, {SCALE_BUCKET >> 20} MiB buckets; medians "
            f"of {rows[0]['rounds']} rounds, the four variants alternating. messages: weight-carrying sends and "
            "update-group broadcasts per push, all ranks; gathers: the TP all-gathers of the export; delta after "
            "±1e-6 on every weight.")
    return f"{head}\n\n{table}\n\nLog-log slopes:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", type=int, nargs="+", default=list(range(len(DEFAULT_SIZES))),
                   help=f"indices into the size list (0-{len(SIZES) - 1}, smallest first)")
    p.add_argument("--scale", action="store_true", help="the update-group push over layouts and expert counts")
    p.add_argument("--experts", type=int, nargs="+", default=list(SCALE_EXPERTS), help="--scale: expert counts")
    p.add_argument("--json", help="--scale: also write the rows to this file")
    a = p.parse_args(argv)
    if a.scale:
        rows = scale_rows(a.rounds, tuple(a.experts))
        print(format_scale(rows))
        if a.json:
            Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
        return 0 if all(r["verified"] for r in rows) else 1
    print(format_table(bench_rows(a.rounds, tuple(SIZES[i] for i in a.sizes))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
