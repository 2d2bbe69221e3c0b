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

`--learn`: learning against K, over seeds. For each K and seed (model.seed = data.shuffle_seed = the
seed) a whole run of `--steps` steps of `--prompts` prompts x `--samples` samples at `--lr`, with
`--minibatches` updates per step (defaults: the issue's task shape, 32 x 8, 4 updates, lr 3e-3), and
per K: the median steps to 0.8 (the first step whose batch success rate, averaged with the two steps
before it, reaches 0.8) with its interquartile range, the seeds that never got there, the seeds on
which the collapse alarm (`drift.alarm.collapse_steps`, its defaults, replayed on the metrics) fired,
the final success (mean of the last 5 steps) and samples/s. `--set key=value` adds overrides to
every run (e.g. `--set algo.tis_cap=2.0`); `--jobs 2` runs two at once (samples/s is then shared).

    python tools/bench/async_rl.py --learn --ks 0 2 --seeds 10 --task toy:last-parity --new-tokens 2 \
        [--lr 3e-3] [--steps 80] [--jobs 2] [--json learn.json]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "launch" / "configs" / "tiny_cpu.yaml"


def _overrides(k: int, steps: int, new_tokens: int, run_dir: Path, inflight: str = "auto",
               task: str = "toy:add-easy") -> list[str]:
    return [f"algo.max_staleness={k}", f"rollout.inflight_update={inflight if k else 'wait'}",
            f"data.train={task}", f"data.eval={task}-eval",
            "algo.tis_cap=2.0", "train.world_size=1", "parallel.ep=1", "rollout.num_servers=1",
            f"rollout.max_new_tokens={new_tokens}", f"train.steps={steps}", "train.eval_every=0",
            "train.save_every=0", "log.progress=false", "log.tensorboard=false", f"log.run_dir={run_dir}"]


def _train(what: str, overrides: Callable[[Path], list[str]]) -> list[dict[str, Any]]:
    """One whole `moe-rl train` run of the demo config with `overrides(run_dir)`; its metrics rows."""
    with tempfile.TemporaryDirectory(prefix="async_rl_") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", str(CONFIG),
                               *overrides(Path(tmp))], capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode:
            raise RuntimeError(f"{what}: moe-rl train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]


def run_one(k: int, steps: int, new_tokens: int, inflight: str = "auto",
            task: str = "toy:add-easy") -> list[dict[str, float]]:
    """One `moe-rl train` run with K; its metrics rows."""
    return _train(f"K={k}", lambda run_dir: _overrides(k, steps, new_tokens, run_dir, inflight, task))


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


# ------------------------------------------------------------------------------------------- --learn

LEARNED = 0.8  # the success rate a run must reach (its 3-step running mean)


def learn_overrides(k: int, seed: int, a: argparse.Namespace, run_dir: Path) -> list[str]:
    common = [f"algo.max_staleness={k}", f"rollout.inflight_update={a.inflight if k else 'wait'}",
              f"train.steps={a.steps}", f"model.seed={seed}", f"data.shuffle_seed={seed}", "train.eval_every=0",
              "train.save_every=0", "drift.enabled=false", "log.progress=false", "log.tensorboard=false",
              "log.report=false", f"log.run_dir={run_dir}", *a.set]
    if a.demo:  # the demo config as a user runs it (its layout, task, batch, lr): only K and the seed change
        return common
    return [*common, "train.world_size=1", "parallel.ep=1", "rollout.num_servers=1",
            f"data.train={a.task}", f"data.eval={a.task}-eval", f"data.prompts_per_step={a.prompts}",
            f"rollout.n_samples={a.samples}", f"rollout.max_new_tokens={a.new_tokens}",
            f"algo.num_minibatches={a.minibatches}", f"train.lr={a.lr}"]


def learn_one(k: int, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    """One whole run; what it learned, from its metrics."""
    rows = _train(f"K={k} seed {seed}", lambda run_dir: learn_overrides(k, seed, a, run_dir))
    return learned(k, seed, rows, a.prompts * a.samples)


def learned(k: int, seed: int, rows: list[dict[str, Any]], samples_per_step: int) -> dict[str, Any]:
    from moe_rl.drift.alarm import Alarms
    from moe_rl.drift.config import AlarmConfig

    success = [r["reward/success_rate"] for r in rows]
    reached = next((r["step"] for i, r in enumerate(rows) if i >= 2 and sum(success[i - 2:i + 1]) / 3 >= LEARNED),
                   None)
    alarms, collapsed = Alarms(AlarmConfig(), asynchronous=True), None
    for r in rows:
        alarms.check(r["step"], r)
        collapsed = collapsed or (r["step"] if alarms.fired else None)
    return {"K": k, "seed": seed, "steps_to_0.8": reached, "collapsed_at": collapsed,
            "final_success": statistics.mean(success[-5:]),
            "samples_per_s": samples_per_step * len(rows) / sum(r["perf/step_s"] for r in rows),
            "entropy_final": statistics.mean(r.get("rollout/entropy", float("nan")) for r in rows[-5:]),
            "approx_kl_max": max(r["loss/approx_kl"] for r in rows),
            "staleness_mean": statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in rows)}


def learn(a: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    jobs = [(k, seed) for seed in range(a.seeds) for k in a.ks]  # each seed's Ks side by side
    done: list[dict[str, Any]] = []
    lock = threading.Lock()  # --jobs runs finish on several threads

    def one(k: int, seed: int) -> dict[str, Any]:
        row = learn_one(k, seed, a)
        with lock:
            done.append(row)
            if a.json:  # the runs so far, so a failed run late in a long sweep loses nothing before it
                Path(a.json).write_text(json.dumps({"rows": done}, indent=1))
        return row

    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda ks: one(*ks), jobs))
    if a.demo:
        shape = "the demo config as it is (`launch/configs/tiny_cpu.yaml`: its layout, task, batch and lr)"
    else:
        shape = (f"`{a.task}`, {a.prompts} prompts x {a.samples} samples of up to {a.new_tokens} tokens, "
                 f"{a.minibatches} updates per step, lr {a.lr}")
    lines = [f"{shape}, {a.steps} steps, seeds 0-{a.seeds - 1}"
             + (f", {' '.join(a.set)}" if a.set else "") + f"; {a.jobs} run(s) at a time.", "",
             "| K | steps to 0.8: median [IQR] | missed | collapsed (alarm) | final success (median) | samples/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for k in a.ks:
        mine = [r for r in rows if r["K"] == k]
        hit = sorted(r["steps_to_0.8"] for r in mine if r["steps_to_0.8"] is not None)
        quart = statistics.quantiles(hit, n=4) if len(hit) > 1 else hit * 3
        spread = f"{statistics.median(hit):g} [{quart[0]:g}-{quart[2]:g}]" if hit else "-"
        lines.append(f"| {k} | {spread} | {len(mine) - len(hit)}/{len(mine)} | "
                     f"{sum(r['collapsed_at'] is not None for r in mine)}/{len(mine)} | "
                     f"{statistics.median(r['final_success'] for r in mine):.2f} | "
                     f"{statistics.median(r['samples_per_s'] for r in mine):.0f} |")
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=8, help="rollout.max_new_tokens")
    p.add_argument("--task", default="toy:add-easy", help="data.train (its -eval variant is data.eval)")
    p.add_argument("--inflight", default="auto", choices=["auto", "in_place", "retract"],
                   help="rollout.inflight_update of the K >= 1 runs")
    p.add_argument("--learn", action="store_true", help="learning against K over seeds (see above)")
    p.add_argument("--seeds", type=int, default=10, help="--learn: seeds 0..N-1")
    p.add_argument("--lr", type=float, default=3e-3, help="--learn: train.lr")
    p.add_argument("--prompts", type=int, default=32, help="--learn: data.prompts_per_step")
    p.add_argument("--samples", type=int, default=8, help="--learn: rollout.n_samples")
    p.add_argument("--minibatches", type=int, default=4, help="--learn: algo.num_minibatches")
    p.add_argument("--demo", action="store_true",
                   help="--learn: the demo config's own layout, task, batch and lr (--task/--lr/--prompts/... ignored)")
    p.add_argument("--set", action="append", default=[], help="--learn: one more override key=value (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="--learn: runs at a time")
    p.add_argument("--json", help="--learn: also write the per-run rows here")
    a = p.parse_args(argv)
    if a.learn:
        if a.demo:  # the demo's own batch (for samples/s) and, unless given, its steps
            demo = yaml.safe_load(CONFIG.read_text())
            a.prompts, a.samples = demo["data"]["prompts_per_step"], demo["rollout"]["n_samples"]
            a.steps = demo["train"]["steps"] if a.steps == 12 else a.steps
        elif a.steps == 12:  # the throughput mode's default is too short to learn anything
            a.steps = 80
        table, rows = learn(a)
        print(table)
        if a.json:
            Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
        return
    print(compare(a.ks, a.steps, a.rounds, a.new_tokens, a.inflight, a.task))


if __name__ == "__main__":
    main()
