"""R3's routes where they arrive: bytes, seconds and peak memory per SGLang reply, and per step, on the process
that receives the samples.

Synthetic `/generate` replies of SGLang's real format (one sample: `output_ids`, `meta_info` with
`finish_reason`, `output_token_logprobs` `[logprob, id, None]` per token and `routed_experts`, base64 of
int32 `[len(prompt + output) - 1, num_hidden_layers, top-k]`, dense layers' columns zero), as bytes off the
socket, go through the product's path: `json.loads` (what the server pool does with a reply body),
`moe_rl.rollout.wire.parse_reply` (the decode, the route check, the `GenerateResult`), the tensor the
step's `Samples` hold (`torch.as_tensor`) and R3's coverage of the sample
(`moe_rl.recipes.rl.replay_health.sample_cover`). Each phase is timed (best of `--reps`); the peak
resident memory of one whole intake over what the process held before is measured with VmHWM.

`--against REV` runs the same measurement, in fresh processes alternating with this tree's, on the
product at REV (a git worktree), so the two are compared side by side on one machine.

Shapes: the flagship's (launch/configs/qwen3_30b_a3b_gspo.yaml: prompts of up to 1,024 and answers of up
to 8,192 tokens, 48 MoE layers, top-8 of 128 experts; every answer at the full length, the bound) and
DeepSeek-V3's and Kimi-K2's geometry at the same lengths; plus the flagship geometry at shorter
answers, for the growth. Per step: the flagship's 512 samples, all received by trainer rank 0 today.

    python tools/bench/route_intake.py [--against REV] [--reps 3] [--rounds 2] [--json FILE] [--quick]
"""
from __future__ import annotations

import argparse
import base64
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]
PROMPT, ANSWER, SAMPLES_PER_STEP = 1024, 8192, 512
# name: (num_hidden_layers, MoE layers, top-k, experts)
GEOMETRY = {"qwen3-30b-a3b": (48, list(range(48)), 8, 128), "deepseek-v3": (61, list(range(3, 61)), 8, 256),
            "kimi-k2": (61, list(range(1, 61)), 8, 384)}


