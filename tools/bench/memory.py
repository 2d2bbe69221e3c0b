"""Bytes the RL step stores per token for routing replay: recorded routes against log-probs.

R2/R3 keep every token's routed experts from the old-log-prob pass (or the rollout
engine) until the last update of the step. Their size is L·K·itemsize bytes per
token (L MoE layers, top-K, ids in the smallest integer type that holds them,
`moe_rl.routes.route_dtype`); the log-probs kept alongside are 4 bytes (fp32).

Measured rows build small models of each shape, run `Policy.logprobs(seqs,
record_routes=True)` and divide the returned tensors' bytes (numel × element
size) by the tokens they cover. The last rows apply the same rule to published
model shapes (computed, not measured). SGLang sends routes as int32 (4 bytes per id).

The old pass records into a buffer of expert id + 1 (0 = not seen on this rank) and
all-reduces it over TP x PP as bytes (`moe_rl.routes.record_dtype`,
`_merge_ids_over_model_parallel`): L·K·itemsize of that type per token, one id more
than the stored routes hold, so 256 experts (DeepSeek-V3) store 1 byte per id and
reduce 2 (int16 as two uint8 planes: gloo and NCCL reduce no 16-bit integer; int32
would be 4).

Peak memory per rank is a column of the overhead and scaling tables.

    python tools/bench/memory.py
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import Shape

# Small on purpose: only the routes' shape matters here, not the compute.
_SMALL = Shape(vocab_size=128, hidden_size=64, head_dim=16, moe_intermediate_size=16)
SHAPES: tuple[Shape, ...] = (
    _SMALL.with_(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2),
    _SMALL.with_(num_hidden_layers=4, num_experts=64, num_experts_per_tok=2),
    _SMALL.with_(num_hidden_layers=4, num_experts=64, num_experts_per_tok=8),
    _SMALL.with_(num_hidden_layers=8, num_experts=64, num_experts_per_tok=8),
    _SMALL.with_(num_hidden_layers=2, num_experts=512, num_experts_per_tok=8),
)
# (name, MoE layers, experts, top-k) of published models, for scale.
PUBLISHED = (("Qwen3-30B-A3B", 48, 128, 8), ("Qwen3-235B-A22B", 94, 128, 8), ("DeepSeek-V3", 58, 256, 8),
             ("Kimi-K2", 60, 384, 8))


def _worker(hf_dirs: list[str], batch: int, seq: int) -> list[dict[str, Any]]:
    common.setup(common.layout_for("single"))
    out = []
    for hf_dir in hf_dirs:
        policy = common.make_policy(hf_dir)
        lp = policy.logprobs(common.random_batch(batch, seq, common.read_vocab(hf_dir)), record_routes=True)
        tokens = lp.logp.shape[0] * lp.logp.shape[1]  # [B, T - 1]: one scored position per token
        out.append({"routes_shape": tuple(lp.routes.shape), "dtype": str(lp.routes.dtype).replace("torch.", ""),
                    "route_bytes": lp.routes.numel() * lp.routes.element_size() / tokens,
                    "logp_bytes": lp.logp.numel() * lp.logp.element_size() / tokens})
        del policy
    return out


def bench_rows(shapes: tuple[Shape, ...] = SHAPES, batch: int = 4, seq: int = 64) -> list[dict[str, Any]]:
    """Measured rows `{layers, experts, topk, dtype, route_bytes, logp_bytes, measured=True}`, then
    the published shapes computed by the same rule (`measured=False`)."""
    from moe_rl.routes import route_dtype
    from moe_rl.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        dirs = [common.write_model(tmp, s) for s in shapes]
        res = run_ranks(_worker, 1, dirs, batch, seq, timeout=900)[0]
    rows = [{"model": "small, measured", "layers": s.num_hidden_layers, "experts": s.num_experts,
             "topk": s.num_experts_per_tok, "measured": True, **r} for s, r in zip(shapes, res)]
    for name, layers, experts, k in PUBLISHED:
        dt = route_dtype(experts)
        rows.append({"model": name, "layers": layers, "experts": experts, "topk": k, "measured": False,
                     "dtype": str(dt).replace("torch.", ""), "route_bytes": layers * k * dt.itemsize,
                     "logp_bytes": 4.0})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    from moe_rl.routes import record_dtype

    cells = [[r["model"], r["layers"], r["experts"], r["topk"], r["dtype"], f"{r['route_bytes']:.0f}",
              f"{r['logp_bytes']:.0f}", f"{r['route_bytes'] / r['logp_bytes']:.1f}",
              f"{r['layers'] * r['topk'] * record_dtype(r['experts']).itemsize:.0f}",
              f"{r['layers'] * r['topk'] * 4:.0f}", f"{r['route_bytes'] * 1e6 / 2**20:.0f}"]
             for r in rows]
    table = common.md_table(["model", "MoE layers", "experts", "top-k", "id dtype", "routes B/token",
                             "log-probs B/token", "routes × log-probs", "recorded, reduced over TP×PP B/token",
                             "as int32 (SGLang) B/token", "routes MiB per 1M tokens"], cells, "lrrrlrrrrrr")
    return ("Measured rows: `Policy.logprobs(record_routes=True)` on small models, bytes of the returned "
            "tensors / tokens; named rows: L·K·itemsize for published shapes. The recording buffer's bytes "
            "(id + 1, all-reduced as bytes) are L·K·itemsize of `record_dtype` in every row.\n\n" + table)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(format_table(bench_rows()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
