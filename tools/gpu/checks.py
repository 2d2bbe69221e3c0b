"""What the GPU check's `moe-rl train` stages must show in their runs' metrics.jsonl, with the
thresholds stated. Each check takes the stage's runs (name -> run directory), its log and its
`check_args`, and returns the stage's figures with "status" ("pass" / "fail") and "reason".

Stdlib only: the driver calls these without torch, and the CPU tests feed them metric rows.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

# Engine vs trainer, both fp32 (`moe-rl serve` runs the HF model in fp32 on the GPU, the trainer
# megatron-core in fp32): what tests/gpu allows between the GPU policy and HF on CPU (1e-3 max).
LOCAL_LOGP_ABS_DIFF = 1e-3
# Share of top-k slots where the engine's routes and the trainer's own differ: float noise may flip a
# near tie between experts, rarely, in fp32.
LOCAL_ROUTE_MISMATCH = 0.01
# A real SGLang server (its own kernels, bf16 where it chooses): the bound the SGLang colocated check
# of this script has always used.
SGLANG_LOGP_ABS_DIFF = 0.05


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of `run_dir/metrics.jsonl` (null, a NaN: None; "Infinity" strings as floats); [] when none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append({k: (float(v) if v in ("NaN", "Infinity", "-Infinity") else v) for k, v in row.items()})
    return rows


def _finite(xs: list[Any]) -> list[float]:
    return [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def _result(problems: list[str], figures: dict[str, Any], ok: str) -> dict[str, Any]:
    return {"status": "fail" if problems else "pass", "reason": "; ".join(problems) or ok, **figures}


def _steps(rows: list[dict[str, Any]], want: int, run: str, problems: list[str]) -> None:
    if len(rows) != want:
        problems.append(f"{run}: {len(rows)} steps in metrics.jsonl, expected {want}")


def pytest_summary(runs: dict[str, Path], log: str, **_: Any) -> dict[str, Any]:
    """tests/gpu: the counts of pytest's last summary line; a pass needs tests that passed and none failed
    (the exit status of pytest fails the stage on its own)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    lines = [ln for ln in log.splitlines() if re.search(r"\b(passed|failed|skipped|error|errors)\b.* in [\d.]+s", ln)]
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", lines[-1] if lines else ""):
        counts["errors" if word.startswith("error") else word] = int(n)
    problems = []
    if not lines:
        problems.append("no pytest summary line in the log")
    elif counts["failed"] or counts["errors"]:
        problems.append(f"{counts['failed']} failed, {counts['errors']} errors")
    elif not counts["passed"]:
        problems.append("no test passed (all skipped: is CUDA visible to torch?)")
    return _result(problems, counts, f"{counts['passed']} passed")


def two_turn(runs: dict[str, Path], log: str, steps: int, **_: Any) -> dict[str, Any]:
    """R3 on two-turn calculator episodes: every step's engine and trainer log-probs and routes agree
    (LOCAL_*), R3 replayed every route (replay/coverage 1), and second turns were trained on (their
    tokens counted by the per-turn mismatch, the first turns' episode ended on the tool call)."""
    rows = read_metrics(runs["tool_r3"])
    problems: list[str] = []
    _steps(rows, steps, "tool_r3", problems)
    logp = _finite([r.get("drift/logp_abs_diff") for r in rows])
    flips = _finite([r.get("drift/rollout_mismatch") for r in rows])
    turn1 = _finite([r.get("drift/logp_by_turn/1/abs_diff") for r in rows])
    cover = _finite([r.get("replay/coverage") for r in rows])
    figures = {
        "steps": len(rows),
        "logp_abs_diff_max": max(logp, default=None),
        "rollout_mismatch_max": max(flips, default=None),
        "turn1_logp_abs_diff_max": max(turn1, default=None),
        "turn1_tokens": sum(_finite([r.get("drift/rollout_mismatch_by_turn/1/num_tokens") for r in rows])),
        "turns_mean_max": max(_finite([r.get("rollout/turns_mean") for r in rows]), default=None),
        "replay_coverage_min": min(cover, default=None),
    }
    if len(logp) != len(rows) or len(flips) != len(rows):
        problems.append("a step without drift/logp_abs_diff or drift/rollout_mismatch (drift.every=1 measures each)")
    if any(x > LOCAL_LOGP_ABS_DIFF for x in logp + turn1):
        problems.append(f"engine vs trainer mean |d log p| {max(logp + turn1):.3g} > {LOCAL_LOGP_ABS_DIFF:g}")
    if any(x > LOCAL_ROUTE_MISMATCH for x in flips):
        problems.append(f"engine vs trainer route mismatch {max(flips):.3g} > {LOCAL_ROUTE_MISMATCH:g}")
    if not figures["turn1_tokens"]:
        problems.append("no second-turn token was measured (no episode called the tool)")
    if not cover or min(cover) < 1.0:
        problems.append(f"R3 replayed {min(cover, default=0):.3g} of the response routes, expected all")
    return _result(problems, figures, "engine = trainer on both turns under R3")


