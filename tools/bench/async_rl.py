"""Throughput of asynchronous RL (`algo.max_staleness` = K) on this machine, K side by side.

One trainer process and one `moe-rl serve` process, `OMP_NUM_THREADS=1` each (the 2-core
placement where generation and training can overlap at all), the demo task and model, the
same seed and batch for every K; K >= 1 pushes weights under paused requests (`rollout.
inflight_update`, default auto: retract; `--inflight in_place` to compare), so the servers
never wait for a push. Each K is a whole `moe-rl train` run; the
runs alternate over rounds so machine noise hits them alike. Reported per K, over the steps
after the pipeline filled (from step K + 2): samples per second of training time, the share
of a step the trainer waited for its batch (`perf/rollout_s`) or for the push
(`perf/weight_sync_s`), and the per-token staleness.

    python tools/bench/async_rl.py [--ks 0 1 2 4] [--steps 12] [--rounds 1] [--inflight auto|in_place|retract]
        [--task toy:add-easy] [--new-tokens 8]

`--task toy:echo-tail --new-tokens 32` is the long-tailed case: answers of 1 to 32 tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "launch" / "configs" / "tiny_cpu.yaml"


def _overrides(k: int, steps: int, new_tokens: int, run_dir: Path, inflight: str = "auto",
               task: str = "toy:add-easy") -> list[str]:
    return [f"algo.max_staleness={k}", f"rollout.inflight_update={inflight if k else 'wait'}",
            f"data.train={task}", f"data.eval={task}-eval",
            "algo.tis_cap=2.0", "train.world_size=1", "parallel.ep=1", "rollout.num_servers=1",
            f"rollout.max_new_tokens={new_tokens}", f"train.steps={steps}", "train.eval_every=0",
            "train.save_every=0", "log.progress=false", "log.tensorboard=false", f"log.run_dir={run_dir}"]


def run_one(k: int, steps: int, new_tokens: int, inflight: str = "auto",
            task: str = "toy:add-easy") -> list[dict[str, float]]:
    """One `moe-rl train` run with K; its metrics rows."""
    with tempfile.TemporaryDirectory(prefix=f"async_k{k}_") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", str(CONFIG),
                               *_overrides(k, steps, new_tokens, Path(tmp), inflight, task)],
                              capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode:
            raise RuntimeError(f"K={k}: moe-rl train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]


def summarize(k: int, rows: list[dict[str, float]], samples_per_step: int) -> dict[str, float]:
    steady = [r for r in rows if r["step"] >= k + 2] or rows
    step_s = sum(r["perf/step_s"] for r in steady)
    return {"K": k, "samples_per_s": samples_per_step * len(steady) / step_s,
            "wait_rollout": sum(r["perf/rollout_s"] for r in steady) / step_s,
            "wait_push": sum(r["perf/weight_sync_s"] for r in steady) / step_s,
            "staleness_mean": statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in steady),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in steady),
            "partial_frac": statistics.mean(r.get("rollout/partial_frac", 0.0) for r in steady)}


def compare(ks: list[int], steps: int, rounds: int, new_tokens: int, inflight: str = "auto",
            task: str = "toy:add-easy") -> str:
    from moe_rl.config import load_config

    cfg = load_config(CONFIG)
    per_step = cfg.data.prompts_per_step * cfg.rollout.n_samples
    runs: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
    for r in range(rounds):
        for k in (ks if r % 2 == 0 else ks[::-1]):
            runs[k].append(summarize(k, run_one(k, steps, new_tokens, inflight, task), per_step))
    med = {k: {key: statistics.median(s[key] for s in runs[k]) for key in runs[k][0]} for k in ks}
    base = med[ks[0]]["samples_per_s"]
    lines = [f"`{task}`, 1 trainer + 1 `moe-rl serve` (OMP_NUM_THREADS=1 each), {per_step} samples of up to "
             f"{new_tokens} tokens per step, {steps} steps, medians of {rounds} round(s); K >= 1: "
             f"rollout.inflight_update={inflight}{' (retract)' if inflight == 'auto' else ''}.",
             "", "| K | samples/s | vs K=0 | trainer waits for its batch | waits for the push | staleness "
             "mean / max (tokens) | samples spanning 2 versions |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for k in ks:
        m = med[k]
        lines.append(f"| {k} | {m['samples_per_s']:.1f} | {m['samples_per_s'] / base:.2f} | {m['wait_rollout']:.0%} | "
                     f"{m['wait_push']:.0%} | {m['staleness_mean']:.2f} / {m['staleness_max']:g} | "
                     f"{m['partial_frac']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=8, help="rollout.max_new_tokens")
    p.add_argument("--task", default="toy:add-easy", help="data.train (its -eval variant is data.eval)")
    p.add_argument("--inflight", default="auto", choices=["auto", "in_place", "retract"],
                   help="rollout.inflight_update of the K >= 1 runs")
    a = p.parse_args(argv)
    print(compare(a.ks, a.steps, a.rounds, a.new_tokens, a.inflight, a.task))


if __name__ == "__main__":
    main()
