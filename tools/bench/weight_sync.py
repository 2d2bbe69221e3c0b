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
against the smallest model's, to read against the parameter ratio. The NCCL path
(SGLang servers) needs GPUs and is not measured here.

    python tools/bench/weight_sync.py                     # three sizes, 3 rounds
    python tools/bench/weight_sync.py --sizes 0 1 2 3     # up to 110M parameters
"""
from __future__ import annotations

import argparse
import gc
import itertools
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", type=int, nargs="+", default=list(range(len(DEFAULT_SIZES))),
                   help=f"indices into the size list (0-{len(SIZES) - 1}, smallest first)")
    a = p.parse_args(argv)
    print(format_table(bench_rows(a.rounds, tuple(SIZES[i] for i in a.sizes))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