def samples_per_s(rows: list[dict[str, Any]]) -> float | None:
    """Steady-state samples/s of a run: the samples of steps 2..N over the wall time between the end
    of step 1 and the end of step N (the first step also pays for the first rollout's start)."""
    if len(rows) < 2:
        return None
    span = float(rows[-1]["time"]) - float(rows[0]["time"])
    done = sum(float(r.get("loss/num_seqs", 0.0)) for r in rows[1:])
    return done / span if span > 0 else None


def async_compare(runs: dict[str, Path], log: str, steps: int, **_: Any) -> dict[str, Any]:
    """K=0 vs K=1: both runs train every step; K=1's samples were generated one version behind
    (rollout/staleness_max 1: the overlap happened) and K=0's never were. The speed ratio is a
    figure, not a condition (on one GPU shared by trainer and server the overlap may not pay)."""
    problems: list[str] = []
    figures: dict[str, Any] = {}
    for k in (0, 1):
        rows = read_metrics(runs[f"k{k}"])
        _steps(rows, steps, f"k{k}", problems)
        figures[f"samples_per_s_k{k}"] = samples_per_s(rows)
        stale = max(_finite([r.get("rollout/staleness_max") for r in rows]), default=None)
        figures[f"staleness_max_k{k}"] = stale
        figures[f"step_s_median_k{k}"] = _median(_finite([r.get("perf/step_s") for r in rows[1:]]))
        if k == 0 and stale:
            problems.append(f"max_staleness=0 trained on samples {stale:g} versions old")
        if k == 1 and not stale:
            problems.append("max_staleness=1 never trained on a sample of the previous version (no overlap)")
    a, b = figures["samples_per_s_k0"], figures["samples_per_s_k1"]
    figures["k1_over_k0"] = b / a if a and b else None
    if a is None or b is None:
        problems.append("samples/s not measured (fewer than 2 steps)")
    return _result(problems, figures, "both ran; K=1 overlapped")


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def colocated(runs: dict[str, Path], log: str, steps: int, **_: Any) -> dict[str, Any]:
    """The colocated run (servers released after each rollout, resumed before the next, an eval every
    step) has the same rewards per step as the same seed not colocated, and every trained step's engine
    log-probs are the trainer's (LOCAL_LOGP_ABS_DIFF): a server that resumed without its weights, or
    with old ones, would sample other tokens or score them otherwise."""
    on, off = read_metrics(runs["colocated_true"]), read_metrics(runs["colocated_false"])
    problems: list[str] = []
    _steps(on, steps, "colocated_true", problems)
    _steps(off, steps, "colocated_false", problems)
    same = [a.get("reward/mean") == b.get("reward/mean") for a, b in zip(on, off)]
    diffs = _finite([r.get("drift/logp_abs_diff") for r in on])
    figures = {"rewards_equal": same, "logp_abs_diff_max": max(diffs, default=None), "trained_steps": len(diffs)}
    if not all(same):
        problems.append(f"rewards differ at steps {[i + 1 for i, s in enumerate(same) if not s]}")
    if not diffs:
        problems.append("no step measured drift/logp_abs_diff")
    elif max(diffs) > LOCAL_LOGP_ABS_DIFF:
        problems.append(f"colocated engine vs trainer mean |d log p| {max(diffs):.3g} > {LOCAL_LOGP_ABS_DIFF:g}")
    return _result(problems, figures, "same rewards; engine = trainer after every resume")


def colocated_sglang(runs: dict[str, Path], log: str, steps: int, **_: Any) -> dict[str, Any]:
    """A colocated SGLang server released and resumed across evals (its weights region comes back
    empty without --enable-weights-cpu-backup): the engine's log-probs stay the trainer's on every
    trained step (SGLANG_LOGP_ABS_DIFF)."""
    rows = read_metrics(runs["colocated_sglang"])
    problems: list[str] = []
    _steps(rows, steps, "colocated_sglang", problems)
    diffs = _finite([r.get("drift/logp_abs_diff") for r in rows])
    figures = {"logp_abs_diff_max": max(diffs, default=None), "trained_steps": len(diffs)}
    if not diffs:
        problems.append("no step measured drift/logp_abs_diff")
    elif max(diffs) > SGLANG_LOGP_ABS_DIFF:
        problems.append(f"SGLang vs trainer mean |d log p| {max(diffs):.3g} > {SGLANG_LOGP_ABS_DIFF:g}")
    return _result(problems, figures, "engine = trainer after every resume")


CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "pytest_summary": pytest_summary, "two_turn": two_turn, "async_compare": async_compare,
    "colocated": colocated, "colocated_sglang": colocated_sglang,
}