def reply_body(geometry: str, answer: int, seed: int = 0) -> bytes:
    """One sample's /generate reply as SGLang writes it (the real field names and encodings)."""
    hidden, moe, k, experts = GEOMETRY[geometry]
    rows = PROMPT + answer - 1
    g = np.random.default_rng(seed)
    ids = np.zeros((rows, hidden, k), dtype="<i4")
    # k distinct ids per token and layer: a random first id, the others E / k apart
    ids[:, moe] = (g.integers(0, experts, (rows, len(moe), 1)) + np.arange(k) * (experts // k)) % experts
    out = g.integers(0, 150_000, answer).tolist()
    meta = {"id": "0", "finish_reason": {"type": "length", "length": answer}, "prompt_tokens": PROMPT,
            "completion_tokens": answer, "cached_tokens": 0, "weight_version": "3",
            "output_token_logprobs": [[float(-x), t, None] for x, t in zip(g.random(answer), out)],
            "routed_experts": base64.b64encode(ids.tobytes()).decode("ascii")}
    return json.dumps({"text": "", "output_ids": out, "meta_info": meta}).encode()


def intake(body: bytes, geometry: str, answer: int) -> tuple[dict[str, float], Any]:
    """The product's path from reply bytes to R3's coverage of the sample; seconds per phase."""
    import torch

    from moe_rl.recipes.rl.replay_health import sample_cover
    from moe_rl.rollout.engine import GenerateRequest, SamplingParams
    from moe_rl.rollout.wire import Geometry, parse_reply

    hidden, moe, k, experts = GEOMETRY[geometry]
    geo = Geometry(num_layers=hidden, topk=k, num_experts=experts, moe_layers=moe)
    req = GenerateRequest(prompt_ids=list(range(PROMPT)), sampling=SamplingParams(n=1), return_routed_experts=True)
    t0 = time.perf_counter()
    data = json.loads(body)
    t1 = time.perf_counter()
    (res,) = parse_reply("server 0", req, data, geo)
    t2 = time.perf_counter()
    routes = torch.as_tensor(res.routed_experts)
    t3 = time.perf_counter()
    extra = [experts] if "num_experts" in inspect.signature(sample_cover).parameters else []  # REV's signature
    sample_cover(routes, PROMPT + answer - 1, len(moe), *extra)
    t4 = time.perf_counter()
    return {"json_s": t1 - t0, "parse_reply_s": t2 - t1, "to_tensor_s": t3 - t2, "cover_s": t4 - t3,
            "total_s": t4 - t0}, routes


def worker(shapes: list[tuple[str, int]], reps: int) -> list[dict[str, Any]]:
    """This process's measurement of every shape (the `moe_rl` on its path)."""
    import common

    out = []
    for geometry, answer in shapes:
        body = reply_body(geometry, answer)
        best: dict[str, float] = {}
        for _ in range(reps):
            times, routes = intake(body, geometry, answer)
            best = {key: min(v, best.get(key, v)) for key, v in times.items()}
        del routes
        with common.returned_memory(), common.PeakAbove() as peak:
            _, routes = intake(body, geometry, answer)
        b64 = json.loads(body)["meta_info"]["routed_experts"]
        out.append({"geometry": geometry, "answer": answer, "rows": PROMPT + answer - 1, "reply_bytes": len(body),
                    "routes_b64_bytes": len(b64), "routes_held_bytes": routes.numel() * routes.element_size(),
                    "peak_growth_mb": peak.mb, **best})
    return out


def measure(tree: Path, shapes: list[tuple[str, int]], reps: int) -> list[dict[str, Any]]:
    """`worker` in a fresh process importing the product from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps([shapes, reps])], env=env,
                          capture_output=True, text=True, cwd=tree)
    if proc.returncode:
        raise RuntimeError(f"route_intake worker ({tree}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def bench_rows(against: str | None = None, quick: bool = False, reps: int = 3, rounds: int = 2
               ) -> list[dict[str, Any]]:
    answers = [1024, 4096] if quick else [1024, 2048, 4096, ANSWER]
    shapes = [("qwen3-30b-a3b", a) for a in answers] + ([] if quick else [(g, ANSWER) for g in GEOMETRY
                                                                           if g != "qwen3-30b-a3b"])
    with tempfile.TemporaryDirectory(prefix="route_intake_") as tmp:
        trees = {"new": ROOT}
        if against:
            subprocess.run(["git", "worktree", "add", "--detach", "-q", f"{tmp}/rev", against], cwd=ROOT, check=True)
            trees = {against: Path(tmp) / "rev", **trees}
        try:
            runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in trees}
            for _ in range(rounds):  # alternate, so machine noise hits both alike
                for name, tree in trees.items():
                    runs[name].append(measure(tree, shapes, reps))
        finally:
            if against:
                subprocess.run(["git", "worktree", "remove", "--force", f"{tmp}/rev"], cwd=ROOT, check=False)
    rows = []
    for name, per_round in runs.items():
        for i, first in enumerate(per_round[0]):
            row = {"code": name, **first}
            for key in ("json_s", "parse_reply_s", "to_tensor_s", "cover_s", "total_s", "peak_growth_mb"):
                row[key] = min(r[i][key] for r in per_round)
            rows.append(row)
    return rows


def fit(rows: list[dict[str, Any]], code: str) -> tuple[float, float]:
    """seconds = a + b * rows, over the flagship geometry's answer lengths."""
    mine = [r for r in rows if r["code"] == code and r["geometry"] == "qwen3-30b-a3b"]
    b, a = np.polyfit([r["rows"] for r in mine], [r["total_s"] for r in mine], 1)
    return float(a), float(b)


def format_table(rows: list[dict[str, Any]]) -> str:
    from common import md_table

    per_reply = md_table(
        ["code", "geometry", "answer", "reply MB", "routes b64 MB", "held MB", "json s", "parse_reply s",
         "to tensor s", "R3 cover s", "total s", "peak growth MB"],
        [[r["code"], r["geometry"], r["answer"], f"{r['reply_bytes'] / 1e6:.1f}", f"{r['routes_b64_bytes'] / 1e6:.1f}",
          f"{r['routes_held_bytes'] / 1e6:.1f}", f"{r['json_s']:.3f}", f"{r['parse_reply_s']:.3f}",
          f"{r['to_tensor_s']:.4f}", f"{r['cover_s']:.4f}", f"{r['total_s']:.3f}", f"{r['peak_growth_mb']:.0f}"]
         for r in rows])
    step = []
    for code in dict.fromkeys(r["code"] for r in rows):
        for r in (r for r in rows if r["code"] == code and r["answer"] == max(x["answer"] for x in rows)):
            step.append([code, r["geometry"], f"{SAMPLES_PER_STEP * r['reply_bytes'] / 1e9:.2f}",
                         f"{SAMPLES_PER_STEP * r['total_s']:.1f}"])
    fits, flagship_rows = [], PROMPT + ANSWER - 1
    for code in dict.fromkeys(r["code"] for r in rows):
        a, b = fit(rows, code)
        fits.append(f"- `{code}`: seconds per reply = {a:.4f} + {b * 1e6:.2f}e-6 x rows (48 MoE layers, top-8); at "
                    f"the flagship's {flagship_rows} rows x {SAMPLES_PER_STEP} samples: "
                    f"{SAMPLES_PER_STEP * (a + b * flagship_rows):.1f} s per step")
    return (per_reply + "\n\nPer step on the receiving process (trainer rank 0 receives all "
            f"{SAMPLES_PER_STEP} samples today), every answer at {max(r['answer'] for r in rows)} tokens:\n\n"
            + md_table(["code", "geometry", "GB in per step", "seconds per step"], step) + "\n\n" + "\n".join(fits))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", help="also measure the product at this git revision, side by side")
    p.add_argument("--reps", type=int, default=3, help="timed intakes per shape (the best counts)")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per code, alternating")
    p.add_argument("--quick", action="store_true", help="two short answers of the flagship geometry only")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        shapes, reps = json.loads(a.worker)
        print(json.dumps(worker([tuple(s) for s in shapes], reps)))
        return
    rows = bench_rows(a.against, a.quick, a.reps, a.rounds)
    print(format_table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
